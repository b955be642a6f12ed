"""Batch norm over a channels-last batch whose statistics cover a group of consecutive ranks.

The machinery under apex-contrib-groupbn's ``BatchNorm2d_NHWC`` and legacy ``bnp`` module and
apex-contrib-cudnn-gbn's ``GroupBatchNorm2d``: SyncBatchNorm's functional forward and backward
(:func:`apex.parallel.sync_batchnorm.sync_batch_norm_forward` / ``_backward``), channels-last, with
torch's rules for one value or none per channel on a single rank, and the batch's mean and inverse
standard deviation handed back to the caller (upstream's modules keep them as ``minibatch_mean`` /
``minibatch_riv``, and its legacy kernels take them between forward and backward).

Training forward on an input ``x`` whose last dimension is the channels: per-rank Welford
statistics, one all-gather of ``[mean, var, count]`` over the group, a count-weighted merge (which
also updates the running statistics with the unbiased variance), then
``y = [relu](bn(x) [+ z])``. Backward: the two per-channel gradient sums, one all-reduce of them over
the group, then the input gradient (and ``z``'s, the ReLU-masked output gradient). Weight and bias
gradients stay per rank, as with ``torch.nn.SyncBatchNorm`` (data parallelism averages them).

Groups are made with ``torch.distributed`` (apex-parallel's ``create_syncbn_process_group``), not
CUDA IPC buffers as upstream: any backend, any ranks-per-node layout, and the CPU (gloo) too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from apex.parallel import sync_batchnorm
from apex.parallel.sync_batchnorm import create_syncbn_process_group, sync_batch_norm_backward, sync_batch_norm_forward

__all__ = ["GroupBatchNormFunction", "backward_train", "consecutive_group", "forward_train", "local_counts", "train"]

_groups: dict[tuple[int, int], object] = {}


def consecutive_group(group_size: int, caller: str = "group_sync") -> tuple[object | None, int]:
    """``(process group, its size)`` of this rank's group of ``group_size`` consecutive ranks.

    ``group_size`` 1 (or a world of one) is ``(None, 1)``: the local batch, no communication. The
    first request for a size creates the groups of that size: every rank of the world must make it
    (``torch.distributed.new_group`` is collective), which the modules do in their constructors.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{caller}: the group size must be a positive int, got {group_size!r}")
    if group_size == 1:
        return None, 1
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{caller}: a group size of {group_size} synchronizes statistics through torch.distributed; "
            "call torch.distributed.init_process_group first"
        )
    world = dist.get_world_size()
    if world % group_size != 0:
        raise ValueError(f"{caller}: the world size {world} is not divisible by the group size {group_size}")
    key = (group_size, world)
    if key not in _groups:
        _groups[key] = create_syncbn_process_group(group_size)
    return _groups[key], group_size


def local_counts(x: torch.Tensor, world: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-rank element counts per channel when every rank of the group holds a batch like ``x``
    (channels last): what the legacy backward functions assume, as upstream's kernels do."""
    channels = x.shape[-1]
    return torch.full((world,), float(x.numel() // channels if channels else 0), dtype=dtype, device=x.device)


def forward_train(x, z, weight, bias, running_mean, running_var, momentum, eps, fuse_relu, group, world):
    """``(y, mean, invstd, counts)`` of a training step on the contiguous channels-last ``x``.

    ``mean``/``invstd`` are the group's batch statistics (float32; float64 for a float64 ``x``),
    ``counts`` the per-rank element counts that :func:`backward_train` takes. The running
    statistics, when given, are updated in place: ``(1 - momentum) * running + momentum * stat``,
    with the unbiased variance (not by an empty batch on a single rank, as torch). One value per
    channel on a single rank raises ValueError, as torch.
    """
    channels = x.shape[-1]
    local = x.numel() // channels if channels else 0
    if world == 1 and local == 1:
        # The unbiased variance of one value is 0/0: torch refuses it, and so do we (a group pools more).
        raise ValueError(f"expected more than 1 value per channel when training, got input of shape {tuple(x.shape)}")
    if world == 1 and local == 0:
        running_mean = running_var = None  # an empty batch leaves them, as torch
    return sync_batch_norm_forward(
        x, z, weight, bias, running_mean, running_var, float(eps), float(momentum), group, world, True, bool(fuse_relu)
    )


def backward_train(dy, x, z, weight, bias, mean, invstd, counts, fuse_relu, group, world, grad_z=False):
    """``(grad_x, grad_z, grad_weight, grad_bias)`` of :func:`forward_train`'s output.

    With ``fuse_relu`` the ReLU mask is recomputed from ``x``, ``z`` and the statistics.
    ``grad_z`` (the masked output gradient) is None unless asked for. The sums are all-reduced over
    ``group``: every rank of it must call this.
    """
    return sync_batch_norm_backward(
        dy, x, z, weight, bias, mean, invstd, counts, group, world, True, fuse_relu, True, grad_z
    )


class GroupBatchNormFunction(torch.autograd.Function):
    """Autograd of :func:`forward_train`: ``apply(x, z, weight, bias, running_mean, running_var,
    momentum, eps, fuse_relu, group, world) -> (y, mean, invstd)``; ``mean`` and ``invstd`` are not
    differentiable (the modules store them as upstream's ``minibatch_*`` attributes)."""

    @staticmethod
    def forward(ctx, x, z, weight, bias, running_mean, running_var, momentum, eps, fuse_relu, group, world):
        y, mean, invstd, counts = forward_train(
            x, z, weight, bias, running_mean, running_var, momentum, eps, fuse_relu, group, world
        )
        ctx.save_for_backward(x, z, weight, bias, mean, invstd, counts)
        ctx.fuse_relu, ctx.group, ctx.world = fuse_relu, group, world
        ctx.mark_non_differentiable(mean, invstd)
        return y, mean, invstd

    @staticmethod
    def backward(ctx, dy, _mean_grad, _invstd_grad):
        x, z, weight, bias, mean, invstd, counts = ctx.saved_tensors
        want_z = z is not None and ctx.needs_input_grad[1]
        grad_x, grad_z, grad_weight, grad_bias = backward_train(
            dy, x, z, weight, bias, mean, invstd, counts, ctx.fuse_relu, ctx.group, ctx.world, want_z
        )
        grad_weight = grad_weight if weight is not None and ctx.needs_input_grad[2] else None
        grad_bias = grad_bias if bias is not None and ctx.needs_input_grad[3] else None
        return grad_x, grad_z, grad_weight, grad_bias, *(None,) * 7


def train(x, z, weight, bias, running_mean, running_var, momentum, eps, fuse_relu, group, world):
    """``(y, mean, invstd)`` of a training step on the contiguous channels-last ``x``, differentiable in
    ``x``, ``z``, ``weight`` and ``bias`` (``mean``/``invstd`` as :func:`forward_train`'s, not
    differentiable): :class:`GroupBatchNormFunction`; at one process SyncBatchNorm's one-op path
    (``sync_batchnorm.batch_norm_train_local``); or for the local batch off CUDA torch's own batch
    norm (``torch.native_batch_norm``; the ops' references there are Python, 19x slower at
    16x56x56x64), where SyncBatchNorm takes it (``sync_batchnorm._torch_takes``)."""
    channels = x.shape[-1]
    local = x.numel() // channels if channels else 0
    if world == 1 and local > 1 and sync_batchnorm._torch_takes(x, z):
        y, mean, invstd = torch.native_batch_norm(
            x.movedim(-1, 1), weight, bias, running_mean, running_var, True, float(momentum), float(eps)
        )
        y = y.movedim(1, -1)
        if z is not None:
            y = y + z
        if fuse_relu:
            y = torch.relu(y)
        stat = torch.float64 if x.dtype == torch.float64 else torch.float32
        return y, mean.detach().to(stat), invstd.detach().to(stat)
    if world == 1 and local > 1 and sync_batchnorm._MASKED_IN_REDUCE:
        # One process: SyncBatchNorm's one-op path (batch_norm_train, a C++ autograd on CUDA), the same
        # kernels in the same order as GroupBatchNormFunction at world 1 with less host time a step.
        return sync_batchnorm.batch_norm_train_local(
            x, z, weight, bias, running_mean, running_var, float(eps), float(momentum), True, bool(fuse_relu), True
        )
    return GroupBatchNormFunction.apply(
        x, z, weight, bias, running_mean, running_var, momentum, eps, fuse_relu, group, world
    )
