"""apex.core.benchmarking's report helpers (the benchmarks' shared header and table layout)."""

from __future__ import annotations

import os

import pytest
import torch

from apex.core.benchmarking import (
    against_torch,
    bench_arguments,
    compare_ms,
    environment,
    finish,
    markdown_table,
    progress,
    report,
    verdict,
)


def test_verdict_passes_at_and_above_the_bar_only():
    assert verdict("x", 1.2, 1.2).startswith("PASS: x")
    assert verdict("x", 1.19, 1.2).startswith("FAIL: x (measured 1.19, bar 1.20)")


def test_against_torch_gives_the_cells_and_three_verdicts():
    # 1 GB in 0.5 ms is 2000 GB/s, half of a 4000 GB/s copy; eager 3x, compiled 0.9x of ours
    cells, verdicts = against_torch(
        "case fwd", {"ours": 0.5, "eager": 1.5, "compiled": 0.45}, 1e9, 4000.0, {"eager": 2, "compiled": 1, "copy": 0.8}
    )
    assert cells == ["0.5000", "1.5000", "0.4500", "3.00", "0.90", "2000", "50.0"]
    assert verdicts == [
        "PASS: case fwd: eager/ours >= 2 (measured 3.00, bar 2.00)",
        "FAIL: case fwd: compiled/ours >= 1 (measured 0.90, bar 1.00)",
        "FAIL: case fwd: fraction of copy bandwidth >= 0.8 (measured 0.50, bar 0.80)",
    ]


def test_markdown_table_has_a_separator_and_one_line_per_row():
    lines = markdown_table(["a", "b"], [["1", "2"], ["3", "4"]])
    assert lines == ["| a | b |", "|---|---|", "| 1 | 2 |", "| 3 | 4 |"]


def test_compare_ms_takes_one_sample_of_each_variant_a_round_in_rotating_order():
    warmed, order = [], []
    variants = {
        name: [lambda name=name: warmed.append(name)] * copies for name, copies in (("a", 1), ("b", 2), ("c", 5))
    }
    per_call = {"a": [1.0, 5.0, 2.0, 9.0], "b": [3.0, 3.5, 4.0, 0.5], "c": [7.0, 7.0, 8.0, 7.5]}

    def sample(calls, rounds):
        name = next(k for k, v in variants.items() if v is calls)
        order.append((name, rounds))
        return per_call[name][sum(1 for n, _ in order if n == name) - 1]

    medians = compare_ms(variants, samples=4, min_calls=10, warmup=1, sample=sample)
    assert warmed == ["a", "b", "b", "c", "c", "c", "c", "c"]  # every call once before any sample
    names = [n for n, _ in order]
    assert names == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert dict(order) == {"a": 10, "b": 5, "c": 2}  # rounds: at least min_calls calls a sample
    assert medians == {"a": 3.5, "b": 3.25, "c": 7.25}


def test_compare_ms_sets_each_variants_environment_around_its_warm_up_and_samples(monkeypatch):
    monkeypatch.delenv("APEX_TEST_SWITCH", raising=False)
    seen = []

    def call():
        seen.append(("call", os.environ.get("APEX_TEST_SWITCH")))

    variants = {"on": [call], "off": [call]}

    def sample(calls, rounds):
        seen.append(("sample", os.environ.get("APEX_TEST_SWITCH")))
        return 1.0

    compare_ms(variants, samples=2, warmup=1, sample=sample, settings={"on": {"APEX_TEST_SWITCH": "x"}})
    assert seen == [("call", "x"), ("call", None), ("sample", "x"), ("sample", None), ("sample", None), ("sample", "x")]
    assert "APEX_TEST_SWITCH" not in os.environ  # restored after each


def test_progress_prints_the_row_to_stderr_at_once(capsys):
    progress(["a", "1.5x"])
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "| a | 1.5x |\n")


def test_report_on_the_cpu_names_the_cpu_and_writes_the_file(tmp_path, capsys):
    text = report("bench_x", ["| a |", "PASS: y"], out=tmp_path, notes=["a note"], cpu=True)
    header = text.splitlines()
    assert header[0] == "# bench_x"
    assert header[2].startswith(f"- device: cpu, {torch.get_num_threads()} threads; torch {torch.__version__};")
    assert "- a note" in header and header[-1] == "PASS: y"
    assert (tmp_path / "bench_x.md").read_text() == text
    assert capsys.readouterr().out.startswith("# bench_x")


def test_finish_reports_the_count_and_fails_on_any_fail_line(tmp_path, capsys):
    rows = [["1"]]
    assert finish("bench_y", ["a"], rows, ["PASS: p", "PASS: q"], out=tmp_path, cpu=True) == 0
    assert (tmp_path / "bench_y.md").read_text().endswith("| 1 |\n\nPASS: p\nPASS: q\n\n2 PASS, 0 FAIL\n")
    assert finish("bench_y", ["a"], rows, ["PASS: p", "FAIL: q (measured 0.50, bar 1.00)"], cpu=True) == 1
    assert "1 PASS, 1 FAIL" in capsys.readouterr().out


def test_bench_arguments_parse_the_shared_options(tmp_path):
    args = bench_arguments("bench_z", "doc", samples=7, no_compile=True).parse_args(["--out", str(tmp_path)])
    assert (args.out, args.samples, args.no_compile) == (tmp_path, 7, False)
    assert not hasattr(bench_arguments("bench_z", "doc").parse_args([]), "no_compile")


def test_environment_sets_and_removes_variables_and_restores_them(monkeypatch):
    monkeypatch.setenv("APEX_TEST_KEPT", "before")
    monkeypatch.delenv("APEX_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError), environment(APEX_TEST_NEW="1", APEX_TEST_KEPT=None):
        assert os.environ["APEX_TEST_NEW"] == "1" and "APEX_TEST_KEPT" not in os.environ
        raise RuntimeError  # restored on the way out of an error too
    assert "APEX_TEST_NEW" not in os.environ and os.environ["APEX_TEST_KEPT"] == "before"
