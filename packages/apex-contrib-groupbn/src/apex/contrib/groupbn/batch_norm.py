"""BatchNorm2d_NHWC: batch norm of an ``(N, H, W, C)`` tensor, optionally fused with a residual add
and a ReLU, with statistics optionally shared by groups of ranks (upstream's ``groupbn``)."""

from __future__ import annotations

import bnp
import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from apex.parallel import group_sync
from apex.parallel.group_sync import consecutive_group

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_NAME = "BatchNorm2d_NHWC"


def _check(x: torch.Tensor, z: torch.Tensor | None, num_features: int, fuse_relu: bool) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{_NAME}: x must be a tensor, got {type(x).__name__}")
    if x.dim() != 4 or x.shape[-1] != num_features:
        raise ValueError(
            f"{_NAME}: x must have shape (N, H, W, C) with C = num_features = {num_features} in its last "
            f"dimension, got shape {tuple(x.shape)}"
        )
    if x.dtype not in _DTYPES:
        raise TypeError(f"{_NAME}: x has dtype {x.dtype}; expected float16, bfloat16, float32 or float64")
    if z is None:
        return
    if not fuse_relu:
        raise ValueError(f"{_NAME}: z (the residual) is only added with fuse_relu=True")
    if tuple(z.shape) != tuple(x.shape):
        raise ValueError(f"{_NAME}: z has shape {tuple(z.shape)} but x has {tuple(x.shape)}")
    if z.dtype != x.dtype:
        raise TypeError(f"{_NAME}: z has dtype {z.dtype} but x has {x.dtype}")
    if z.device != x.device:
        raise ValueError(f"{_NAME}: z is on {z.device} but x is on {x.device}")


def _multiprocessors() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 1


class BatchNorm2d_NHWC(_BatchNorm):
    r"""Batch norm over an NHWC tensor, ``y = relu(bn(x) + z)`` when fused, as upstream Apex's groupbn.

    ``forward(x, z=None)`` takes ``x`` of **shape** ``(N, H, W, C)`` (the channels in the last
    dimension, as upstream: not an ``(N, C, H, W)`` tensor in ``channels_last`` memory) and returns
    the same shape. In training each channel is normalized with the mean and biased variance over
    ``N*H*W`` of every rank of this rank's group,
    :math:`y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta`,
    and the running statistics are updated with the unbiased variance; in eval the running
    statistics normalize. With ``fuse_relu`` a ReLU follows, after adding ``z`` (the residual,
    shaped like ``x``) when given; ``z`` requires ``fuse_relu``.

    Args:
        num_features: ``C``.
        fuse_relu: apply the ReLU (and accept ``z``). Default: False.
        bn_group: training statistics cover groups of ``bn_group`` consecutive ranks (``[0, g)``,
            ``[g, 2g)``, ...); 1 is the local batch. The world size must be divisible by it (upstream
            further limits it to 1, 2, 4, 8 and one node; ours takes any divisor, across nodes).
            Like upstream, the constructor is then collective: every rank builds its modules in the
            same order.
        max_cta_per_sm, cta_launch_margin, multi_stream: upstream's launch tuning; accepted, validated
            (``max_cta_per_sm`` > 0) and kept as attributes, but they are occupancy hints that our
            kernels (apex-parallel's) do not need.

    Parameters and buffers are those of :class:`torch.nn.BatchNorm2d` (``weight`` ones, ``bias``
    zeros, ``running_mean``, ``running_var``, ``num_batches_tracked``), float32; ``eps`` 1e-5,
    ``momentum`` 0.1. After a training step, ``minibatch_mean`` and ``minibatch_riv`` hold the
    batch's (group's) mean and inverse standard deviation, as upstream.

    Differences from upstream, on purpose:

    - ``bn_group`` > 1 synchronizes through a ``torch.distributed`` process group (apex-parallel's
      ``create_syncbn_process_group``: one all-gather of the statistics forward, one all-reduce of
      two per-channel sums backward), not CUDA IPC peer buffers: any backend, and the CPU too.
    - Input dtypes: float16 as upstream, and also bfloat16, float32 and float64 (the output has the
      input's dtype; the statistics are float32, float64 for float64); any ``C``, any batch size.
      Parameters may be float32 or the input's dtype.
    - ``num_batches_tracked`` counts training steps and ``momentum=None`` gives a cumulative average
      as in torch (upstream never counts and needs a float momentum).
    - Eval mode is differentiable (upstream's eval output has no backward).
    - The ``bnp`` extension always imports (upstream's ``__init__`` prints when it is missing).
    """

    def __init__(
        self,
        num_features: int,
        fuse_relu: bool = False,
        bn_group: int = 1,
        max_cta_per_sm: int = 2,
        cta_launch_margin: int = 12,
        multi_stream: bool = False,
    ):
        super().__init__(num_features)
        if max_cta_per_sm <= 0:
            raise ValueError(f"{_NAME}: max_cta_per_sm must be positive, got {max_cta_per_sm}")
        self.fuse_relu = fuse_relu
        self.multi_stream = multi_stream
        self.bn_group = bn_group
        self.max_cta_per_sm = max_cta_per_sm
        self.cta_launch_margin = cta_launch_margin
        self.minibatch_mean = torch.zeros(num_features)
        self.minibatch_riv = torch.ones(num_features)
        self.process_group, self.group_world = consecutive_group(bn_group, _NAME)
        # Upstream's launch attributes, for code that reads them or passes them to bnp (which ignores them).
        self.fwd_occupancy = min(bnp.bn_fwd_nhwc_occupancy(), max_cta_per_sm)
        self.bwd_occupancy = min(bnp.bn_bwd_nhwc_occupancy(), max_cta_per_sm)
        self.addrelu_fwd_occupancy = min(bnp.bn_addrelu_fwd_nhwc_occupancy(), max_cta_per_sm)
        self.addrelu_bwd_occupancy = min(bnp.bn_addrelu_bwd_nhwc_occupancy(), max_cta_per_sm)
        sms = _multiprocessors()
        self.fwd_grid_dim_x = max(sms * self.fwd_occupancy - cta_launch_margin, 1)
        self.bwd_grid_dim_x = max(sms * self.bwd_occupancy - cta_launch_margin, 1)
        self.addrelu_fwd_grid_dim_x = max(sms * self.addrelu_fwd_occupancy - cta_launch_margin, 1)
        self.addrelu_bwd_grid_dim_x = max(sms * self.addrelu_bwd_occupancy - cta_launch_margin, 1)
        self.grid_dim_y = (num_features + 63) // 64
        self.my_data = self.pair_data = self.pair_data2 = self.pair_data3 = None
        self.local_rank = 0
        self.magic = torch.IntTensor([0])
        self.ret_cta = torch.zeros(8192, dtype=torch.uint8)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fuse_relu={self.fuse_relu}, bn_group={self.bn_group}"

    def _momentum(self) -> float:
        factor = self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        return factor

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        _check(x, z, self.num_features, self.fuse_relu)
        if not self.training:
            return self._eval(x, z)
        zc = None if z is None else z.contiguous()
        y, mean, invstd = group_sync.train(
            x.contiguous(),
            zc,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            self._momentum(),
            self.eps,
            self.fuse_relu,
            self.process_group,
            self.group_world,
        )
        self.minibatch_mean, self.minibatch_riv = mean, invstd
        return y

    def _eval(self, x, z):
        """The running statistics' affine map, through torch (differentiable)."""
        y = F.batch_norm(
            x.permute(0, 3, 1, 2), self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
        ).permute(0, 2, 3, 1)
        if z is not None:
            y = y + z
        return torch.relu(y) if self.fuse_relu else y
