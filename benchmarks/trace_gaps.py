"""Where a profiled step leaves the GPU idle, and what the host was doing meanwhile.

Reads a Chrome trace written by ``torch.profiler`` (``bench_e2e.py --trace DIR`` writes one per model
and stack, ``.json.gz``) and finds the gaps between consecutive GPU activities (kernels, copies,
fills; every stream together) longer than ``--min-us``. For each gap it follows the kernel after it
back to its launch (the CUDA runtime or driver call with the same correlation id) on the host:

- whether it was launched after the GPU went idle (the GPU waited for the host), or before (it
  waited on something else: a stream wait, an event), and its launch-to-start time;
- the host's work during the gap: every CPU op on the launching thread that overlaps the stretch
  from the gap's start to the launch, by inclusive time summed over the gaps (a profile of the host
  while the GPU waited), and the step phase (``bench_e2e``'s "e2e step: ..." ranges) of the launch.

Then the GPU time of every kernel by the op that launched it (the innermost host op around the
launch, with its parent): where a step's device time goes, kernel by kernel, named by what asked
for it (cuBLAS's and cuDNN's kernels say nothing of the layer they serve).

The profiler's own per-op cost is in the host times (more per op than an unprofiled run pays), so
read the ranking, not the absolute numbers. It can also make gaps that an unprofiled run does not
have: GPT-2's compiled step took 64 ms of host time under the profiler against 24 ms without, and
its traced back-to-back steps (``--trace-steps``) waited 28 ms on the host where the timed steps
waited on nothing. Whether unprofiled steps wait on the host: ``bench_e2e.py --phase-steps N``.

    python benchmarks/trace_gaps.py out/gpt2-apex-eager.json.gz [--min-us 10] [--top 15]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from apex.core.benchmarking import markdown_table

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function")
PHASE = "e2e step: "  # bench_e2e.PHASE (not imported: that module builds the models' stacks)
SPIN_KERNEL = "spin_kernel"  # bench_e2e queues one ahead of the profiled step; not the step's work


@dataclass
class Gap:
    start: float  # us: the end of the GPU's busy stretch
    end: float  # us: the start of the activity after it
    after: str  # that activity's name
    launch_wait: float | None  # us from its launch to its start (None: launch not found)
    late: bool  # launched after the GPU went idle: the GPU waited for the host
    phase: str  # the step phase of the launch, or "-"
    launcher: str  # the innermost CPU op around the launch, or "-"
    host_ops: dict[str, float] = field(default_factory=dict)  # op -> us of overlap with [start, launch]

    @property
    def us(self) -> float:
        return self.end - self.start


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def index_events(events: list[dict], phases: bool) -> tuple[dict, dict[object, list[dict]]]:
    """The launches by correlation id, and the host events by (pid, tid) (with the step phases or not)."""
    launches = {}
    host_by_thread: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
        elif e.get("cat") in HOST_CATEGORIES and (phases or not e["name"].startswith(PHASE)):
            host_by_thread[(e.get("pid"), e.get("tid"))].append(e)
    return launches, host_by_thread


def find_gaps(events: list[dict], min_us: float) -> tuple[list[Gap], float, float]:
    """The gaps of at least ``min_us`` between GPU activities; also the busy time and the span."""
    gpu = sorted(
        (e for e in events if e.get("cat") in GPU_CATEGORIES and SPIN_KERNEL not in e.get("name", "")),
        key=lambda e: e["ts"],
    )
    launches, host_by_thread = index_events(events, phases=True)
    gaps: list[Gap] = []
    busy = 0.0
    busy_start = busy_end = None
    for e in gpu:
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if busy_end is None:
            busy_start, busy_end = start, end
            continue
        if start - busy_end >= min_us:
            gaps.append(describe_gap(busy_end, e, launches, host_by_thread))
        if start > busy_end:
            busy += busy_end - busy_start
            busy_start = start
        busy_end = max(busy_end, end)
    if busy_end is not None:
        busy += busy_end - busy_start
    span = (busy_end - float(gpu[0]["ts"])) if gpu else 0.0
    return gaps, busy, span


def describe_gap(gap_start: float, nxt: dict, launches: dict, host_by_thread: dict) -> Gap:
    start = float(nxt["ts"])
    gap = Gap(gap_start, start, nxt.get("name", "?"), None, False, "-", "-")
    launch = launches.get(nxt.get("args", {}).get("correlation"))
    if launch is None:
        return gap
    at = float(launch["ts"])
    gap.launch_wait = start - at
    gap.late = at > gap_start
    host = host_by_thread.get((launch.get("pid"), launch.get("tid")), [])
    around = [e for e in host if float(e["ts"]) <= at <= float(e["ts"]) + float(e["dur"])]
    phases = [e["name"][len(PHASE) :] for e in around if e["name"].startswith(PHASE)]
    if phases:
        gap.phase = phases[-1]
    ops = [e for e in around if not e["name"].startswith(PHASE)]
    if ops:
        gap.launcher = min(ops, key=lambda e: float(e["dur"]))["name"]
    for e in host:
        if e["name"].startswith(PHASE):
            continue
        lo, hi = max(float(e["ts"]), gap_start), min(float(e["ts"]) + float(e["dur"]), at)
        if hi > lo:
            gap.host_ops[e["name"]] = gap.host_ops.get(e["name"], 0.0) + (hi - lo)
    return gap


def kernels_by_launcher(events: list[dict]) -> dict[tuple[str, str], list[float]]:
    """(launching op, kernel name) -> [calls, us] over the GPU activities of the trace. The launching
    op is the innermost host event around the launch on its thread (not a step phase), written
    ``parent > op`` where it has a parent; "-" where the launch or an op around it is not found."""
    launches, ops_by_thread = index_events(events, phases=False)
    launches_by_thread: dict[object, list[tuple[float, object]]] = defaultdict(list)
    for corr, e in launches.items():
        launches_by_thread[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), corr))
    launcher: dict[object, str] = {}  # correlation id -> label
    for thread, ops in ops_by_thread.items():
        ops.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))  # parents before their children
        mine = sorted(launches_by_thread.get(thread, []))
        stack: list[dict] = []
        i = 0
        for at, corr in mine:
            while i < len(ops) and float(ops[i]["ts"]) <= at:
                # an op that ends where the next starts is its neighbour, not its parent
                while stack and float(stack[-1]["ts"]) + float(stack[-1]["dur"]) <= float(ops[i]["ts"]):
                    stack.pop()
                stack.append(ops[i])
                i += 1
            while stack and float(stack[-1]["ts"]) + float(stack[-1]["dur"]) < at:
                stack.pop()
            if stack:
                names = [e["name"] for e in stack[-2:]]
                launcher[corr] = " > ".join(names)
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") not in GPU_CATEGORIES or SPIN_KERNEL in e.get("name", ""):
            continue
        key = (launcher.get(e.get("args", {}).get("correlation"), "-"), e.get("name", "?"))
        totals[key][0] += 1
        totals[key][1] += float(e["dur"])
    return dict(totals)


def report(path: Path, min_us: float, top: int) -> list[str]:
    events = load_events(path)
    gaps, busy, span = find_gaps(events, min_us)
    idle = sum(g.us for g in gaps)
    lines = [
        f"# {path.name}",
        "",
        f"GPU span {span / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms, idle {(span - busy) / 1e3:.3f} ms; "
        f"{len(gaps)} gaps of at least {min_us:g} us hold {idle / 1e3:.3f} ms",
        "",
    ]
    by_phase: dict[str, float] = defaultdict(float)  # late gaps only
    late = waiting = 0.0
    host: dict[str, float] = defaultdict(float)
    for g in gaps:
        if g.late:
            by_phase[g.phase] += g.us
            late += g.us
        else:
            waiting += g.us
        for name, us in g.host_ops.items():
            host[name] += us
    lines.append(
        f"idle in gaps whose next kernel was launched after the GPU went idle (the GPU waited for "
        f"the host): {late / 1e3:.3f} ms; launched before (waiting on something else): {waiting / 1e3:.3f} ms"
    )

    def ms_rows(totals: dict[str, float], limit: int | None = None) -> list[list[str]]:
        return [[name, f"{us / 1e3:.3f}"] for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:limit]]

    lines += ["", *markdown_table(["phase of the late launch", "idle ms"], ms_rows(by_phase))]
    lines += ["", *markdown_table([f"host op during the gaps (inclusive, top {top})", "ms"], ms_rows(host, top))]
    rows = [
        [
            str(i + 1),
            f"{g.us:.1f}",
            "yes" if g.late else "no",
            "-" if g.launch_wait is None else f"{g.launch_wait:.1f}",
            g.phase,
            g.launcher[:60],
            g.after[:60],
        ]
        for i, g in enumerate(sorted(gaps, key=lambda g: -g.us)[:top])
    ]
    header = [f"largest gaps (top {top})", "us", "launched after idle", "launch-to-start us", "phase", "launched by"]
    lines += ["", *markdown_table([*header, "next"], rows)]
    kernels = sorted(kernels_by_launcher(events).items(), key=lambda kv: -kv[1][1])[:top]
    rows = [[op[:90], name[:70], str(int(calls)), f"{us / 1e3:.3f}"] for (op, name), (calls, us) in kernels]
    header = [f"launched by (top {top} by GPU time)", "kernel", "calls", "ms"]
    lines += ["", *markdown_table(header, rows)]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path, help="Chrome traces (.json or .json.gz)")
    parser.add_argument("--min-us", type=float, default=10.0, help="shortest gap counted (us)")
    parser.add_argument("--top", type=int, default=15, help="rows per table")
    args = parser.parse_args(argv)
    for path in args.traces:
        print("\n".join(report(path, args.min_us, args.top)), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
