"""apex_mlp's dispatcher ops: schemas, checks, references, fakes, and their autograd.

Two ops carry a whole multi-layer perceptron (``y_i = act(y_{i-1} @ w_i^T + b_i)``, the activation
after every layer, the last included, as upstream Apex):

- ``mlp_forward(input, weights, biases, activation, relu_masks=True) -> Tensor[]``: every layer's
  output (the last one is the MLP's output), then, with relu and ``relu_masks``, one bit mask per
  hidden layer (see :func:`relu_mask`). These are what the backward needs besides the parameters:
  the next layer's weight gradient reads a layer's output, and the activation derivative is a
  function of the output (relu's ``y > 0``, sigmoid's ``y * (1 - y)``). The masks let the CUDA
  backward apply relu's derivative inside the previous GEMM's epilogue (cuBLASLt's ``DRELU_BGRAD``),
  where the references read the outputs. That epilogue is off by default (apex-core's
  ``apex/cublaslt.h``: slower on the H200), so the autograd path asks for masks only where it is on
  (:func:`drelu_epilogue_on`); without them the forward neither allocates nor writes any.
- ``mlp_backward(grad_output, input, weights, outputs, masks, bias, activation, input_grad) -> Tensor[]``:
  ``[grad_input (only with input_grad), *grad_weights, *grad_biases (only with bias)]``; ``masks``
  is the forward's, or empty.

How an op is written: ``apex.core.library``. The CUDA kernels (``csrc/mlp.cu``) make the same
checks with the same words.
"""

from __future__ import annotations

import os

import torch

from apex.core.library import autograd, op
from apex.mlp._plugin import KERNELS

# upstream Apex's activation codes
ACTIVATIONS = {"none": 0, "relu": 1, "sigmoid": 2}
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_DTYPE_NAMES = "float32, float16, bfloat16, float64"


def _check_matrix(a, name: str, t: torch.Tensor, dim: int, dtype, device) -> None:
    if t.dtype != dtype:
        whose = "" if dtype == torch.uint8 else " (the input's)"
        raise TypeError(f"{a.op}: {name} has dtype {t.dtype}; expected {dtype}{whose}")
    if t.layout != torch.strided:
        raise ValueError(f"{a.op}: {name} has layout {t.layout}; only dense (strided) tensors are supported")
    if t.device != device:
        raise ValueError(f"{a.op}: {name} is on {t.device}, expected {device}")
    if t.dim() != dim:
        raise ValueError(f"{a.op}: {name} must be {dim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{a.op}: {name} is not contiguous")


def _check_layers(a, x: torch.Tensor, weights, biases) -> None:
    """The input, weights and biases of one MLP: shapes chained, one dtype and device."""
    if x.dtype not in DTYPES:
        raise TypeError(f"{a.op}: input has dtype {x.dtype}; expected one of {_DTYPE_NAMES}")
    _check_matrix(a, "input", x, 2, x.dtype, x.device)
    if len(weights) == 0:
        raise ValueError(f"{a.op}: weights is empty; an MLP needs at least one layer")
    if len(biases) not in (0, len(weights)):
        raise ValueError(f"{a.op}: biases has {len(biases)} tensors; expected 0 or {len(weights)} (one per weight)")
    features = x.shape[1]
    for i, w in enumerate(weights):
        _check_matrix(a, f"weights[{i}]", w, 2, x.dtype, x.device)
        if w.shape[1] != features:
            raise ValueError(
                f"{a.op}: weights[{i}] has shape {tuple(w.shape)}; expected {features} columns "
                f"(the {'input' if i == 0 else f'weights[{i - 1}]'}'s features)"
            )
        features = w.shape[0]
        if biases:
            _check_matrix(a, f"biases[{i}]", biases[i], 1, x.dtype, x.device)
            if biases[i].shape[0] != features:
                raise ValueError(
                    f"{a.op}: biases[{i}] has shape {tuple(biases[i].shape)}; expected ({features},) "
                    f"(weights[{i}]'s rows)"
                )


def _check_activation(a) -> None:
    if a.activation not in ACTIVATIONS.values():
        raise ValueError(f"{a.op}: activation is {a.activation}; expected 0 (none), 1 (relu) or 2 (sigmoid)")


def _check_forward(a) -> None:
    _check_layers(a, a.input, a.weights, a.biases)
    _check_activation(a)


def mask_bytes(features: int) -> int:
    """Bytes per row of a relu mask: one bit per feature, rows padded to 128 bits (cuBLASLt's rule)."""
    return -(-features // 128) * 16


def relu_mask(y: torch.Tensor) -> torch.Tensor:
    """``y > 0`` as bits, uint8 ``[rows, mask_bytes(features)]``: feature ``f`` of a row is bit
    ``f % 8`` of byte ``f // 8``; the padding bits are 0. cuBLASLt's ``RELU_AUX`` epilogues write
    this layout (a column-major bit matrix, features by rows, leading dimension a multiple of 128)."""
    rows, features = y.shape
    bits = torch.zeros((rows, mask_bytes(features) * 8), dtype=torch.uint8, device=y.device)
    bits[:, :features] = y > 0
    place = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8, device=y.device)
    return (bits.view(rows, mask_bytes(features), 8) * place).sum(-1, dtype=torch.uint8)


def _mask_count(activation: int, layers: int) -> int:
    return layers - 1 if activation == ACTIVATIONS["relu"] else 0


def drelu_epilogue_on() -> bool:
    """Whether the CUDA backward may take relu's derivative in cuBLASLt's ``DRELU`` epilogues (the
    only reader of the forward's relu masks): off unless ``APEX_CUBLASLT_ENABLE`` names ``drelu`` (or
    ``all``) and ``APEX_CUBLASLT_DISABLE`` does not; the rule of apex-core's ``apex/cublaslt.h``,
    which reads the same variables on every call. Under ``torch.compile`` it is read when tracing."""
    enabled = os.environ.get("APEX_CUBLASLT_ENABLE", "").split(",")
    disabled = os.environ.get("APEX_CUBLASLT_DISABLE", "").split(",")
    return any(name in enabled for name in ("drelu", "all")) and not any(name in disabled for name in ("drelu", "all"))


def _forward_fake(a):
    rows = a.input.shape[0]
    outputs = [a.input.new_empty((rows, w.shape[0])) for w in a.weights]
    hidden = a.weights[: _mask_count(a.activation, len(a.weights)) if a.relu_masks else 0]
    return outputs + [a.input.new_empty((rows, mask_bytes(w.shape[0])), dtype=torch.uint8) for w in hidden]


def _activate(z: torch.Tensor, activation: int) -> torch.Tensor:
    if activation == ACTIVATIONS["relu"]:
        return torch.relu(z)
    if activation == ACTIVATIONS["sigmoid"]:
        return torch.sigmoid(z)
    return z


@op(
    KERNELS,
    "mlp_forward(Tensor input, Tensor[] weights, Tensor[] biases, int activation, bool relu_masks=True) -> Tensor[]",
    check=_check_forward,
    fake=_forward_fake,
)
def mlp_forward(a):
    y = a.input
    outputs = []
    for i, w in enumerate(a.weights):
        z = torch.addmm(a.biases[i], y, w.t()) if a.biases else y @ w.t()
        y = _activate(z, a.activation)
        outputs.append(y)
    masks = _mask_count(a.activation, len(outputs)) if a.relu_masks else 0
    return outputs + [relu_mask(y) for y in outputs[:masks]]


def _check_backward(a) -> None:
    biases = [w.new_empty(w.shape[0]) for w in a.weights] if a.bias else []
    _check_layers(a, a.input, a.weights, biases)
    _check_activation(a)
    if len(a.outputs) != len(a.weights):
        raise ValueError(f"{a.op}: outputs has {len(a.outputs)} tensors; expected {len(a.weights)} (one per layer)")
    rows = a.input.shape[0]
    for i, (y, w) in enumerate(zip(a.outputs, a.weights)):
        _check_matrix(a, f"outputs[{i}]", y, 2, a.input.dtype, a.input.device)
        if tuple(y.shape) != (rows, w.shape[0]):
            raise ValueError(f"{a.op}: outputs[{i}] has shape {tuple(y.shape)}; expected {(rows, w.shape[0])}")
    if len(a.masks) not in (0, _mask_count(a.activation, len(a.weights))):
        raise ValueError(
            f"{a.op}: masks has {len(a.masks)} tensors; expected 0 or "
            f"{_mask_count(a.activation, len(a.weights))} (one per hidden layer with relu)"
        )
    for i, mask in enumerate(a.masks):
        _check_matrix(a, f"masks[{i}]", mask, 2, torch.uint8, a.input.device)
        expected = (rows, mask_bytes(a.weights[i].shape[0]))
        if tuple(mask.shape) != expected:
            raise ValueError(f"{a.op}: masks[{i}] has shape {tuple(mask.shape)}; expected {expected}")
    _check_matrix(a, "grad_output", a.grad_output, 2, a.input.dtype, a.input.device)
    if a.grad_output.shape != a.outputs[-1].shape:
        raise ValueError(
            f"{a.op}: grad_output has shape {tuple(a.grad_output.shape)}; expected "
            f"{tuple(a.outputs[-1].shape)} (the output's)"
        )


def _backward_fake(a):
    grads = [torch.empty_like(a.input)] if a.input_grad else []
    grads += [torch.empty_like(w) for w in a.weights]
    if a.bias:
        grads += [w.new_empty(w.shape[0]) for w in a.weights]
    return grads


def _activation_backward(grad: torch.Tensor, y: torch.Tensor, activation: int) -> torch.Tensor:
    """The gradient before the activation from the one after it and the activation's output."""
    if activation == ACTIVATIONS["relu"]:
        return torch.where(y > 0, grad, 0)
    if activation == ACTIVATIONS["sigmoid"]:
        yf = y.float() if y.dtype in (torch.float16, torch.bfloat16) else y
        return (grad * yf * (1 - yf)).to(y.dtype)
    return grad


@op(
    KERNELS,
    "mlp_backward(Tensor grad_output, Tensor input, Tensor[] weights, Tensor[] outputs, Tensor[] masks, bool bias, "
    "int activation, bool input_grad) -> Tensor[]",
    check=_check_backward,
    fake=_backward_fake,
)
def mlp_backward(a):
    layers = len(a.weights)
    grad_weights, grad_biases = [None] * layers, [None] * layers
    grad = a.grad_output
    for i in reversed(range(layers)):
        dz = _activation_backward(grad, a.outputs[i], a.activation)
        y_in = a.outputs[i - 1] if i > 0 else a.input
        grad_weights[i] = dz.t() @ y_in
        if a.bias:
            # 16-bit sums in float32, rounded once
            grad_biases[i] = dz.sum(0, dtype=torch.promote_types(dz.dtype, torch.float32)).to(dz.dtype)
        if i > 0 or a.input_grad:
            grad = dz @ a.weights[i]
    grads = [grad] if a.input_grad else []
    return grads + grad_weights + (grad_biases if a.bias else [])


def _forward(bias: bool, activation: int, input: torch.Tensor, *parameters: torch.Tensor):
    weights, biases = _split(bias, parameters)
    # The masks only for a CUDA backward that will read them (the references never do).
    relu_masks = input.is_cuda and drelu_epilogue_on()
    return tuple(mlp_forward(input, weights, biases, activation, relu_masks))


def _split(bias: bool, parameters):
    layers = len(parameters) // 2 if bias else len(parameters)
    return list(parameters[:layers]), list(parameters[layers:])


def _setup_context(ctx, inputs, outputs) -> None:
    bias, activation, input, *parameters = inputs
    weights, _ = _split(bias, parameters)
    layers = len(weights)
    ctx.bias, ctx.activation, ctx.layers = bias, activation, layers
    ctx.input_grad = input.requires_grad
    # Only the last layer's output is the MLP's; the hidden outputs and masks are for the backward.
    ctx.mark_non_differentiable(*outputs[: layers - 1], *outputs[layers:])
    # No zero-filled gradients for the hidden outputs and masks (kept for the backward only).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(input, *weights, *outputs)


def _backward(ctx, *grad_outputs):
    layers = ctx.layers
    grad_output = grad_outputs[layers - 1]  # the others are of non-differentiable outputs
    if grad_output is None:
        return (None,) * (3 + layers * (2 if ctx.bias else 1))  # bias, activation, input, parameters
    input, *rest = ctx.saved_tensors
    weights, outputs, masks = rest[:layers], rest[layers : 2 * layers], rest[2 * layers :]
    grads = mlp_backward(
        grad_output.contiguous(), input, weights, outputs, masks, ctx.bias, ctx.activation, ctx.input_grad
    )
    grad_input = grads.pop(0) if ctx.input_grad else None
    return None, None, grad_input, *grads


_differentiable_forward = autograd(_forward, _setup_context, _backward, "Mlp")


def mlp(bias: bool, activation: int, input: torch.Tensor, *parameters: torch.Tensor) -> torch.Tensor:
    """The MLP's output: ``parameters`` are the weights, then (with ``bias``) the biases."""
    outputs = _differentiable_forward(bool(bias), int(activation), input, *parameters)
    return outputs[len(parameters) // 2 - 1 if bias else len(parameters) - 1]
