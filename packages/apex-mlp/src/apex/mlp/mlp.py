"""``MLP``: a stack of linear layers with an activation after each, as two dispatcher ops."""

from __future__ import annotations

import math
from copy import copy

import torch
from torch import nn

from apex.core.library import Args
from apex.mlp import _ops

__all__ = ["MLP", "MlpFunction", "mlp_function", "torch_mlp"]

# Off CUDA the MLP runs as torch's linear layers (torch_mlp: the same addmm and activation per
# layer, differentiated by torch's autograd): the ops' references are the same math behind an
# autograd Function and two op calls, which cost host time. 8x[32, 64, 16] relu fp32 forward +
# backward on 1 CPU thread: 0.239 ms through the ops, 0.11 through torch's; 128x[512, 1024, 1024,
# 512] 23.8 and 20.8 (nn.Linear + ReLU 20.8). The tests set this False to run the ops' path on the CPU.
_TORCH_OFF_CUDA = True


def _autocast(tensors):
    device_type = "cuda" if tensors[0].is_cuda else tensors[0].device.type
    # is_autocast_available is not traceable by dynamo; a compiled graph only runs on devices that
    # have autocast anyway.
    available = torch.compiler.is_compiling() or torch.amp.is_autocast_available(device_type)
    if available and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return [t.to(dtype) if t.is_floating_point() else t for t in tensors]
    return tensors


def mlp_function(bias, activation, *args):
    """The MLP of upstream Apex's ``mlp_function``: ``args`` are the input, the weights, then (when
    ``bias``) the biases; ``activation`` is 0 (none), 1 (relu) or 2 (sigmoid), applied after every
    layer. Under ``torch.autocast`` the tensors are first cast to the autocast dtype (upstream casts
    them to half under ``apex.amp``). Non-contiguous tensors are made contiguous."""
    tensors = [t.contiguous() for t in _autocast(args)]
    return _mlp(bias, activation, *tensors)


def torch_mlp(bias, activation, input, *parameters):
    """The MLP of the ops (their checks, then ``F.linear`` and the activation per layer) through
    torch's autograd: the same addmm per layer as the ops' reference, and torch's backward."""
    weights, biases = _ops._split(bias, parameters)
    _ops._check_forward(
        Args({"op": "mlp_forward", "input": input, "weights": weights, "biases": biases, "activation": activation})
    )
    y = input
    for i, w in enumerate(weights):
        y = _ops._activate(torch.nn.functional.linear(y, w, biases[i] if biases else None), activation)
    return y


def _mlp(bias, activation, *args):
    if _TORCH_OFF_CUDA and not args[0].is_cuda:
        return torch_mlp(bool(bias), int(activation), *args)
    return _ops.mlp(bias, activation, *args)


class MlpFunction:
    """Upstream's ``MlpFunction.apply(bias, activation, input, *weights, *biases)``, without the casts."""

    @staticmethod
    def apply(bias, activation, *args):
        return _mlp(bias, activation, *args)


class MLP(nn.Module):
    r"""A multi-layer perceptron: ``len(mlp_sizes) - 1`` linear layers, each followed by the activation
    (the last one too, as in upstream Apex)::

        y_0 = input,   y_i = act(y_{i-1} @ weight_{i-1}^T + bias_{i-1})

    computed by one op for the forward and one for the backward (cuBLASLt GEMMs with the bias and
    relu fused into their epilogues on CUDA; PyTorch on the CPU).

    Args:
        mlp_sizes: the feature counts, input first: ``[1024, 4096, 1024]`` makes two layers,
            ``weight_0`` of shape ``(4096, 1024)`` and ``weight_1`` of shape ``(1024, 4096)``.
        bias: whether the layers add a bias (``bias_0``, ``bias_1``, ...). Default True.
        activation: ``"none"``, ``"relu"`` (default) or ``"sigmoid"``.

    Input: ``(batch, mlp_sizes[0])``, 2-D, float32, float16, bfloat16 or float64 (the parameters'
    dtype). Output: ``(batch, mlp_sizes[-1])``.

    Initialisation as upstream: weights ``N(0, sqrt(2 / (fan_in + fan_out)))``, biases
    ``N(0, sqrt(1 / fan_out))``. ``self.bias`` and ``self.activation`` hold upstream's integer codes.
    """

    def __init__(self, mlp_sizes, bias=True, activation="relu"):
        super().__init__()
        if activation not in _ops.ACTIVATIONS:
            raise TypeError(f"activation must be one of 'none', 'relu', 'sigmoid', got {activation!r}")
        if len(mlp_sizes) < 2:
            raise ValueError(f"mlp_sizes must hold at least two sizes (one layer), got {list(mlp_sizes)}")
        self.num_layers = len(mlp_sizes) - 1
        self.mlp_sizes = copy(mlp_sizes)
        self.bias = 1 if bias else 0
        self.activation = _ops.ACTIVATIONS[activation]
        self.weights = []
        self.biases = []
        for i in range(self.num_layers):
            weight = nn.Parameter(torch.empty(mlp_sizes[i + 1], mlp_sizes[i]))
            self.weights.append(weight)
            setattr(self, f"weight_{i}", weight)
            if self.bias:
                b = nn.Parameter(torch.empty(mlp_sizes[i + 1]))
                self.biases.append(b)
                setattr(self, f"bias_{i}", b)
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .half() may replace the parameters: keep the lists on the registered ones.
        result = super()._apply(fn, recurse)
        self.weights = [getattr(self, f"weight_{i}") for i in range(self.num_layers)]
        self.biases = [getattr(self, f"bias_{i}") for i in range(self.num_layers)] if self.bias else []
        return result

    def reset_parameters(self):
        for weight in self.weights:
            nn.init.normal_(weight, 0.0, math.sqrt(2.0 / (weight.size(0) + weight.size(1))))
        for b in self.biases:
            nn.init.normal_(b, 0.0, math.sqrt(1.0 / b.size(0)))

    def forward(self, input):
        return mlp_function(self.bias, self.activation, input, *self.weights, *self.biases)

    def extra_repr(self):
        return f"MLP sizes: {self.mlp_sizes}, Bias={self.bias}, activation={self.activation}"
