"""Load/save throughput of apex.contrib.gpu_direct_storage: GPUDirect Storage (modes r/w, torch.cuda.gds) against
plain file I/O (modes rn/wn, through host memory) and torch.save/torch.load, for CUDA tensors.

    python packages/apex-contrib-gpu-direct-storage/benchmarks/bench_gpu_direct_storage.py [--dir DIR] [--out DIR]

Files go to ``--dir`` (default: a temporary folder; GDS needs a filesystem with O_DIRECT and cuFile support, and
the GDS rows are left out, saying why, where it has none). Per size: median seconds over samples of saving and of
loading one float32 CUDA tensor, and GB/s. The page cache makes the plain reads optimistic (the file was just
written); drop caches between runs for cold numbers. Bar: GDS load and save at least GDS_BAR of the plain
path's throughput (GDS exists to be faster).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from apex.contrib.gpu_direct_storage import GDSFile
from apex.core.benchmarking import bench_arguments, finish, require_cuda, verdict

SIZES_BYTES = [16 << 20, 256 << 20, 1 << 30]
GDS_BAR = 1.0
HEADER = ["bytes", "path", "save s", "load s", "save GB/s", "load GB/s"]


def seconds(fn, samples: int) -> float:
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(path: str, size: int, samples: int, write_mode: str, read_mode: str) -> tuple[float, float]:
    x = torch.randn(size // 4, device="cuda")
    y = torch.empty_like(x)
    save, load = ("save_data", "load_data") if write_mode == "w" else ("save_data_no_gds", "load_data_no_gds")

    def do_save():
        with GDSFile(path, write_mode) as f:
            getattr(f, save)(x)

    def do_load():
        with GDSFile(path, read_mode) as f:
            getattr(f, load)(y)

    save_s = seconds(do_save, samples)
    load_s = seconds(do_load, samples)
    assert torch.equal(x, y), f"{write_mode}/{read_mode}: the loaded tensor differs"
    return save_s, load_s


def measure_torch(path: str, size: int, samples: int) -> tuple[float, float]:
    x = torch.randn(size // 4, device="cuda")
    save_s = seconds(lambda: torch.save(x, path), samples)
    load_s = seconds(lambda: torch.load(path, map_location="cuda"), samples)
    return save_s, load_s


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_gpu_direct_storage", __doc__, samples=5)
    parser.add_argument("--dir", type=Path, help="folder for the files (a GDS-capable filesystem)")
    args = parser.parse_args(argv)
    if not require_cuda("bench_gpu_direct_storage"):
        return 1
    warnings.simplefilter("ignore", FutureWarning)  # GDSFile's deprecation warning
    folder = args.dir or Path(tempfile.mkdtemp(prefix="bench-gds-"))
    rows, verdicts, notes = [], [], []
    for size in SIZES_BYTES:
        path = str(folder / f"bench-{size}.bin")
        results = {"plain (rn/wn)": measure(path, size, args.samples, "wn", "rn")}
        try:
            results["GDS (r/w)"] = measure(path, size, args.samples, "w", "r")
        except (RuntimeError, OSError) as error:
            notes.append(f"{size} bytes: GDS not measured: {error}")
        results["torch.save/load"] = measure_torch(path + ".pt", size, args.samples)
        for name, (save_s, load_s) in results.items():
            rows.append(
                [
                    str(size),
                    name,
                    f"{save_s:.4f}",
                    f"{load_s:.4f}",
                    f"{size / save_s / 1e9:.2f}",
                    f"{size / load_s / 1e9:.2f}",
                ]
            )
        if "GDS (r/w)" in results:
            (gds_save, gds_load), (plain_save, plain_load) = results["GDS (r/w)"], results["plain (rn/wn)"]
            verdicts.append(verdict(f"{size} bytes: GDS save speed / plain", plain_save / gds_save, GDS_BAR))
            verdicts.append(verdict(f"{size} bytes: GDS load speed / plain", plain_load / gds_load, GDS_BAR))
    return finish("bench_gpu_direct_storage", HEADER, rows, verdicts, out=args.out, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
