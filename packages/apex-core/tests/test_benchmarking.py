"""apex.core.benchmarking's report helpers (the benchmarks' shared header and table layout)."""

from __future__ import annotations

import os

import pytest
import torch

from apex.core.benchmarking import bench_arguments, environment, finish, markdown_table, progress, report, verdict


def test_verdict_passes_at_and_above_the_bar_only():
    assert verdict("x", 1.2, 1.2).startswith("PASS: x")
    assert verdict("x", 1.19, 1.2).startswith("FAIL: x (measured 1.19, bar 1.20)")


def test_markdown_table_has_a_separator_and_one_line_per_row():
    lines = markdown_table(["a", "b"], [["1", "2"], ["3", "4"]])
    assert lines == ["| a | b |", "|---|---|", "| 1 | 2 |", "| 3 | 4 |"]


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
