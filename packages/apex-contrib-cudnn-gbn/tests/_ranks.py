"""Rank workers of the distributed tests (loaded by path in each process by apex.core.testing.run_ranks,
so absolute imports only): GroupBatchNorm2d and cudnn_gbn_lib over gloo process groups."""

from __future__ import annotations

import torch

EPS, MOMENTUM = 1e-5, 0.1


def full_data(batches, chw, seed):
    """The whole world's NCHW batch (N = sum of ``batches``), float32: x, x2, dy, weight, bias."""
    g = torch.Generator().manual_seed(seed)
    shape = (sum(batches), *chw)
    x = torch.randn(shape, generator=g) * 1.5 + 0.4
    x2 = torch.randn(shape, generator=g) - 0.3
    dy = torch.randn(shape, generator=g)
    weight = torch.rand(chw[0], generator=g) + 0.5
    bias = torch.randn(chw[0], generator=g)
    return x, x2, dy, weight, bias


def _device():
    """This rank's device: its GPU under NCCL (run_ranks made it current), else the CPU."""
    return "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"


def _cpu(result):
    return {k: v.detach().cpu() for k, v in result.items()}


def rows(batches, rank):
    start = sum(batches[:rank])
    return slice(start, start + batches[rank])


def mine(batches, chw, seed, rank):
    x, x2, dy, weight, bias = full_data(batches, chw, seed)
    device = _device()
    cl = [t[rows(batches, rank)].to(device).contiguous(memory_format=torch.channels_last) for t in (x, x2, dy)]
    return (*cl, weight.to(device), bias.to(device))


def module_step(rank, group_size, batches, chw, seed):
    from apex.contrib.cudnn_gbn import GroupBatchNorm2d

    x, x2, dy, weight, bias = mine(batches, chw, seed, rank)
    m = GroupBatchNorm2d(chw[0], group_size).to(x.device)
    assert (m.group_id, m.group_rank) == divmod(rank, group_size)
    with torch.no_grad():
        m.weight.copy_(weight)
        m.bias.copy_(bias)
    x = x.requires_grad_()
    y = m(x)
    y.backward(dy)
    mean, inv_var = m.minibatch_mean.clone(), m.minibatch_inv_var.clone()
    m(x2)
    return _cpu(
        {
            "y": y.detach(),
            "dx": x.grad,
            "dweight": m.weight.grad,
            "dbias": m.bias.grad,
            "mean": mean,
            "invstd": inv_var,
            "running_mean": m.running_mean.clone(),
            "running_var": m.running_var.clone(),
        }
    )


def legacy_step(rank, group_size, batches, chw, seed):
    import cudnn_gbn_lib

    x, _, dy, weight, bias = mine(batches, chw, seed, rank)
    c = chw[0]
    f = {"device": x.device}
    rm, rv, mean, inv_var = torch.zeros(c, **f), torch.ones(c, **f), torch.empty(c, **f), torch.empty(c, **f)
    y = cudnn_gbn_lib.forward(x, weight, bias, rm, rv, mean, inv_var, MOMENTUM, EPS, group_size, rank % group_size, [])
    dx, dweight, dbias = cudnn_gbn_lib.backward(x, dy, weight, mean, inv_var, EPS, group_size, rank % group_size, [])
    return _cpu({"y": y, "dx": dx, "dweight": dweight, "dbias": dbias, "mean": mean, "invstd": inv_var})


def worker(rank, world, group_sizes, batches, chw, seed, legacy):
    out = {}
    for group_size in group_sizes:
        out[group_size] = {"module": module_step(rank, group_size, batches, chw, seed)}
        if legacy:
            out[group_size]["legacy"] = legacy_step(rank, group_size, batches, chw, seed)
    return out
