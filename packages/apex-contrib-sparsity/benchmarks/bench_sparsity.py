"""apex.contrib.sparsity: create_mask per pattern on typical weights, and the channel permutation
search on one model, on CUDA when there is a GPU, else on the CPU.

    python packages/apex-contrib-sparsity/benchmarks/bench_sparsity.py [--out DIR] [--samples N] [--cpu]
        [--width W]

create_mask: per weight shape and pattern, the median time in ms (CUDA-synchronized wall clock,
after a warm-up) and, for m4n2_1d, upstream's method written in PyTorch (|W| times the table of
the 6 valid 2:4 patterns, argmax) for comparison. Permutation: ``Permutation.permute_model`` on
an MLP/conv model of ``--width`` channels (default 512 on CUDA, 128 on the CPU), each strategy,
with the magnitude 2:4 pruning keeps before and after. No PASS/FAIL bar is set: it prints times.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from apex.contrib.sparsity import create_mask
from apex.contrib.sparsity.permutation_lib import Permutation
from apex.contrib.sparsity.sparse_masklib import as_matrix, compute_valid_1d_patterns
from apex.core.benchmarking import bench_arguments, markdown_table, report

SHAPES = [(4096, 4096), (1024, 4096), (256, 256, 3, 3)]
PATTERNS = ["m4n2_1d", "m4n2_2d_greedy", "m4n2_2d_best", "m8n4_1d"]
STRATEGIES = {
    "exhaustive, windows of 8": {"strategy": "exhaustive", "stripe_group_size": 8, "escape_attempts": 100},
    "channel swap": {"strategy": "channel_swap", "escape_attempts": 100},
}


def wall_ms(fn, samples: int, device: str) -> float:
    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    fn()
    sync()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def upstream_style_1d(weight: torch.Tensor) -> torch.Tensor:
    """Upstream's m4n2_1d in PyTorch: the best of the 6 patterns of every group by a matmul."""
    patterns = compute_valid_1d_patterns(4, 2).to(weight.device)
    groups = as_matrix(weight.float()).reshape(-1, 4).abs()
    return patterns[torch.argmax(groups @ patterns.t(), dim=1)]


class Model(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(16, width, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(width)
        self.conv2 = torch.nn.Conv2d(width, width, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(width)
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.fc1 = torch.nn.Linear(width, width)
        self.fc2 = torch.nn.Linear(width, width)
        self.fc3 = torch.nn.Linear(width, 16)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y))) + y
        h = self.pool(y).flatten(1)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(h)))))


def kept(model) -> float:
    total = 0.0
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) and module.weight.shape[1] % 4 == 0:
            weight = module.weight.detach()
            total += float((weight * create_mask(weight)).abs().sum())
    return total


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_sparsity", __doc__, samples=5)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where there is a GPU")
    parser.add_argument("--width", type=int, default=None, help="channels of the permutation model")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    torch.manual_seed(0)

    rows = []
    for shape in SHAPES:
        weight = torch.randn(shape, device=device, dtype=torch.float16 if device == "cuda" else torch.float32)
        # both keep the same magnitude (the masks may differ where two pairs tie)
        magnitude = as_matrix(weight.float()).reshape(-1, 4).abs()
        ours_kept = (magnitude * as_matrix(create_mask(weight).float()).reshape(-1, 4)).sum()
        torch.testing.assert_close(ours_kept, (magnitude * upstream_style_1d(weight)).sum(), rtol=1e-6, atol=0)
        for pattern in PATTERNS:
            ours = wall_ms(lambda w=weight, p=pattern: create_mask(w, p), args.samples, device)
            upstream = (
                f"{wall_ms(lambda w=weight: upstream_style_1d(w), args.samples, device):.2f}"
                if pattern == "m4n2_1d"
                else "-"
            )
            rows.append(
                ["x".join(map(str, shape)), str(weight.dtype).removeprefix("torch."), pattern, f"{ours:.2f}", upstream]
            )
    body = markdown_table(["shape", "dtype", "pattern", "create_mask ms", "upstream's method in torch ms"], rows)

    width = args.width or (512 if device == "cuda" else 128)
    permutation_rows = []
    for name, options in STRATEGIES.items():
        torch.manual_seed(1)
        model = Model(width).to(device).eval()
        before = kept(model)
        Permutation._reset_state()
        Permutation.set_search_options(options)
        start = time.perf_counter()
        Permutation.permute_model(model)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        after = kept(model)
        permutation_rows.append(
            [name, str(width), f"{seconds:.2f}", f"{before:.1f}", f"{after:.1f}", f"{100 * (after / before - 1):+.2f}%"]
        )
    body += [
        "",
        *markdown_table(["search", "width", "permute_model s", "kept before", "kept after", "gain"], permutation_rows),
    ]
    report("bench_sparsity", body, out=args.out, cpu=device == "cpu", notes=[f"device: {device}; no PASS/FAIL bar"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
