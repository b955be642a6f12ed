"""trace_gaps.py on a hand-made trace whose gaps and their causes are known."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trace_gaps


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _trace():
    # Host thread 1: the forward phase; a slow Python op, then aten::mm launches kernel B late.
    # Kernel D was launched early (t=100) but starts after a 100 us gap: not the host's fault.
    return [
        _x("user_annotation", "e2e step: forward", 0, 500),
        _x("cpu_op", "aten::add", 0, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 5, 2, correlation=1),
        _x("python_function", "slow_python", 90, 48),
        _x("cpu_op", "aten::mm", 138, 7),
        _x("cuda_runtime", "cudaLaunchKernel", 140, 2, correlation=2),
        _x("cpu_op", "aten::relu", 95, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 100, 2, correlation=3),
        _x("cuda_runtime", "cudaLaunchKernel", 300, 2, correlation=4),
        _x("kernel", "A", 10, 90, tid=20, correlation=1),
        _x("kernel", "B", 150, 50, tid=20, correlation=2),
        _x("kernel", "C", 160, 140, tid=21, correlation=4),  # another stream, overlapping B: no gap
        _x("kernel", "D", 400, 10, tid=20, correlation=3),
        {"ph": "i", "name": "instant", "ts": 1},  # not a complete event: ignored
    ]


def test_gaps_their_launches_and_the_host_meanwhile(tmp_path):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    gaps, busy, span = trace_gaps.find_gaps(trace_gaps.load_events(path), min_us=10)
    assert [(g.start, g.end, g.after) for g in gaps] == [(100, 150, "B"), (300, 400, "D")]
    late, waiting = gaps
    assert late.late and late.launch_wait == pytest.approx(10) and late.phase == "forward"
    assert late.launcher == "aten::mm"
    assert late.host_ops == {"slow_python": pytest.approx(38), "aten::relu": pytest.approx(5), "aten::mm": 2}
    assert not waiting.late and waiting.launch_wait == pytest.approx(300) and waiting.host_ops == {}
    assert busy == pytest.approx(90 + 150 + 10) and span == pytest.approx(400)

    text = "\n".join(trace_gaps.report(path, 10, 5))
    assert "2 gaps of at least 10 us hold 0.150 ms" in text
    assert "(the GPU waited for the host): 0.050 ms; launched before (waiting on something else): 0.100 ms" in text
    assert "| forward | 0.050 |" in text and "| slow_python | 0.038 |" in text


def test_min_us_and_plain_json(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_trace()))  # a bare event list is read too
    gaps, _, _ = trace_gaps.find_gaps(trace_gaps.load_events(path), min_us=60)
    assert [g.after for g in gaps] == ["D"]


def test_the_spin_kernel_queued_ahead_is_not_the_steps_work(tmp_path):
    # bench_e2e queues torch.cuda._sleep's kernel before the profiled step; a trace that caught it
    # must not count it as busy time, nor start the span at it.
    path = tmp_path / "t.json"
    spin = _x("kernel", "spin_kernel(long)", -5000, 5005, tid=20, correlation=0)
    path.write_text(json.dumps([spin, *_trace()]))
    gaps, busy, span = trace_gaps.find_gaps(trace_gaps.load_events(path), min_us=10)
    assert [g.after for g in gaps] == ["B", "D"]
    assert busy == pytest.approx(90 + 150 + 10) and span == pytest.approx(400)


def test_kernels_by_the_op_that_launched_them(tmp_path):
    # A by aten::add; B by aten::mm (inside no other op); D by aten::relu inside slow_python; C's
    # launch at 300 is inside the forward phase only: "-".
    totals = trace_gaps.kernels_by_launcher(_trace())
    assert totals == {
        ("aten::add", "A"): [1, 90.0],
        ("aten::mm", "B"): [1, 50.0],
        ("-", "C"): [1, 140.0],
        ("slow_python > aten::relu", "D"): [1, 10.0],
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_trace()))
    text = "\n".join(trace_gaps.report(path, 10, 5))
    assert "| - | C | 1 | 0.140 |" in text and "| slow_python > aten::relu | D | 1 | 0.010 |" in text
