"""Timing helpers shared by every package's ``benchmarks/bench_*.py`` (CUDA only).

Ours and PyTorch's are timed in the same process with CUDA events, medians over samples, data
rotated through enough copies to outgrow L2, and the device copy bandwidth measured in the
same run so results can be read as a fraction of what the memory system delivers.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import torch


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


def time_ms(calls: Sequence[Callable[[], object]], samples: int, min_calls: int = 10, warmup: int = 2) -> float:
    """Median per-call GPU time of back-to-back runs through ``calls`` (one per data copy)."""
    rounds = max(1, math.ceil(min_calls / len(calls)))
    for _ in range(warmup):  # state creation, caching allocator, lazy init
        for call in calls:
            call()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # ~0.5 ms of GPU work while the host queues the sample
        start.record()
        for _ in range(rounds):
            for call in calls:
                call()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / (rounds * len(calls)))
    return statistics.median(per_call)


def copy_bandwidth_gbps(samples: int) -> float:
    """Device-to-device copy of 1 GiB, counting bytes read plus bytes written."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms([lambda: dst.copy_(src)], samples, min_calls=5)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return lines


__all__ = ["copies_for_l2", "copy_bandwidth_gbps", "markdown_table", "nbytes", "require_kernels", "time_ms"]
