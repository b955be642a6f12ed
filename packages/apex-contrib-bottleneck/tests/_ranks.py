"""Rank workers of the spatial tests (loaded by path in each process by apex.core.testing.run_ranks, so
absolute imports only): SpatialBottleneck with H split over the ranks against the unsplit Bottleneck on the
whole input, for each halo exchanger that runs on gloo; HaloPadder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist

from apex.contrib.bottleneck import (
    Bottleneck,
    HaloExchangerAllGather,
    HaloExchangerPeer,
    HaloExchangerSendRecv,
    HaloPadder,
    SpatialBottleneck,
)
from apex.contrib.peer_memory import PeerMemoryPool

_spec = importlib.util.spec_from_file_location("_bottleneck_reference", Path(__file__).with_name("_reference.py"))
_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_reference)

# (in, bottleneck, out, stride, N, rows per rank, W, layout, use_cudnn)
CONFIGS = [
    (8, 4, 8, 1, 2, 3, 5, "nchw", True),
    (6, 3, 10, 2, 1, 4, 5, "channels_last", False),
    (5, 4, 5, 1, 2, 1, 3, "nchw", False),  # one row per rank: its top and bottom rows are the same
    (6, 4, 8, 1, 2, 2, 4, "explicit_nhwc", True),
]


def _device():
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _exchangers(rank, world):
    ranks = list(range(world))
    yield "allgather", HaloExchangerAllGather(ranks, rank, dist.new_group(ranks))
    yield "sendrecv", HaloExchangerSendRecv(ranks, rank)
    pool = PeerMemoryPool(64 * 1024, 1024 * 1024, ranks)
    yield "peer", HaloExchangerPeer(ranks, rank, pool, explicit_nhwc=False)


def _compare(rank, world, name, exchanger, config, seed, dtype):
    cin, mid, cout, stride, n, rows, w, layout, use_cudnn = config
    explicit = layout == "explicit_nhwc"
    device = _device()
    full = _reference.randomize(Bottleneck(cin, mid, cout, stride, use_cudnn=use_cudnn, explicit_nhwc=explicit), seed)
    full = full.to(device=device, dtype=dtype)
    args = (world, rank, None, exchanger, 1 + rank % 3, False)
    split = SpatialBottleneck(
        cin, mid, cout, stride, use_cudnn=use_cudnn, explicit_nhwc=explicit, spatial_parallel_args=args
    ).to(device=device, dtype=dtype)
    split.load_state_dict(full.state_dict())
    g = torch.Generator().manual_seed(seed + 1)
    height = rows * world
    x = torch.randn(n, cin, height, w, generator=g).to(dtype).to(device)
    h_dim = 2
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    if explicit:
        x = x.permute(0, 2, 3, 1).contiguous()
        h_dim = 1
    out_rows = rows // stride
    x_full = x.detach().requires_grad_()
    y_full = full(x_full)
    dy = torch.randn(y_full.shape, generator=g).to(dtype).to(device)
    grads_full = torch.autograd.grad(y_full, [x_full, *full.w_conv], dy)

    x_mine = x.narrow(h_dim, rank * rows, rows).detach().requires_grad_()
    y_mine = split(x_mine)
    dy_mine = dy.narrow(h_dim, rank * out_rows, out_rows)
    grads_mine = list(torch.autograd.grad(y_mine, [x_mine, *split.w_conv], dy_mine))
    for gw in grads_mine[1:]:
        dist.all_reduce(gw)  # every rank's share of the weight gradients
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    what = f"{name} {config} {dtype}"

    def msg(text: str) -> str:  # what was compared, then assert_close's account of the difference
        return f"{what}: {text}"

    torch.testing.assert_close(y_mine, y_full.narrow(h_dim, rank * out_rows, out_rows), **tol, msg=msg)
    torch.testing.assert_close(grads_mine[0], grads_full[0].narrow(h_dim, rank * rows, rows), **tol, msg=msg)
    for got, want in zip(grads_mine[1:], grads_full[1:]):
        # A weight gradient is a sum over the batch and every position, all-reduced here from the ranks'
        # rounded partial sums: its error follows the size of the terms, not of the (possibly cancelling)
        # result. In bf16 the absolute tolerance scales with the gradient's largest element (two bf16
        # roundings of it; a CPU's bf16 convolution left 0.078 on 25.0, and 14% on a small element).
        weight_tol = tol if dtype == torch.float32 else dict(rtol=2e-2, atol=2**-7 * want.abs().max().item())
        torch.testing.assert_close(got, want, **weight_tol, msg=msg)
    return 1


def spatial(rank: int, world: int, seed: int):
    """Every exchanger x every config (fp32), and bf16 on one. Returns the number of comparisons."""
    # The split and the whole block convolve differently sized inputs, so cuDNN may choose different
    # algorithms: with TF32 (PyTorch's default for cuDNN convolutions) they would differ by ~1e-3, not
    # float32 rounding. The block follows torch's switch, as nn.Conv2d does.
    torch.backends.cudnn.allow_tf32 = False
    checked = 0
    for name, exchanger in _exchangers(rank, world):
        for i, config in enumerate(CONFIGS):
            checked += _compare(rank, world, name, exchanger, config, seed + i, torch.float32)
        checked += _compare(rank, world, name, exchanger, CONFIGS[0], seed, torch.bfloat16)
    return checked


def padder(rank: int, world: int, seed: int):
    """HaloPadder with the send/recv exchanger: H split (NCHW, channels_last in and out) and W split
    (explicit NHWC), half_halo 1 and 2, against the all-gathered whole tensor."""
    ranks = list(range(world))
    pad = HaloPadder(HaloExchangerSendRecv(ranks, rank))
    checked = 0
    for half_halo, explicit, h_split in ((1, False, True), (2, False, True), (2, True, False), (1, True, True)):
        dim = (1 if h_split else 2) if explicit else (2 if h_split else 3)
        g = torch.Generator().manual_seed(seed + rank)
        shape = [2, 3, 4, 5]
        y = torch.randn(shape, generator=g)
        if not explicit:
            y = y.contiguous(memory_format=torch.channels_last)
        parts = [torch.empty_like(y.contiguous()) for _ in ranks]
        dist.all_gather(parts, y.contiguous())
        zeros = torch.zeros_like(y.narrow(dim, 0, half_halo))
        whole = torch.cat([zeros, *parts, zeros], dim)
        ypad = pad(y, half_halo, explicit, h_split)
        pad.wait()
        size = shape[dim]
        torch.testing.assert_close(ypad, whole.narrow(dim, rank * size, size + 2 * half_halo), rtol=0, atol=0)
        checked += 1
    return checked
