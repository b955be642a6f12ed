"""Rank workers of the distributed tests (loaded by path in each process by apex.core.testing.run_ranks,
so absolute imports only): BatchNorm2d_NHWC and bnp with bn_group over gloo process groups."""

from __future__ import annotations

import torch

EPS, MOMENTUM = 1e-5, 0.1


def full_data(batches, hwc, seed):
    """The whole world's batch (N = sum of ``batches``, then H, W, C), float32: x, x2, z, dy, weight, bias."""
    g = torch.Generator().manual_seed(seed)
    shape = (sum(batches), *hwc)
    x = torch.randn(shape, generator=g) * 1.5 + 0.4
    x2 = torch.randn(shape, generator=g) - 0.3
    z = torch.randn(shape, generator=g)
    dy = torch.randn(shape, generator=g)
    weight = torch.rand(hwc[-1], generator=g) + 0.5
    bias = torch.randn(hwc[-1], generator=g)
    return x, x2, z, dy, weight, bias


def _device():
    """This rank's device: its GPU under NCCL (run_ranks made it current), else the CPU."""
    return "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"


def _cpu(result):
    return {k: None if v is None else v.detach().cpu() for k, v in result.items()}


def rows(batches, rank):
    start = sum(batches[:rank])
    return slice(start, start + batches[rank])


def module_step(rank, group_size, batches, hwc, seed, relu):
    """One training step (forward, backward), a second forward, then eval, of BatchNorm2d_NHWC."""
    from apex.contrib.groupbn import BatchNorm2d_NHWC

    device = _device()
    data = full_data(batches, hwc, seed)
    x, x2, z, dy, weight, bias = ((t[rows(batches, rank)] if t.dim() == 4 else t).to(device) for t in data)
    m = BatchNorm2d_NHWC(hwc[-1], fuse_relu=relu, bn_group=group_size).to(device)
    with torch.no_grad():
        m.weight.copy_(weight)
        m.bias.copy_(bias)
    x = x.clone().requires_grad_()
    zz = z.clone().requires_grad_() if relu else None
    y = m(x, zz)
    y.backward(dy)
    mean, riv = m.minibatch_mean.clone(), m.minibatch_riv.clone()
    m(x2, None if zz is None else z)
    m.eval()
    with torch.no_grad():
        eval_y = m(x2, None if zz is None else z)
    return _cpu(
        {
            "y": y.detach(),
            "dx": x.grad,
            "dz": None if zz is None else zz.grad,
            "dweight": m.weight.grad,
            "dbias": m.bias.grad,
            "mean": mean,
            "invstd": riv,
            "running_mean": m.running_mean.clone(),
            "running_var": m.running_var.clone(),
            "eval_y": eval_y,
        }
    )


def legacy_step(rank, group_size, batches, hwc, seed, relu):
    """The same first step through bnp's functions (upstream's argument orders)."""
    import bnp

    device = _device()
    data = full_data(batches, hwc, seed)
    x, _, z, dy, weight, bias = ((t[rows(batches, rank)] if t.dim() == 4 else t).to(device) for t in data)
    c = hwc[-1]
    rm, rv = torch.zeros(c, device=device), torch.ones(c, device=device)
    mini_m, mini_riv = torch.empty(c, device=device), torch.empty(c, device=device)
    ret_cta, magic = torch.zeros(8192, dtype=torch.uint8), torch.IntTensor([0])
    if relu:
        bitmask = torch.empty(((x.numel() + 31) // 32) * 2, dtype=torch.int32, device=device)
        args = (rm, rv, mini_m, mini_riv, bitmask, ret_cta, MOMENTUM, EPS, None, None, None, None, group_size, magic)
        y = bnp.bn_addrelu_fwd_nhwc(x, z, weight, bias, *args, 2, 100, False)
        dx, dz, dweight, dbias = bnp.bn_addrelu_bwd_nhwc(x, dy, weight, bias, *args, 2, 100, False)
    else:
        args = (rm, rv, mini_m, mini_riv, ret_cta, MOMENTUM, EPS, False, None, None, None, None, group_size, magic)
        y = bnp.bn_fwd_nhwc(x, weight, bias, *args, 2, 100, False)
        (dx, dweight, dbias), dz = bnp.bn_bwd_nhwc(x, dy, weight, bias, *args, 2, 100, False), None
    return _cpu({"y": y, "dx": dx, "dz": dz, "dweight": dweight, "dbias": dbias, "running_mean": rm, "running_var": rv})


def worker(rank, world, group_sizes, batches, hwc, seed, relu, legacy):
    out = {}
    for group_size in group_sizes:
        out[group_size] = {"module": module_step(rank, group_size, batches, hwc, seed, relu)}
        if legacy:
            out[group_size]["legacy"] = legacy_step(rank, group_size, batches, hwc, seed, relu)
    return out


def bad_group_size(rank, world):
    from apex.contrib.groupbn import BatchNorm2d_NHWC

    try:
        BatchNorm2d_NHWC(8, bn_group=3)
    except ValueError as error:
        return str(error)
    return None
