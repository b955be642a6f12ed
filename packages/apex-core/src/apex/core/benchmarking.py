"""Timing and reporting helpers shared by every package's ``benchmarks/bench_*.py`` (CUDA only).

Ours and PyTorch's are timed in the same process with CUDA events, medians over samples, data
rotated through enough copies to outgrow L2, and the device copy bandwidth measured in the
same run so results can be read as a fraction of what the memory system delivers. Every
benchmark prints (and with ``--out DIR`` writes) one Markdown report through :func:`report`,
whose header names the device, the versions, the time and the command.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


def require_cuda(script: str, devices: int = 1) -> bool:
    """Whether ``devices`` CUDA devices are visible; if not, says so on stderr (the caller exits 1).
    If so (one device), the GPU's clock is watched for the rest of the run (:func:`watch_clocks`)."""
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found >= devices:
        if devices == 1:  # a multi-process run's ranks pick their devices later
            watch_clocks()
        return True
    needs = "a CUDA device" if devices == 1 else f"{devices} CUDA devices, found {found}"
    print(f"{script}: needs {needs}", file=sys.stderr)
    return False


def require_kernels(plugin_name: str) -> None:
    """Fail unless the plugin's CUDA kernels are loaded: a benchmark of the fallback is meaningless."""
    from apex.core import loader, plugins

    record = plugins.get(plugin_name)
    plugins.import_ops(record)
    status = loader.load(record.plugin.kernel_library)
    assert status.has_kernels, f"{plugin_name}: kernels not loaded ({status.reason})"


def copies_for_l2(list_bytes: int) -> int:
    """How many copies of the data a sample cycles through so that it outgrows L2 twice over."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = getattr(props, "L2_cache_size", 64 << 20) or (64 << 20)
    return max(1, math.ceil(2 * l2 / max(list_bytes, 1)))


def _warm(calls: Sequence[Callable[[], object]], warmup: int) -> None:
    for _ in range(warmup):  # state creation, caching allocator, lazy init
        for call in calls:
            call()


def _sample_ms(calls: Sequence[Callable[[], object]], rounds: int) -> float:
    """One timed sample: ``rounds`` passes through ``calls`` back to back, ms per call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # ~0.5 ms of GPU work while the host queues the sample
    start.record()
    for _ in range(rounds):
        for call in calls:
            call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (rounds * len(calls))


def time_ms(calls: Sequence[Callable[[], object]], samples: int, min_calls: int = 10, warmup: int = 2) -> float:
    """Median per-call GPU time of back-to-back runs through ``calls`` (one per data copy)."""
    rounds = max(1, math.ceil(min_calls / len(calls)))
    _warm(calls, warmup)
    torch.cuda.synchronize()
    return statistics.median(_sample_ms(calls, rounds) for _ in range(samples))


def compare_ms(
    variants: Mapping[str, Sequence[Callable[[], object]]],
    samples: int,
    min_calls: int = 10,
    warmup: int = 2,
    *,
    sample: Callable[[Sequence[Callable[[], object]], int], float] | None = None,
    settings: Mapping[str, Mapping[str, str | None]] | None = None,
) -> dict[str, float]:
    """:func:`time_ms` of each variant (name -> its calls), sampled in turn: every round takes one
    sample of each variant, in an order that rotates from round to round, instead of all samples of
    one variant before the next. A drift over the run (clocks, temperature, the allocator's or L2's
    state) then falls on every variant alike rather than on whichever was timed first: variants
    that run the same kernels measured up to 0.26 ms apart, both ways, timed one after another
    (conv-bias-relu on an H100, 2026-12-05). ``settings`` gives a variant environment variables
    (:func:`environment`) set around its warm-up and each of its samples, not around each call:
    switches such as ``APEX_CUBLASLT_DISABLE`` compared in one process. ``sample`` replaces the
    timed sample (tests)."""
    sample = sample or _sample_ms
    settings = settings or {}
    names = list(variants)
    rounds = {name: max(1, math.ceil(min_calls / len(variants[name]))) for name in names}
    for name in names:
        with environment(**settings.get(name, {})):
            _warm(variants[name], warmup)
    if sample is _sample_ms:
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(samples):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            with environment(**settings.get(name, {})):
                times[name].append(sample(variants[name], rounds[name]))
    return {name: statistics.median(values) for name, values in times.items()}


@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """Environment variables set (None: removed) inside the block and restored after it: for the
    switches kernels read on every call, such as apex-core's cuBLASLt runner's ``APEX_CUBLASLT_*``."""

    def put(settings: dict) -> None:
        for name, value in settings.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    saved = {name: os.environ.get(name) for name in values}
    try:
        put(values)
        yield
    finally:
        put(saved)


def copy_bandwidth_gbps(samples: int) -> float:
    """Device-to-device copy of 1 GiB, counting bytes read plus bytes written."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms([lambda: dst.copy_(src)], samples, min_calls=5)
    return gb_per_s(2 * src.numel() * src.element_size(), ms)


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def gb_per_s(bytes_moved: float, ms: float) -> float:
    """Effective bandwidth of moving ``bytes_moved`` bytes in ``ms`` milliseconds."""
    return bytes_moved / (ms * 1e-3) / 1e9


def verdict(name: str, value: float, bar: float) -> str:
    """One PASS/FAIL line of a bar that ``value`` meets when it is at least ``bar``."""
    return f"{'PASS' if value >= bar else 'FAIL'}: {name} (measured {value:.2f}, bar {bar:.2f})"


def against_torch(
    label: str, ms: Mapping[str, float], bytes_moved: float, copy_gbps: float, bars: Mapping[str, float]
) -> tuple[list[str], list[str]]:
    """One memory-bound case timed as ``ms["ours"]``, ``ms["eager"]`` and ``ms["compiled"]``: its table
    cells (the three times, eager / ours, compiled / ours, ours' GB/s and % of ``copy_gbps``) and its
    verdicts against ``bars["eager"]``, ``bars["compiled"]`` (speedups) and ``bars["copy"]`` (a fraction
    of the copy bandwidth), each named after ``label``."""
    gbps = gb_per_s(bytes_moved, ms["ours"])
    speedup, vs_compiled, of_copy = ms["eager"] / ms["ours"], ms["compiled"] / ms["ours"], gbps / copy_gbps
    cells = [f"{ms[k]:.4f}" for k in ("ours", "eager", "compiled")]
    cells += [f"{speedup:.2f}", f"{vs_compiled:.2f}", f"{gbps:.0f}", f"{100 * of_copy:.1f}"]
    verdicts = [
        verdict(f"{label}: eager/ours >= {bars['eager']}", speedup, bars["eager"]),
        verdict(f"{label}: compiled/ours >= {bars['compiled']}", vs_compiled, bars["compiled"]),
        verdict(f"{label}: fraction of copy bandwidth >= {bars['copy']}", of_copy, bars["copy"]),
    ]
    return cells, verdicts


def progress(row: Sequence[str]) -> None:
    """Print one measured row to stderr at once (the report comes at the end): a run cut short by a
    time limit still shows what it measured."""
    print("| " + " | ".join(row) + " |", file=sys.stderr, flush=True)


GPU_IDLE = 0x1  # nvidia-smi's clocks_event_reasons bit of a GPU with nothing to run
# nvidia-smi's clocks_event_reasons bits that lower the SM clock for power or heat. Idle (0x1) and the
# application-clock setting (0x2) are not a slowdown of work in flight.
CLOCK_LIMITS = {
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x20: "thermal",
    0x40: "hardware thermal",
    0x80: "power brake",
}
_LIMIT_MASK = sum(CLOCK_LIMITS)


@dataclass(frozen=True)
class ClockSample:
    time: float  # seconds since the epoch: nvidia-smi's timestamp of the sample
    sm_mhz: float
    watts: float | None  # None where the board does not report its power draw
    reasons: int  # clocks_event_reasons.active


@dataclass(frozen=True)
class ClockSummary:
    samples: int
    median_mhz: float
    min_mhz: float
    max_mhz: float
    max_watts: float | None
    limited: float  # fraction of the samples with a CLOCK_LIMITS reason active
    reasons: tuple[str, ...]  # those reasons, by name

    def describe(self) -> str:
        """``1695 MHz (1560-1845), 699 W, power cap in 100% of 12 samples``."""
        watts = f", {self.max_watts:.0f} W" if self.max_watts is not None else ""
        why = f"{'/'.join(self.reasons)} in {100 * self.limited:.0f}%" if self.reasons else "no clock limit"
        return (
            f"{self.median_mhz:.0f} MHz ({self.min_mhz:.0f}-{self.max_mhz:.0f}){watts}, {why} of {self.samples} samples"
        )


def parse_clock_sample(line: str) -> ClockSample | None:
    """One line of ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active
    --format=csv,noheader,nounits``, or None for a line that is not one (a header, an error)."""
    cells = [c.strip() for c in line.split(",")]
    if len(cells) != 4:
        return None
    try:
        when = datetime.datetime.strptime(cells[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()  # the machine's local time
        mhz = float(cells[1])
        reasons = int(cells[3], 16)
    except ValueError:
        return None
    try:
        watts = float(cells[2])
    except ValueError:  # "[N/A]"
        watts = None
    return ClockSample(when, mhz, watts, reasons)


def summarize_clocks(samples: Sequence[ClockSample]) -> ClockSummary | None:
    if not samples:
        return None
    mhz = [s.sm_mhz for s in samples]
    watts = [s.watts for s in samples if s.watts is not None]
    active = 0
    for s in samples:
        active |= s.reasons
    return ClockSummary(
        samples=len(samples),
        median_mhz=statistics.median(mhz),
        min_mhz=min(mhz),
        max_mhz=max(mhz),
        max_watts=max(watts) if watts else None,
        limited=sum(1 for s in samples if s.reasons & _LIMIT_MASK) / len(samples),
        reasons=tuple(name for bit, name in CLOCK_LIMITS.items() if active & bit),
    )


class GpuClockMonitor:
    """The GPU's SM clock, power draw and clock-limit reasons, sampled by ``nvidia-smi -lms`` in the
    background while timed work runs, so that a report can say at which clock its figures were taken.

    A GPU held at its power limit lowers its clock under sustained load: an H100 (700 W) ran GPT-2's
    timed training steps at 1560-1845 MHz instead of 1980, about 8% slower than the same kernels in one
    profiled step. A profile alone does not show that. ::

        with GpuClockMonitor(device) as clocks:
            start = time.time(); run(); spans.append((start, time.time()))
        print(clocks.summary(spans).describe())

    Without nvidia-smi on PATH (or on a machine without an NVIDIA GPU), or with ``enabled=False``,
    nothing is sampled and :meth:`summary` gives None; a report says "n/a".
    """

    QUERY = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"

    def __init__(self, device: torch.device | int | None = None, interval_ms: int = 50, enabled: bool = True):
        self.interval_ms = interval_ms
        self.device = device
        self.enabled = enabled  # False: sample nothing (a CPU run)
        self.samples: list[ClockSample] = []
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def _select(self) -> list[str]:
        """nvidia-smi's ``-i`` for the CUDA device (its UUID: CUDA's numbering may not be nvidia-smi's)."""
        if self.device is None or not torch.cuda.is_available():
            return []
        index = self.device.index if isinstance(self.device, torch.device) else self.device
        uuid = getattr(
            torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index), "uuid", None
        )
        return ["-i", f"GPU-{uuid}"] if uuid is not None else []

    def __enter__(self) -> GpuClockMonitor:
        exe = shutil.which("nvidia-smi") if self.enabled else None
        if exe is None:
            return self
        command = [exe, *self._select(), f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits"]
        try:
            self._proc = subprocess.Popen(
                [*command, f"-lms={self.interval_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        except OSError:
            return self
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            sample = parse_clock_sample(line)
            if sample is not None:
                self.samples.append(sample)

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def summary(
        self, spans: Sequence[tuple[float, float]] | None = None, busy_only: bool = False
    ) -> ClockSummary | None:
        """The samples taken within any of ``spans`` (``time.time()`` pairs; all samples without), less
        those of an idle GPU with ``busy_only``; None where none is left."""
        picked = [s for s in self.samples if spans is None or any(a <= s.time <= b for a, b in spans)]
        return summarize_clocks([s for s in picked if not (busy_only and s.reasons & GPU_IDLE)])


_run_clocks: GpuClockMonitor | None = None  # the process's watch (watch_clocks)


def watch_clocks() -> GpuClockMonitor | None:
    """Sample the current GPU's clock for the rest of the process (started once; stopped at exit), so
    that :func:`report` can say at which clock the run's figures were taken. None without CUDA."""
    global _run_clocks
    if _run_clocks is None and torch.cuda.is_available():
        _run_clocks = GpuClockMonitor(torch.cuda.current_device()).__enter__()
        atexit.register(_run_clocks.__exit__, None, None, None)
    return _run_clocks


def run_clock_note() -> str | None:
    """The report's line on the clock of the run so far: the samples of a busy GPU, or None (no watch,
    no nvidia-smi, nothing busy sampled)."""
    summary = _run_clocks.summary(busy_only=True) if _run_clocks is not None else None
    if summary is None:
        return None
    return f"SM clock while the GPU was busy (nvidia-smi every {_run_clocks.interval_ms} ms): {summary.describe()}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return lines


def report(
    name: str,
    body: Iterable[str],
    *,
    out: Path | None = None,
    copy_gbps: float | None = None,
    notes: Iterable[str] = (),
    devices: int = 1,
    cpu: bool = False,
) -> str:
    """Print a benchmark's Markdown report and, with ``out``, write it to ``out/<name>.md``.

    The header: ``# name``; the device (``devices`` of them, with the NCCL version when more
    than one; the CPU and its thread count with ``cpu=True`` or where there is no GPU), torch
    and CUDA versions and the UTC time; the command line; the copy bandwidth measured in the
    run, when given; then one bullet per note, one naming the kernel switches set in the environment
    (``apex.core.cli.KERNEL_SWITCHES``; none when all are unset), and one on the SM clock while the GPU was busy where
    the run watched it (:func:`watch_clocks`, started by :func:`require_cuda`). ``body`` (tables,
    verdicts) follows after a blank line. Returns the text.
    """
    if cpu or not torch.cuda.is_available():  # CPU runs (smoke runs, the CPU path's benchmarks)
        gpu, versions = f"cpu, {torch.get_num_threads()} threads", f"torch {torch.__version__}"
    else:
        gpu = torch.cuda.get_device_name(0)
        versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    if devices > 1 and not cpu and torch.cuda.is_available():
        gpu = f"{devices}x {gpu}"
        nccl = torch.cuda.nccl.version()
        versions += f", NCCL {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}"
    lines = [
        f"# {name}",
        "",
        f"- device: {gpu}; {versions}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- command: `python {' '.join(sys.argv)}`",
    ]
    if copy_gbps is not None:
        lines.append(f"- device copy bandwidth (D2D copy, bytes read + written): {copy_gbps:.0f} GB/s")
    lines += [f"- {note}" for note in notes]
    from apex.core.cli import kernel_switches

    switches = kernel_switches()
    if switches != "(defaults)":  # a run that did not take the default kernels says so
        lines.append(f"- kernel switches set: {switches}")
    clock = None if cpu else run_clock_note()
    if clock is not None:
        lines.append(f"- {clock}")
    text = "\n".join([*lines, "", *body]) + "\n"
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.md").write_text(text)
    return text


def bench_arguments(
    name: str, doc: str | None, *, samples: int = 15, no_compile: bool = False
) -> argparse.ArgumentParser:
    """The options every benchmark takes: ``--out DIR`` (the report also goes to ``DIR/<name>.md``)
    and ``--samples N`` (timed samples per measurement, the median reported); ``--no-compile``
    (skip the torch.compile column) with ``no_compile``. Add the benchmark's own, then parse."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help=f"also write the report to DIR/{name}.md")
    parser.add_argument("--samples", type=int, default=samples, help="timed samples per measurement (median)")
    if no_compile:
        parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    return parser


def finish(
    name: str,
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    verdicts: Sequence[str],
    *,
    out: Path | None = None,
    copy_gbps: float | None = None,
    notes: Iterable[str] = (),
    cpu: bool = False,
) -> int:
    """A benchmark's last step: :func:`report` of its table, its PASS/FAIL lines and their count.
    Returns the exit status, 0 when every line passes."""
    failed = sum(not line.startswith("PASS") for line in verdicts)
    body = [*markdown_table(header, rows), "", *verdicts, "", f"{len(verdicts) - failed} PASS, {failed} FAIL"]
    report(name, body, out=out, copy_gbps=copy_gbps, notes=notes, cpu=cpu)
    return 0 if failed == 0 else 1


__all__ = [
    "CLOCK_LIMITS",
    "GPU_IDLE",
    "ClockSample",
    "ClockSummary",
    "GpuClockMonitor",
    "bench_arguments",
    "compare_ms",
    "copies_for_l2",
    "copy_bandwidth_gbps",
    "environment",
    "finish",
    "gb_per_s",
    "markdown_table",
    "nbytes",
    "parse_clock_sample",
    "progress",
    "report",
    "require_cuda",
    "require_kernels",
    "run_clock_note",
    "summarize_clocks",
    "time_ms",
    "verdict",
    "watch_clocks",
]
