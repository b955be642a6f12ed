"""Dense layers on cuBLASLt epilogues: ``FusedDense`` and ``FusedDenseGeluDense``, and their functions.

As upstream's ``apex.fused_dense``: the bias is added in the GEMM's epilogue, the GELU (tanh
approximation) of ``FusedDenseGeluDense`` in the first GEMM's epilogue, which also keeps the
pre-activation for the backward; the backward computes the bias gradient in the weight-gradient
GEMM's epilogue and the GELU gradient in the epilogue of the GEMM that produces it.

Differences from upstream, on purpose:

- parameters are initialised as ``nn.Linear``'s (upstream leaves them ``torch.empty``);
- the input may have any leading shape ``[*, in_features]`` (upstream: 2-D only);
- under CUDA autocast the arguments are cast to the autocast dtype (upstream casts through
  ``amp.half_function``, to float16 under its O1);
- float32, float16, bfloat16 on CUDA; float64, and every dtype on the CPU, through the PyTorch
  reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from apex.core.library import Args
from apex.fused_dense import _ops

__all__ = [
    "FusedDense",
    "FusedDenseGeluDense",
    "dense_no_bias_function",
    "fused_dense_function",
    "fused_dense_gelu_dense_function",
]


# Off CUDA the functions (and so the modules) run as torch's F.linear / F.gelu, differentiated by
# torch's autograd, after the ops' checks: the ops' references there are the same GEMMs behind the
# ops' Python autograd and two op calls, which cost host time. 8x32 -> 64 fp32 forward + backward on 1
# CPU thread (measured with the earlier Python Function): 0.101 ms through the ops, 0.065 through
# torch's (nn.Linear 0.054); 256x512 -> 2048 the same (17.3 and 16.9, nn.Linear 17.2). The tests set
# this False to run the ops' path on the CPU. On CUDA the ops' autograd is C++ (AutogradCUDA).
_TORCH_OFF_CUDA = True


def _torch_path(input: torch.Tensor) -> bool:
    return _TORCH_OFF_CUDA and not input.is_cuda


def _check(check, op: str, **arguments) -> None:
    check(Args({"op": op, **arguments}))


def _cast_for_autocast(*tensors):
    """The tensors in CUDA autocast's dtype when it is on for their device, else unchanged."""
    if tensors[0].is_cuda and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        return tuple(t.to(dtype) for t in tensors)
    return tensors


def _rows(input: torch.Tensor) -> torch.Tensor:
    return input.reshape(-1, input.size(-1)).contiguous() if input.dim() != 2 else input.contiguous()


def _unrows(output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    return output if input.dim() == 2 else output.reshape(*input.shape[:-1], output.size(-1))


def fused_dense_function(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``input @ weight.T + bias`` with the bias in the GEMM's epilogue (``F.linear``'s math).

    Args:
        input: ``[*, in_features]``.
        weight: ``[out_features, in_features]``, input's dtype and device.
        bias: ``[out_features]``.

    Returns ``[*, out_features]``. Differentiable in all three; the backward computes the bias
    gradient in the weight-gradient GEMM's epilogue. ``bias=None`` is :func:`dense_no_bias_function`.
    """
    if bias is None:
        return dense_no_bias_function(input, weight)
    input, weight, bias = _cast_for_autocast(input, weight, bias)
    rows, weight, bias = _rows(input), weight.contiguous(), bias.contiguous()
    if _torch_path(input):
        _check(_ops._check_linear_forward, "linear_forward", input=rows, weight=weight, bias=bias)
        return _unrows(F.linear(rows, weight, bias), input)
    return _unrows(_ops.linear_forward(rows, weight, bias), input)


def dense_no_bias_function(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``input @ weight.T`` (``F.linear`` without bias); shapes as :func:`fused_dense_function`."""
    input, weight = _cast_for_autocast(input, weight)
    rows, weight = _rows(input), weight.contiguous()
    if _torch_path(input):
        _check(_ops._check_linear_forward, "linear_forward", input=rows, weight=weight, bias=None)
        return _unrows(F.linear(rows, weight), input)
    return _unrows(_ops.linear_forward(rows, weight, None), input)


def fused_dense_gelu_dense_function(
    input: torch.Tensor, weight1: torch.Tensor, bias1: torch.Tensor, weight2: torch.Tensor, bias2: torch.Tensor
) -> torch.Tensor:
    """``gelu(input @ weight1.T + bias1, approximate="tanh") @ weight2.T + bias2``.

    Args:
        input: ``[*, in_features]``.
        weight1: ``[intermediate_features, in_features]``; bias1: ``[intermediate_features]``.
        weight2: ``[out_features, intermediate_features]``; bias2: ``[out_features]``.

    Returns ``[*, out_features]``. The first GEMM's epilogue adds bias1, applies the GELU and keeps
    its input for the backward, whose GEMMs compute the GELU gradient and both bias gradients in
    their epilogues.
    """
    input, weight1, bias1, weight2, bias2 = _cast_for_autocast(input, weight1, bias1, weight2, bias2)
    rows = _rows(input)
    weight1, bias1, weight2, bias2 = (t.contiguous() for t in (weight1, bias1, weight2, bias2))
    if _torch_path(input):
        _check(
            _ops._check_gelu_forward,
            "linear_gelu_linear_forward",
            input=rows,
            weight1=weight1,
            bias1=bias1,
            weight2=weight2,
            bias2=bias2,
        )
        out = F.linear(F.gelu(F.linear(rows, weight1, bias1), approximate="tanh"), weight2, bias2)
        return _unrows(out, input)
    return _unrows(_ops.linear_gelu_linear_forward(rows, weight1, bias1, weight2, bias2)[1], input)


def _reset_linear(weight: nn.Parameter, bias: nn.Parameter | None) -> None:
    """``nn.Linear.reset_parameters``: the same distributions, drawn in the same order."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in = weight.size(1)
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


class FusedDense(nn.Module):
    """``nn.Linear`` with the bias added in the GEMM's epilogue (upstream's ``FusedDense``).

    Args:
        in_features: size of each input's last dimension.
        out_features: size of each output's last dimension.
        bias: learn an additive bias (default True); without one the layer is a plain GEMM.

    Parameters ``weight [out_features, in_features]`` and ``bias [out_features]`` are initialised
    as ``nn.Linear``'s (upstream leaves them uninitialised, ``torch.empty``); pass ``device`` and
    ``dtype`` as to ``nn.Linear``. Input ``[*, in_features]`` (upstream: 2-D only).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_linear(self.weight, self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return dense_no_bias_function(input, self.weight)
        return fused_dense_function(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class FusedDenseGeluDense(nn.Module):
    """``Linear -> GELU(tanh approximation) -> Linear`` with the GELU in the first GEMM's epilogue.

    Args:
        in_features: size of each input's last dimension.
        intermediate_features: the hidden size between the two layers.
        out_features: size of each output's last dimension.
        bias: must be True (as upstream, which asserts it): both layers have biases.

    Parameters ``weight1 [intermediate_features, in_features]``, ``bias1``, ``weight2
    [out_features, intermediate_features]``, ``bias2``, initialised as two ``nn.Linear`` created
    in that order (upstream leaves them uninitialised, ``torch.empty``). Input ``[*, in_features]``
    (upstream: 2-D only).
    """

    def __init__(
        self,
        in_features: int,
        intermediate_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if not bias:
            raise ValueError("FusedDenseGeluDense: bias=False is not supported (both layers have biases)")
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.intermediate_features = intermediate_features
        self.out_features = out_features
        self.weight1 = nn.Parameter(torch.empty(intermediate_features, in_features, **factory))
        self.bias1 = nn.Parameter(torch.empty(intermediate_features, **factory))
        self.weight2 = nn.Parameter(torch.empty(out_features, intermediate_features, **factory))
        self.bias2 = nn.Parameter(torch.empty(out_features, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_linear(self.weight1, self.bias1)
        _reset_linear(self.weight2, self.bias2)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return fused_dense_gelu_dense_function(input, self.weight1, self.bias1, self.weight2, self.bias2)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, intermediate_features={self.intermediate_features}, "
            f"out_features={self.out_features}"
        )
