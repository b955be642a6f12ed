"""SyncBatchNorm: batch norm whose training statistics cover the whole process group."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from apex.parallel import _ops

_counts: dict[tuple[int, torch.device], torch.Tensor] = {}


def _count_tensor(count: int, device: torch.device) -> torch.Tensor:
    """``[count]`` as a float32 tensor on ``device``, made once per value (the step is host-bound
    at ResNet sizes: a fill kernel per call is measurable)."""
    key = (count, device)
    found = _counts.get(key)
    if found is None:
        if len(_counts) > 64:
            _counts.clear()
        with torch.inference_mode(False):  # a normal tensor, which later calls may save for backward
            found = _counts[key] = torch.full((1,), float(count), dtype=torch.float32, device=device)
    return found


# Where a fused-ReLU backward with z's gradient gets the masked gradient: written by the reduction
# (reduce_bn_relu_c_last's masked=True), then read by the plain input-gradient kernel: one pass less
# than reading dy, x and z in both kernels and writing it from the second
# (batch_norm_backward_relu_c_last's z_grad=True). H200, 256x256x56x56 bf16: 699 against 835 us for
# the two kernels (2026-12-05, benchmarks/NOTES.md). Both give the same values up to the kernels'
# rounding; the tests set this False to compare them (SyncBatchNorm then takes SyncBatchNormFunction
# at world 1 too: batch_norm_train's formula, in Python and in C++, always masks in the reduction).
_MASKED_IN_REDUCE = True

# SyncBatchNorm's training at world 1 goes through one op with a C++ autograd on CUDA
# (batch_norm_train) instead of SyncBatchNormFunction: the same kernels in the same order (bit-identical
# on the CPU, the tests). H100, 2026-12-05 (benchmarks/host_time_syncbn.py, 2x64x4x4 bf16, host us
# per forward+backward): channels_last memory 490 against 637, with z 601 against 700, the
# channel_last flag with z 319 against 556; NCHW 677 against 589 (one sample on a noisy host: the
# kernels and calls are those of the channels-last rows). ResNet-50 eager end to end: a tie (46.01
# against 46.09 ms, GPU-bound at batch 256).

# One process off CUDA trains through torch's own batch norm (F.batch_norm, then z and the ReLU; see
# _torch_takes for the one exception): the
# ops' references there are Python, made to check the kernels, not to be fast. 16x64x56x56 channels-last
# with ReLU, forward + backward on 2 CPU cores: 51 ms through the references, 3.4-9.7 ms through
# torch's (bf16 / fp32). The tests set this False to run the ops' path on the CPU.
_TORCH_OFF_CUDA = True

# all_gather_single supersedes all_gather_into_tensor where it exists (a flat output suits both).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_DIST_AVAILABLE = dist.is_available()  # once: SyncBatchNorm.forward's world-1 path is host-bound


def sync_batch_norm_forward(
    input, z, weight, bias, running_mean, running_var, eps, momentum, group, world, c_last, relu
):
    """Training-mode batch norm whose statistics cover ``group`` (``world`` ranks; ``world`` 1: the
    local batch, no communication) on a contiguous input in one of the kernels' two layouts
    (``c_last``: channels in the last dimension; else in dimension 1), with ``z`` added and a ReLU
    after it when ``relu`` (channels-last only). Returns ``(out, mean, invstd, counts)``: the group's
    batch statistics and the per-rank element counts per channel, which
    :func:`sync_batch_norm_backward` takes. Local Welford statistics, one all-gather of
    ``[mean, var, count]``, a count-weighted merge (which also updates the running statistics,
    when given, in place), the normalization. Every rank of ``group`` must call it.
    """
    channels = input.shape[-1] if c_last else input.shape[1]
    welford = _ops.welford_mean_var_c_last if c_last else _ops.welford_mean_var
    mean, var = welford(input)
    local_count = input.numel() // channels if channels else 0
    count = _count_tensor(local_count, input.device)
    if world > 1:
        local = torch.cat([mean, var, count])
        gathered = local.new_empty((world * local.numel(),))
        _all_gather(gathered, local, group=group)
        gathered = gathered.view(world, local.numel())
        means, vars_, count = gathered[:, :channels], gathered[:, channels : 2 * channels], gathered[:, -1]
    else:
        means, vars_ = mean.unsqueeze(0), var.unsqueeze(0)
    mean, invstd = _ops.welford_parallel(means, vars_, count, eps, running_mean, running_var, momentum)
    if c_last:
        out = _ops.batch_norm_forward_c_last(input, z, mean, invstd, weight, bias, relu)
    else:
        out = _ops.batch_norm_forward(input, mean, invstd, weight, bias)
    return out, mean, invstd, count


def _all_reduce_sums(sum_dy, sum_dy_xmu, group, world):
    if world == 1:
        return sum_dy, sum_dy_xmu
    sums = torch.cat([sum_dy, sum_dy_xmu])
    dist.all_reduce(sums, group=group)
    return sums[: sum_dy.numel()], sums[sum_dy.numel() :]


def sync_batch_norm_backward(
    grad_output,
    input,
    z,
    weight,
    bias,
    mean,
    invstd,
    counts,
    group,
    world,
    c_last,
    relu,
    input_grad,
    z_grad,
    masked_in_reduce=None,
):
    """``(grad_input, grad_z, grad_weight, grad_bias)`` of :func:`sync_batch_norm_forward`'s output.

    ``grad_input`` is None unless ``input_grad``, ``grad_z`` (the ReLU-masked output gradient) unless
    ``z_grad``; ``grad_weight``/``grad_bias`` are this rank's (the caller drops what it does not
    need). With ``input_grad`` the two per-channel sums are all-reduced over ``group``: every rank of
    it must call this. A fused ReLU's derivative is taken inside the reduction and the input
    gradient's kernel (two passes over the tensors, not three); z's gradient comes from the first
    (``masked_in_reduce``, by default ``_MASKED_IN_REDUCE``), which the second then reads instead of
    dy, x and z.
    """
    grad_output = grad_output.contiguous()
    if relu and input_grad:
        masked_first = z_grad and (_MASKED_IN_REDUCE if masked_in_reduce is None else masked_in_reduce)
        sum_dy, sum_dy_xmu, grad_weight, grad_bias, masked = _ops.reduce_bn_relu_c_last(
            grad_output, input, z, mean, invstd, weight, bias, masked_first
        )
        sum_dy, sum_dy_xmu = _all_reduce_sums(sum_dy, sum_dy_xmu, group, world)
        if masked_first:
            grad_z = masked
            grad_input = _ops.batch_norm_backward_c_last(
                masked, input, mean, invstd, weight, sum_dy, sum_dy_xmu, counts
            )
        else:
            grad_input, grad_z = _ops.batch_norm_backward_relu_c_last(
                grad_output, input, z, mean, invstd, weight, bias, sum_dy, sum_dy_xmu, counts, z_grad
            )
        return grad_input, grad_z if z_grad else None, grad_weight, grad_bias
    if relu:
        grad_output = _ops.relu_backward_c_last(grad_output, input, z, mean, invstd, weight, bias)
    grad_z = grad_output if z_grad else None
    reduce = _ops.reduce_bn_c_last if c_last else _ops.reduce_bn
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = reduce(grad_output, input, mean, invstd, weight)
    grad_input = None
    if input_grad:
        sum_dy, sum_dy_xmu = _all_reduce_sums(sum_dy, sum_dy_xmu, group, world)
        backward = _ops.batch_norm_backward_c_last if c_last else _ops.batch_norm_backward
        grad_input = backward(grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu, counts)
    return grad_input, grad_z, grad_weight, grad_bias


def _backward_of_saved(ctx, grad_output, group, world, masked_in_reduce):
    """:func:`sync_batch_norm_backward` on what a forward saved (input, z, weight, bias, mean, invstd,
    count; ``ctx.c_last``, ``ctx.relu``), for the inputs that need a gradient: (input, z, weight,
    bias) gradients, None where not needed."""
    input, z, weight, bias, mean, invstd, count = ctx.saved_tensors
    needs = ctx.needs_input_grad
    grad_input, grad_z, grad_weight, grad_bias = sync_batch_norm_backward(
        grad_output,
        input,
        z,
        weight,
        bias,
        mean,
        invstd,
        count,
        group,
        world,
        ctx.c_last,
        ctx.relu,
        input_grad=needs[0],
        z_grad=z is not None and needs[1],
        masked_in_reduce=masked_in_reduce,
    )
    if weight is None:
        return grad_input, grad_z, None, None
    return grad_input, grad_z, grad_weight if needs[2] else None, grad_bias if bias is not None and needs[3] else None


class SyncBatchNormFunction(torch.autograd.Function):
    """Autograd of :func:`sync_batch_norm_forward` (``apply(input, z, weight, bias, running_mean,
    running_var, eps, momentum, group, world, c_last, relu) -> out``)."""

    @staticmethod
    def forward(ctx, input, z, weight, bias, running_mean, running_var, eps, momentum, group, world, c_last, relu):
        out, mean, invstd, count = sync_batch_norm_forward(
            input, z, weight, bias, running_mean, running_var, eps, momentum, group, world, c_last, relu
        )
        ctx.save_for_backward(input, z, weight, bias, mean, invstd, count)
        ctx.group, ctx.world, ctx.c_last, ctx.relu = group, world, c_last, relu
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return *_backward_of_saved(ctx, grad_output, ctx.group, ctx.world, None), *(None,) * 8


# batch_norm_train's autograd: the backward above at world 1, on every device and under torch.compile.
# The compiled library registers the same formula in C++ for AutogradCUDA (csrc/syncbn_autograd.cpp),
# which the dispatcher prefers for CUDA tensors once loaded; both save the same tensors and call the
# same ops with the masked gradient from the reduction (masked_in_reduce=True).


def _train_setup_context(ctx, inputs, output):
    input, z, weight, bias, mean, invstd, count, c_last, relu = inputs
    ctx.save_for_backward(input, z, weight, bias, mean, invstd, count)
    ctx.c_last, ctx.relu = c_last, relu


def _train_backward(ctx, grad_output):
    """One gradient per batch_norm_train input: input, z, weight, bias, then None for the rest."""
    return *_backward_of_saved(ctx, grad_output, None, 1, True), *(None,) * 5


torch.library.register_autograd(_ops.batch_norm_train, _train_backward, setup_context=_train_setup_context)


def batch_norm_train_local(
    input, z, weight, bias, running_mean, running_var, eps, momentum, c_last, relu, with_stats=False
):
    """:func:`sync_batch_norm_forward`'s output at world 1 (the same ops in the same order), as
    :class:`SyncBatchNormFunction` at world 1 differentiates it, through one differentiable op:
    the statistics (and the running statistics' update) outside autograd, then
    ``batch_norm_train``. The arguments are :func:`sync_batch_norm_forward`'s; ``with_stats``
    returns ``(y, mean, invstd)``, the batch statistics (not differentiable) too."""
    data = input.detach()  # the statistics are constants to autograd: the op's backward covers them
    mean, var = (_ops.welford_mean_var_c_last if c_last else _ops.welford_mean_var)(data)
    channels = input.shape[-1] if c_last else input.shape[1]
    count = _count_tensor(input.numel() // channels if channels else 0, input.device)
    mean, invstd = _ops.welford_parallel(
        mean.unsqueeze(0), var.unsqueeze(0), count, eps, running_mean, running_var, momentum
    )
    y = _ops.batch_norm_train(input, z, weight, bias, mean, invstd, count, c_last, relu)
    return (y, mean, invstd) if with_stats else y


class SyncBatchNorm(_BatchNorm):
    r"""Batch normalization with statistics over every rank of a process group, as upstream Apex.

    In training, each channel is normalized with the mean and (biased) variance of all elements
    of that channel on all ranks of ``process_group``:
    :math:`y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta`.
    Each rank computes Welford statistics in float32 (float64 for a float64 input), one all-gather shares them, and a
    count-weighted merge combines them, so ranks may hold different batch sizes. The backward
    pass all-reduces the two per-channel gradient sums once. Running statistics, eval mode and
    the state dict are those of :class:`torch.nn.BatchNorm2d`; without an initialized process
    group (or with one rank) training uses the local batch (off CUDA through torch's own batch norm).

    Args:
        num_features: the number of channels ``C``.
        eps: added to the variance. Default: 1e-5.
        momentum: the running statistics' update factor, or ``None`` for a cumulative moving
            average. Default: 0.1.
        affine: learnable ``weight`` and ``bias``. Default: True.
        track_running_stats: keep ``running_mean``/``running_var``. Default: True.
        process_group: the group to synchronize over; ``None`` is the default group.
        channel_last: the input's last dimension holds the channels (``(N, ..., C)``) instead of
            dimension 1. Inputs in ``torch.channels_last`` memory format need no flag: they
            take the channels-last kernels on their own.
        fuse_relu: apply a ReLU to the output, ``y = relu(bn(x) + z)``.

    ``forward(input, z=None)``: ``z``, shaped like the input, is added before the ReLU.
    Input: ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)`` (channels last with
    ``channel_last``), float32, float16, bfloat16 or float64; weight and buffers float32 or the
    input's dtype.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group=None,
        channel_last: bool = False,
        fuse_relu: bool = False,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected at least 2-D input, got {input.dim()}-D")

    def _specify_process_group(self, process_group) -> None:
        self.process_group = process_group

    def extra_repr(self) -> str:
        return super().extra_repr() + f", channel_last={self.channel_last}, fuse_relu={self.fuse_relu}"

    def _momentum(self) -> float:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        return factor

    def _local(self, input, z, factor, bn_training):
        """torch's batch norm over this rank's batch (eval, no running statistics in eval, or one
        process off CUDA)."""
        track = not self.training or self.track_running_stats
        running = (self.running_mean, self.running_var) if track else (None, None)
        return _torch_batch_norm(
            input, z, self.weight, self.bias, running, bn_training, factor, self.eps, self.channel_last, self.fuse_relu
        )

    def forward(self, input: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        self._check_input_dim(input)
        if self.channel_last:
            if input.shape[-1] != self.num_features:
                raise ValueError(
                    f"SyncBatchNorm: input has {input.shape[-1]} channels in its last dimension, "
                    f"expected {self.num_features}"
                )
        elif input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm: input has {input.shape[1]} channels, expected {self.num_features}")
        if z is not None and tuple(z.shape) != tuple(input.shape):
            raise ValueError(f"SyncBatchNorm: z has shape {tuple(z.shape)} but input has {tuple(input.shape)}")
        factor = self._momentum()
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        if not (self.training and bn_training):
            return self._local(input, z, factor, bn_training)

        group, world = None, 1
        if _DIST_AVAILABLE and dist.is_initialized():
            group = self.process_group if self.process_group is not None else dist.group.WORLD
            world = dist.get_world_size(group)
        if world == 1 and _torch_takes(input, z):
            return self._local(input, z, factor, True)
        running = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
        weight, bias = self.weight, self.bias
        if self.channel_last or input.dim() == 2:
            zc = None if z is None else z.contiguous()
            return self._sync(input.contiguous(), zc, weight, bias, running, factor, group, world, True, self.fuse_relu)
        if input.dim() in (4, 5) and input.is_contiguous(memory_format=_memory_format(input)):
            # channels_last memory: the channels-last kernels on the (N, H*W, C) view, no copy. A 3-D
            # view, not a 4-D (N, H, W, C) permutation: Inductor's layout optimization gives 4-D
            # tensors near a convolution channels-last strides, which would copy a permuted view.
            zl = None if z is None else _rows_last(z.contiguous(memory_format=_memory_format(z)))
            out = self._sync(_rows_last(input), zl, weight, bias, running, factor, group, world, True, self.fuse_relu)
            return out.transpose(1, 2).unflatten(2, input.shape[2:])
        out = self._sync(input.contiguous(), None, weight, bias, running, factor, group, world, False, False)
        if z is not None:
            out = out + z
        return torch.relu(out) if self.fuse_relu else out

    def _sync(self, input, z, weight, bias, running, factor, group, world, c_last, relu):
        if world == 1 and _MASKED_IN_REDUCE:
            return batch_norm_train_local(input, z, weight, bias, *running, self.eps, factor, c_last, relu)
        return SyncBatchNormFunction.apply(
            input, z, weight, bias, running[0], running[1], self.eps, factor, group, world, c_last, relu
        )


def _torch_takes(input: torch.Tensor, z: torch.Tensor | None) -> bool:
    """Whether one process's training step goes to torch's batch norm (``_TORCH_OFF_CUDA``): off CUDA,
    unless a 16-bit input has a residual z. There torch's output would be rounded before z is added,
    and the sum rounded again, which can flip the ReLU's mask against the kernels' single rounding."""
    if input.is_cuda or not _TORCH_OFF_CUDA:
        return False
    return z is None or input.dtype not in (torch.float16, torch.bfloat16)


def _torch_batch_norm(input, z, weight, bias, running, training, momentum, eps, c_last, relu):
    """``F.batch_norm`` of the channels at dimension 1 (the last one when ``c_last``), then ``+ z`` and
    the ReLU when ``relu``: torch's own kernels, for eval and for one process off CUDA."""
    x = input.movedim(-1, 1) if c_last and input.dim() > 2 else input
    out = F.batch_norm(x, running[0], running[1], weight, bias, training, momentum, eps)
    if x is not input:
        out = out.movedim(1, -1)
    if z is not None:
        out = out + z
    return torch.relu(out) if relu else out


def _rows_last(t: torch.Tensor) -> torch.Tensor:
    """The ``(N, *spatial, C)`` memory of a channels_last tensor as an ``(N, prod(spatial), C)`` view."""
    return t.flatten(2).transpose(1, 2)


def _memory_format(input: torch.Tensor):
    return torch.channels_last if input.dim() == 4 else torch.channels_last_3d


def convert_syncbn_model(module: torch.nn.Module, process_group=None, channel_last: bool = False) -> torch.nn.Module:
    """Replaces every batch norm layer of ``module`` (recursively) by an apex :class:`SyncBatchNorm`.

    Weights, buffers, ``requires_grad``, device and dtype carry over; layers that already are
    apex SyncBatchNorm stay. Returns the converted module (a new object when ``module`` itself
    is a batch norm layer).
    """
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            channel_last=channel_last,
        )
        with torch.no_grad():
            if module.affine:
                converted.weight = module.weight
                converted.bias = module.bias
            if module.track_running_stats:
                converted.running_mean = module.running_mean
                converted.running_var = module.running_var
                converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return converted


def create_syncbn_process_group(group_size: int):
    """Splits the world into consecutive groups of ``group_size`` ranks; returns this rank's group.

    Every rank must call it (``new_group`` is collective over the world). ``group_size`` 0 (or
    None) means the whole world and returns ``None``.
    """
    if not group_size:
        return None
    world_size = dist.get_world_size()
    if group_size > world_size or world_size % group_size != 0:
        raise ValueError(f"create_syncbn_process_group: world size {world_size} is not divisible by {group_size}")
    rank = dist.get_rank()
    mine = None
    for start in range(0, world_size, group_size):
        group = dist.new_group(list(range(start, start + group_size)))
        if start <= rank < start + group_size:
            mine = group
    return mine
