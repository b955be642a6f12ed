"""Upstream Apex's ``cudnn_gbn_lib`` extension module (contrib cudnn_gbn), on apex-parallel's
SyncBatchNorm ops through apex-parallel's ``group_sync``.

Upstream's names and argument orders; ``x``, ``dy`` and the outputs are ``(N, C, H, W)`` tensors
(channels_last memory; others are made so); ``scale``/``bias`` and the statistics are per-channel:

- ``forward(x, scale, bias, running_mean, running_var, minibatch_mean, minibatch_inv_var, momentum,
  epsilon, bn_group, rank_id, peer_buffers) -> y``: the training forward; writes the batch's mean
  and inverse std into ``minibatch_mean``/``minibatch_inv_var`` and updates the running statistics
  in place (unbiased variance);
- ``backward(x, dy, scale, minibatch_mean, minibatch_inv_var, epsilon, bn_group, rank_id,
  peer_buffers) -> [dx, dscale, dbias]``.

``bn_group`` > 1 synchronizes over this rank's group of ``bn_group`` consecutive ranks through
``torch.distributed`` (made on first use, collectively), so ``peer_buffers`` (upstream's CUDA-IPC
addresses) is ignored and ``rank_id`` must be this rank's place in its group. ``backward`` assumes
every rank of the group holds a batch of ``x``'s size, as upstream's kernels do. Inputs may be
float16 (upstream's only dtype), bfloat16 or float32, any ``C``; runs on the CPU too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from apex.core import __version__
from apex.parallel.group_sync import backward_train, consecutive_group, forward_train, local_counts

__all__ = ["__version__", "backward", "forward"]


def _nhwc(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dim() != 4:
        raise ValueError(f"cudnn_gbn_lib.{op}: {name} must be a 4-D (N, C, H, W) tensor, got shape {tuple(t.shape)}")
    return t.permute(0, 2, 3, 1).contiguous()


def _group(op: str, bn_group, rank_id):
    group, world = consecutive_group(int(bn_group), f"cudnn_gbn_lib.{op}")
    if world > 1 and int(rank_id) != dist.get_rank() % world:
        raise ValueError(
            f"cudnn_gbn_lib.{op}: rank_id {rank_id} is not this rank's place in its group of {world} "
            f"({dist.get_rank() % world})"
        )
    return group, world


def forward(x, scale, bias, running_mean, running_var, minibatch_mean, minibatch_inv_var, momentum, epsilon,
            bn_group, rank_id, peer_buffers):  # fmt: skip
    op = "forward"
    group, world = _group(op, bn_group, rank_id)
    y, mean, invstd, _ = forward_train(
        _nhwc(op, "x", x), None, scale, bias, running_mean, running_var, momentum, epsilon, False, group, world
    )
    minibatch_mean.copy_(mean)
    minibatch_inv_var.copy_(invstd)
    return y.permute(0, 3, 1, 2)


def backward(x, dy, scale, minibatch_mean, minibatch_inv_var, epsilon, bn_group, rank_id, peer_buffers):
    op = "backward"
    group, world = _group(op, bn_group, rank_id)
    xl, dyl = _nhwc(op, "x", x), _nhwc(op, "dy", dy)
    mean, invstd = minibatch_mean.float().contiguous(), minibatch_inv_var.float().contiguous()
    counts = local_counts(xl, world)
    dx, _, dscale, dbias = backward_train(dyl, xl, None, scale, None, mean, invstd, counts, False, group, world)
    return [dx.permute(0, 3, 1, 2), dscale, dbias]
