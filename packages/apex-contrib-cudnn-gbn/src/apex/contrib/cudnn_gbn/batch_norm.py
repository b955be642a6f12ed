"""GroupBatchNorm2d: batch norm whose training statistics cover groups of consecutive ranks
(upstream's cuDNN "group batch norm")."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from apex.parallel import group_sync
from apex.parallel.group_sync import consecutive_group

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NAME = "GroupBatchNorm2d"


class GroupBatchNorm2d(_BatchNorm):
    r"""Batch norm of a channels_last ``(N, C, H, W)`` tensor with statistics over groups of ranks, as
    upstream Apex's ``apex.contrib.cudnn_gbn.GroupBatchNorm2d``.

    In training each channel is normalized with the mean and biased variance over ``N*H*W`` of all
    ranks of this rank's group (ranks ``[g * group_size, (g + 1) * group_size)``),
    :math:`y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta`, and the
    running statistics are updated with the unbiased variance; ``minibatch_mean`` and
    ``minibatch_inv_var`` then hold the batch's mean and inverse std. In eval mode the layer calls
    ``torch.nn.functional.batch_norm`` with the running statistics (with ``track_running_stats=False``,
    this rank's batch statistics, as the argument's documentation promises). Under autocast the input
    is first cast to the autocast dtype, as upstream. The output is channels_last, in the input's dtype.

    Args:
        num_features: ``C``.
        group_size: ranks per group; the world size must be divisible by it. The constructor is
            collective when it is above 1 (every rank builds its layers in the same order), as upstream's.
        eps, momentum, affine, track_running_stats: as :class:`torch.nn.BatchNorm2d`
            (``momentum=None``: a cumulative average).

    Raises ``ValueError`` as upstream for an input that is not 4-D, not in channels_last memory, or
    not of a supported dtype.

    Differences from upstream, on purpose:

    - The statistics travel through a ``torch.distributed`` process group (apex-parallel's
      ``create_syncbn_process_group``: one all-gather forward, one all-reduce backward), not cuDNN
      graphs over CUDA-IPC peer memory: any backend, across nodes, ranks with different batch sizes,
      and the CPU (upstream raises for a CPU input). ``fwd_peer_buffers``/``bwd_peer_buffers`` are None.
    - Dtypes: float16 as upstream, and also bfloat16 and float32; parameters float32 (or the input's
      dtype). Any ``C`` (upstream requires a multiple of 8).
    - ``group_size=1`` works without an initialized process group (upstream always needs one).
    - ``num_batches_tracked`` counts training steps (upstream leaves it at 0).
    """

    def __init__(
        self,
        num_features: int,
        group_size: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ):
        super().__init__(
            num_features, eps=eps, momentum=momentum, affine=affine, track_running_stats=track_running_stats
        )
        self.group_size = group_size
        self.process_group, self.group_world = consecutive_group(group_size, _NAME)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.group_id = rank // group_size
        self.group_rank = rank % group_size
        self.fwd_peer_buffers = None
        self.bwd_peer_buffers = None
        self.minibatch_mean = torch.zeros(num_features)
        self.minibatch_inv_var = torch.ones(num_features)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() != 4:
            raise ValueError(f"expected 4D input (got {input.dim()}D input)")

    def _check_input_channels(self, input: Tensor) -> None:
        if input.size(1) != self.num_features:
            raise ValueError(f"{_NAME}: input has {input.size(1)} channels, expected num_features={self.num_features}")

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}"

    def _momentum(self) -> float:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        return factor

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not input.is_contiguous(memory_format=torch.channels_last):
            raise ValueError(f"{_NAME} expected input tensor to be in channels last memory format")
        device_type = input.device.type
        if torch.is_autocast_enabled(device_type):
            input = input.to(torch.get_autocast_dtype(device_type))
        if input.dtype not in _DTYPES:
            raise ValueError(f"{_NAME} expected input tensor in float16, bfloat16 or float32, got {input.dtype}")
        self._check_input_channels(input)

        if not self.training:
            use_batch = self.running_mean is None
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, use_batch, 0.0, self.eps
            )
        y, mean, invstd = group_sync.train(
            input.permute(0, 2, 3, 1).contiguous(),
            None,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            self._momentum(),
            self.eps,
            False,
            self.process_group,
            self.group_world,
        )
        self.minibatch_mean, self.minibatch_inv_var = mean, invstd
        return y.permute(0, 3, 1, 2)
