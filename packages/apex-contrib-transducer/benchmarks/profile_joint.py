"""Runs the transducer joint's forward and backward a few times at the benchmark's shape, for a
profiler (CUDA only): ``ncu --kernel-name regex:joint_ --launch-skip 2 --launch-count 2 python
packages/apex-contrib-transducer/benchmarks/profile_joint.py`` reads one forward and one backward
after a warm-up step. ``--masked`` profiles the ReLU + dropout joint instead of the plain one."""

from __future__ import annotations

import sys

import torch

from apex.contrib.transducer import TransducerJoint

B, T, U, H = 32, 256, 64, 512


def main(argv: list[str]) -> int:
    masked = "--masked" in argv
    joint = TransducerJoint(relu=masked, dropout=masked, dropout_prob=0.1 if masked else 0.0)
    f = torch.randn(B, T, H, device="cuda", dtype=torch.float16, requires_grad=True)
    g = torch.randn(B, U, H, device="cuda", dtype=torch.float16, requires_grad=True)
    f_len = torch.full((B,), T, dtype=torch.int32, device="cuda")
    g_len = torch.full((B,), U, dtype=torch.int32, device="cuda")
    grad = torch.randn(B, T, U, H, device="cuda", dtype=torch.float16)
    for _ in range(3):
        torch.autograd.grad(joint(f, g, f_len, g_len), (f, g), grad)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
