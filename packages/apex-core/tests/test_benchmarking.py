"""apex.core.benchmarking's report helpers (the benchmarks' shared header and table layout)."""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch

from apex.core.benchmarking import (
    ClockSample,
    GpuClockMonitor,
    against_torch,
    bench_arguments,
    compare_ms,
    environment,
    finish,
    markdown_table,
    parse_clock_sample,
    progress,
    report,
    summarize_clocks,
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


def test_report_names_the_kernel_switches_set(monkeypatch):
    from apex.core import cli

    for name in cli.KERNEL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert not any("kernel switches" in line for line in report("bench_x", ["body"], cpu=True).splitlines())
    monkeypatch.setenv("APEX_CUBLASLT_DISABLE", "all")
    assert "- kernel switches set: APEX_CUBLASLT_DISABLE=all" in report("bench_x", ["body"], cpu=True).splitlines()


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


def test_parse_clock_sample_reads_nvidia_smi_lines():
    s = parse_clock_sample("2026/12/07 10:12:17.611, 1560, 699.19, 0x0000000000000004\n")
    assert (s.sm_mhz, s.watts, s.reasons) == (1560.0, 699.19, 4)
    assert s.time == datetime.datetime(2026, 12, 7, 10, 12, 17, 611000).timestamp()
    assert parse_clock_sample("2026/12/07 10:12:17.611, 1980, [N/A], 0x0000000000000000").watts is None
    for line in (
        "timestamp, clocks.sm [MHz], power.draw [W], clocks_event_reasons.active",
        "",
        "No devices were found",
    ):
        assert parse_clock_sample(line) is None


def test_summarize_clocks_counts_the_limiting_reasons_only():
    samples = [
        ClockSample(0, 1980, 130.0, 0x1),
        ClockSample(1, 1560, 699.0, 0x4),
        ClockSample(2, 1845, None, 0x4 | 0x20),
    ]
    got = summarize_clocks(samples)
    assert (got.samples, got.median_mhz, got.min_mhz, got.max_mhz, got.max_watts) == (3, 1845, 1560, 1980, 699.0)
    assert got.limited == pytest.approx(2 / 3) and got.reasons == ("power cap", "thermal")  # idle (0x1) is not
    assert got.describe() == "1845 MHz (1560-1980), 699 W, power cap/thermal in 67% of 3 samples"
    calm = summarize_clocks([ClockSample(0, 1980, None, 0)])
    assert calm.describe() == "1980 MHz (1980-1980), no clock limit of 1 samples"
    assert summarize_clocks([]) is None


def test_gpu_clock_monitor_samples_nvidia_smi_in_the_background(tmp_path, monkeypatch):
    # A stand-in nvidia-smi: records its arguments, prints three samples (10:00:00, :01, :02), then waits
    # to be stopped as the real one would.
    (tmp_path / "args").write_text("")
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {tmp_path / "args"}\n'
        + "".join(f'echo "2026/12/07 10:00:0{i}.000, {1900 - 100 * i}, 500.5, 0x{4 * (i > 0):x}"\n' for i in range(3))
        + "exec sleep 30\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with GpuClockMonitor(interval_ms=20) as clocks:
        for _ in range(200):
            if len(clocks.samples) == 3:
                break
            time.sleep(0.05)
    args = (tmp_path / "args").read_text()
    assert "-lms=20" in args and "--query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active" in args
    assert [s.sm_mhz for s in clocks.samples] == [1900, 1800, 1700]
    t0 = datetime.datetime(2026, 12, 7, 10, 0, 0).timestamp()
    later = clocks.summary([(t0 + 0.5, t0 + 2.5)])  # the second and third samples
    assert (later.samples, later.median_mhz, later.limited, later.reasons) == (2, 1750, 1.0, ("power cap",))
    assert clocks.summary().samples == 3
    assert clocks.summary([(t0 + 10, t0 + 11)]) is None


def test_gpu_clock_monitor_without_nvidia_smi_gives_no_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi
    with GpuClockMonitor() as clocks:
        pass
    assert clocks.samples == [] and clocks.summary() is None


def test_gpu_clock_monitor_disabled_runs_nothing(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\ntouch {tmp_path / 'ran'}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with GpuClockMonitor(enabled=False) as clocks:
        pass
    assert not (tmp_path / "ran").exists() and clocks.summary() is None


def test_report_names_the_clock_of_a_busy_gpu(monkeypatch, capsys):
    from apex.core import benchmarking

    clocks = GpuClockMonitor()  # not entered: the samples are given
    clocks.samples = [ClockSample(0, 1980, 90.0, 0x1), ClockSample(1, 1600, 700.0, 0x4), ClockSample(2, 1700, 690.0, 0)]
    monkeypatch.setattr(benchmarking, "_run_clocks", clocks)
    text = report("bench_x", ["body"], cpu=False)
    # the idle sample (0x1) is left out
    want = "- SM clock while the GPU was busy (nvidia-smi every 50 ms): 1650 MHz (1600-1700), 700 W, "
    want += "power cap in 50% of 2 samples"
    assert want in text.splitlines()
    assert "SM clock" not in report("bench_x", ["body"], cpu=True)
    monkeypatch.setattr(benchmarking, "_run_clocks", None)
    assert "SM clock" not in report("bench_x", ["body"], cpu=False)
    capsys.readouterr()
