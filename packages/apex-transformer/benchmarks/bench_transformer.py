"""apex-transformer's benchmarks in one run: the fused softmax family (bench_softmax.py), the fused
rotary embeddings (bench_rope.py) and SwiGLU (bench_swiglu.py), each against eager and compiled
PyTorch (CUDA only).

    python packages/apex-transformer/benchmarks/bench_transformer.py [--out DIR] [--samples N]

Each part prints its table, the copy bandwidth measured in its run, and PASS/FAIL per bar; the
exit status is non-zero if any part fails to run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import bench_rope
import bench_softmax
import bench_swiglu


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return max(bench_softmax.main(argv), bench_rope.main(argv), bench_swiglu.main(argv))


if __name__ == "__main__":
    sys.exit(main())
