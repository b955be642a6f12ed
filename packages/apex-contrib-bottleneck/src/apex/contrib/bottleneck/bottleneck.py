"""ResNet bottleneck blocks with frozen batch norm: ``Bottleneck`` and ``SpatialBottleneck``, upstream's API.

Upstream runs the block as cuDNN-frontend fused graphs (``fast_bottleneck``) when ``use_cudnn=True`` and
as plain ``nn`` modules otherwise. Ours: ``use_cudnn=True`` runs :mod:`apex.contrib.bottleneck._block`
(apex-contrib-conv-bias-relu's ``ConvFrozenScaleBiasReLU`` and PyTorch convolutions, autograd through
them), which takes explicit NHWC as upstream's fused path does; ``use_cudnn=False`` runs the modules, as
upstream (explicit NHWC raises there, as upstream). Both compute the same function.

Parameter and buffer names, initialisation (Kaiming-uniform, ``a=1``), the stride on the first 1x1
convolution (ResNet v1 placement, as upstream), ``get_scale_bias_callable`` and the errors for
``groups``/``dilation``/``norm_func`` are upstream's, so checkpoints load either way.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from apex.contrib.bottleneck._block import block, frozen_scale_bias

__all__ = ["Bottleneck", "FrozenBatchNorm2d", "SpatialBottleneck"]


class FrozenBatchNorm2d(nn.Module):
    """Batch norm with fixed statistics and affine parameters, all buffers (``weight``, ``bias``,
    ``running_mean``, ``running_var``): ``x * scale + bias`` with ``scale = weight / sqrt(running_var)``
    and ``bias - running_mean * scale`` (no eps, as upstream). Upstream's is a ``torch.jit.ScriptModule``;
    ours is a plain module with the same buffers and ``get_scale_bias(nhwc)``."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("weight", torch.ones(n))
        self.register_buffer("bias", torch.zeros(n))
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("running_var", torch.ones(n))

    def get_scale_bias(self, nhwc: bool) -> list[torch.Tensor]:
        scale, bias = frozen_scale_bias(self, self.weight.dtype)
        shape = (1, 1, 1, -1) if nhwc else (1, -1, 1, 1)
        return [scale.reshape(shape), bias.reshape(shape)]

    def forward(self, x):
        scale, bias = self.get_scale_bias(False)
        return x * scale + bias


def _compute_scale_bias(args) -> None:
    for bn, scale, bias in args:
        s, b = frozen_scale_bias(bn, scale.dtype)
        scale.copy_(s.reshape(scale.shape))
        bias.copy_(b.reshape(bias.shape))


def _conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


def _conv3x3(in_planes: int, out_planes: int) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=1, padding=1, bias=False)


class Bottleneck(nn.Module):
    """``relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) + identity)``, with ``identity`` = ``x`` or
    ``downsample(x)`` (1x1 convolution with ``stride`` + frozen BN) when ``stride != 1`` or
    ``in_channels != out_channels``. conv1 is 1x1 with ``stride``, conv2 3x3 (padding 1), conv3 1x1.

    Args:
        in_channels, bottleneck_channels, out_channels: channel counts.
        stride: stride of conv1 and the downsample.
        groups, dilation: must be 1 (RuntimeError otherwise, as upstream).
        norm_func: must be None: frozen batch norm (RuntimeError otherwise, as upstream).
        use_cudnn: upstream's fused path; ours runs the same math on apex-contrib-conv-bias-relu's fused
            convolution + scale + bias + ReLU (any device, float32/float16/bfloat16, any memory format).
        explicit_nhwc: input and output are ``[N, H, W, C]`` and the convolution weights are stored
            ``[K, R, S, C]`` (as upstream: permuted after initialisation); needs ``use_cudnn=True``.

    The module's parameters set the compute dtype: ``x`` must have their dtype (``.half()`` the block
    for float16 input, as upstream). float32 convolutions follow ``torch.backends.cudnn.allow_tf32``
    (PyTorch's default allows TF32 on CUDA), as ``nn.Conv2d`` does.
    """

    def __init__(
        self,
        in_channels,
        bottleneck_channels,
        out_channels,
        stride=1,
        groups=1,
        dilation=1,
        norm_func=None,
        use_cudnn=False,
        explicit_nhwc=False,
    ):
        super().__init__()
        if groups != 1:
            raise RuntimeError("Only support groups == 1")
        if dilation != 1:
            raise RuntimeError("Only support dilation == 1")
        if norm_func is not None:
            raise RuntimeError("Only support frozen BN now.")
        norm_func = FrozenBatchNorm2d
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(_conv1x1(in_channels, out_channels, stride), norm_func(out_channels))
        else:
            self.downsample = None
        self.conv1 = _conv1x1(in_channels, bottleneck_channels, stride)
        self.conv2 = _conv3x3(bottleneck_channels, bottleneck_channels)
        self.conv3 = _conv1x1(bottleneck_channels, out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.stride = stride
        self.bn1 = norm_func(bottleneck_channels)
        self.bn2 = norm_func(bottleneck_channels)
        self.bn3 = norm_func(out_channels)
        self.w_scale = None
        self.w_bias = None
        self.use_cudnn = use_cudnn
        for w in self._conv_weights():
            nn.init.kaiming_uniform_(w, a=1)
        self.explicit_nhwc = explicit_nhwc
        if explicit_nhwc:
            with torch.no_grad():
                for p in self.parameters():
                    p.data = p.data.permute(0, 2, 3, 1).contiguous()

    def _conv_weights(self) -> list[torch.Tensor]:
        weights = [self.conv1.weight, self.conv2.weight, self.conv3.weight]
        if self.downsample is not None:
            weights.append(self.downsample[0].weight)
        return weights

    @property
    def w_conv(self) -> list[torch.Tensor]:
        """The convolution weights [conv1, conv2, conv3(, downsample)], as upstream's attribute."""
        return self._conv_weights()

    def _batch_norms(self) -> list[FrozenBatchNorm2d]:
        norms = [self.bn1, self.bn2, self.bn3]
        if self.downsample is not None:
            norms.append(self.downsample[1])
        return norms

    def get_scale_bias_callable(self):
        """Keep the folded scales and biases in ``self.w_scale`` / ``self.w_bias`` (used by every later
        forward instead of recomputing them) and return a callable that recomputes them in place from the
        batch norms' buffers, as upstream (call it after changing the buffers)."""
        self.w_scale, self.w_bias, args = [], [], []
        shape = (1, 1, 1, -1) if self.explicit_nhwc else (1, -1, 1, 1)
        for bn in self._batch_norms():
            s = torch.empty_like(bn.weight).reshape(shape)
            b = torch.empty_like(bn.weight).reshape(shape)
            self.w_scale.append(s)
            self.w_bias.append(b)
            args.append((bn, s, b))
        recompute = functools.partial(_compute_scale_bias, args)
        recompute()
        return recompute

    def _scales_biases(self, dtype):
        if self.w_scale is not None:
            return self.w_scale, self.w_bias
        pairs = [frozen_scale_bias(bn, dtype) for bn in self._batch_norms()]
        return [s for s, _ in pairs], [b for _, b in pairs]

    def _check_input(self, x) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{type(self).__name__}: x must be a 4-D tensor, got {getattr(x, 'shape', type(x))}")
        weight = self.conv1.weight
        channels = weight.shape[-1] if self.explicit_nhwc else weight.shape[1]
        got = x.shape[-1] if self.explicit_nhwc else x.shape[1]
        if got != channels:
            layout = "[N, H, W, C]" if self.explicit_nhwc else "[N, C, H, W]"
            raise ValueError(
                f"{type(self).__name__}: x has {got} channels (shape {tuple(x.shape)}, {layout}); expected {channels}"
            )
        if x.dtype != weight.dtype:
            raise TypeError(
                f"{type(self).__name__}: x has dtype {x.dtype} but the block's parameters are {weight.dtype}; "
                "convert the block (e.g. .half()) or x"
            )

    def _native(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)

    def forward(self, x):
        self._check_input(x)
        if self.use_cudnn:
            scales, biases = self._scales_biases(x.dtype)
            return block(x, self._conv_weights(), scales, biases, self.stride, self.explicit_nhwc)
        if self.explicit_nhwc:
            raise RuntimeError("explicit nhwc with native ops is not supported.")
        return self._native(x)


class SpatialBottleneck(Bottleneck):
    """:class:`Bottleneck` with the H dimension split over the ranks of a spatial group.

    ``spatial_parallel_args`` is upstream's tuple ``(spatial_group_size, spatial_group_rank,
    spatial_communicator, spatial_halo_exchanger, spatial_method, use_delay_kernel)``; None means
    ``(1, 0, None, None, 0, False)`` (no split: exactly :class:`Bottleneck`). With a group of more than
    one rank, each rank passes its consecutive slice of H (in the group's order) and gets its slice of
    the output; the 3x3 convolution reads one row from each neighbour through
    ``spatial_halo_exchanger.left_right_halo_exchange`` (an exchanger of
    :mod:`apex.contrib.bottleneck.halo_exchangers`), and backward sends the halos' gradients back the same
    way. Weight gradients are this rank's share: sum them over the group (as data-parallel training does).
    With ``stride`` 2 each slice must have an even height.

    Differs from upstream: the split runs with ``use_cudnn`` True or False (upstream's module path ignores
    the split); ``spatial_method`` (1, 2 or 3: upstream's ways to overlap the halo convolutions) and
    ``use_delay_kernel`` are checked and otherwise unused: every method computes the same result, ours by
    padding the slice with the received rows; ``spatial_communicator`` is unused (upstream's too).
    """

    def __init__(
        self,
        in_channels,
        bottleneck_channels,
        out_channels,
        stride=1,
        groups=1,
        dilation=1,
        norm_func=None,
        use_cudnn=False,
        explicit_nhwc=False,
        spatial_parallel_args=None,
    ):
        super().__init__(
            in_channels,
            bottleneck_channels,
            out_channels,
            stride,
            groups,
            dilation,
            norm_func,
            use_cudnn,
            explicit_nhwc,
        )
        if spatial_parallel_args is None:
            spatial_parallel_args = (1, 0, None, None, 0, False)
        if not isinstance(spatial_parallel_args, (tuple, list)) or len(spatial_parallel_args) != 6:
            raise ValueError(
                "SpatialBottleneck: spatial_parallel_args must be (spatial_group_size, spatial_group_rank, "
                "spatial_communicator, spatial_halo_exchanger, spatial_method, use_delay_kernel), got "
                f"{spatial_parallel_args!r}"
            )
        size, rank, _, exchanger, method, _ = spatial_parallel_args
        if size > 1:
            if not 0 <= rank < size:
                raise ValueError(f"SpatialBottleneck: spatial_group_rank {rank} is not in [0, {size})")
            if exchanger is None or not hasattr(exchanger, "left_right_halo_exchange"):
                raise ValueError(
                    "SpatialBottleneck: spatial_parallel_args needs a spatial_halo_exchanger (from "
                    "apex.contrib.bottleneck.halo_exchangers) when spatial_group_size > 1"
                )
            if method not in (1, 2, 3):
                raise ValueError(f"SpatialBottleneck: spatial_method must be 1, 2 or 3, got {method!r}")
        self.spatial_parallel_args = tuple(spatial_parallel_args)
        self.thresholdTop, self.thresholdBottom = None, None

    def forward(self, x):
        size, _, _, exchanger, _, _ = self.spatial_parallel_args
        if size <= 1:
            return super().forward(x)
        self._check_input(x)
        if self.explicit_nhwc and not self.use_cudnn:
            raise RuntimeError("explicit nhwc with native ops is not supported.")
        height = x.shape[1] if self.explicit_nhwc else x.shape[2]
        if height % self.stride:
            raise ValueError(
                f"SpatialBottleneck: x's slice of H has {height} rows, not a multiple of stride {self.stride}: "
                "the ranks' strided rows would not line up with the unsplit block's"
            )
        scales, biases = self._scales_biases(x.dtype)
        return block(x, self._conv_weights(), scales, biases, self.stride, self.explicit_nhwc, exchanger)
