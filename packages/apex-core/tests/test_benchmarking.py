"""apex.core.benchmarking's report helpers (the benchmarks' shared header and table layout)."""

from __future__ import annotations

import torch

from apex.core.benchmarking import markdown_table, report, verdict


def test_verdict_passes_at_and_above_the_bar_only():
    assert verdict("x", 1.2, 1.2).startswith("PASS: x")
    assert verdict("x", 1.19, 1.2).startswith("FAIL: x (measured 1.19, bar 1.20)")


def test_markdown_table_has_a_separator_and_one_line_per_row():
    lines = markdown_table(["a", "b"], [["1", "2"], ["3", "4"]])
    assert lines == ["| a | b |", "|---|---|", "| 1 | 2 |", "| 3 | 4 |"]


def test_report_on_the_cpu_names_the_cpu_and_writes_the_file(tmp_path, capsys):
    text = report("bench_x", ["| a |", "PASS: y"], out=tmp_path, notes=["a note"], cpu=True)
    header = text.splitlines()
    assert header[0] == "# bench_x"
    assert header[2].startswith(f"- device: cpu, {torch.get_num_threads()} threads; torch {torch.__version__};")
    assert "- a note" in header and header[-1] == "PASS: y"
    assert (tmp_path / "bench_x.md").read_text() == text
    assert capsys.readouterr().out.startswith("# bench_x")
