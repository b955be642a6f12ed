"""What FusedLayerNorm, FusedRMSNorm and their mixed-dtype subclasses share."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from apex.normalization.functional import _norm, normalized_shape_tuple


class _FusedNorm(nn.Module):
    _rms = False
    _mixed = False

    def __init__(
        self, normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False, *, device=None, dtype=None
    ):
        super().__init__()
        self.normalized_shape = torch.Size(normalized_shape_tuple(normalized_shape))
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            if self._rms:
                self.register_parameter("bias", None)
            else:
                self.bias = nn.Parameter(torch.empty(self.normalized_shape, **factory))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, input: torch.Tensor, residual: torch.Tensor | None = None):
        return _norm(
            input,
            residual,
            self.weight,
            self.bias,
            self.normalized_shape,
            self.eps,
            self._rms,
            self.memory_efficient,
            self._mixed,
        )

    def extra_repr(self) -> str:
        text = f"{tuple(self.normalized_shape)}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        return text + (", memory_efficient=True" if self.memory_efficient else "")


class _MixedDtype:
    """Makes FusedLayerNorm / FusedRMSNorm upstream's MixedFused* module: the output in the
    parameters' dtype, always affine. Upstream accepts ``elementwise_affine`` only to warn about it
    (and refuse False), so the same calls keep working here."""

    _mixed = True

    def __init__(self, normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs):
        cls_name = type(self).__name__
        if "elementwise_affine" in kwargs:
            affine = kwargs.pop("elementwise_affine")
            warnings.warn(f"{cls_name} always has affine parameters; elementwise_affine is ignored", stacklevel=2)
            if not affine:
                raise RuntimeError(f"{cls_name} does not support elementwise_affine=False")
        # Other keyword arguments are ignored, as upstream ignores them (Megatron passes
        # sequence_parallel_enabled, some callers misspelt); device and dtype are ours.
        factory = {k: kwargs[k] for k in ("device", "dtype") if k in kwargs}
        super().__init__(normalized_shape, eps, True, memory_efficient, **factory)
