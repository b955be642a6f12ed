"""Upstream Apex's ``fused_layer_norm_cuda`` extension module, on apex-normalization's ops.

Code written against upstream (its ``apex.normalization.fused_layer_norm`` Functions, and projects
that call the kernels directly) imports this module by that name. The functions keep upstream's
names, argument orders and returns, and call ``torch.ops.apex_normalization``, so they also run on
the CPU (through the PyTorch references):

- ``forward_affine(input, normalized_shape, gamma, beta, epsilon) -> [output, mean, invvar]``,
  ``forward(input, normalized_shape, epsilon)``, ``forward_affine_mixed_dtypes(...)`` (the output
  in gamma's dtype);
- ``backward_affine(dout, mean, invvar, input_or_output, normalized_shape, gamma, beta, epsilon,
  memory_efficient) -> [grad_input, grad_gamma, grad_beta]``, ``backward(dout, mean, invvar,
  input_or_output, normalized_shape, epsilon, memory_efficient) -> grad_input``;
- ``rms_forward_affine(input, normalized_shape, gamma, epsilon) -> [output, invvar]``,
  ``rms_forward``, ``rms_forward_affine_mixed_dtypes``, ``rms_backward_affine(dout, invvar,
  input_or_output, normalized_shape, gamma, epsilon, memory_efficient) -> [grad_input,
  grad_gamma]``, ``rms_backward``.

``mean`` and ``invvar`` are 1-D, one value per row, float32 (float64 for float64 input).
``input_or_output`` is the forward's input, or with ``memory_efficient`` its output (``mean`` is
then unused and may be None); the input gradient comes back in its dtype, the parameter gradients in
the parameters'. Inputs may be float32, float16, bfloat16 or float64. Unlike upstream's module,
non-contiguous tensors are made contiguous instead of refused, and ``epsilon`` is not needed by
the backward (the statistics carry it).
"""

from __future__ import annotations

from apex.normalization import _ops
from apex.normalization.functional import normalized_shape_tuple


def _contiguous(t):
    return None if t is None else t.contiguous()


def _forward(input, normalized_shape, gamma, beta, epsilon, rms, mixed):
    gamma, beta = _contiguous(gamma), _contiguous(beta)
    output_dtype = gamma.dtype if mixed else None
    out, mean, invvar = _ops.norm_forward(
        input.contiguous(),
        gamma,
        beta,
        normalized_shape_tuple(normalized_shape),
        float(epsilon),
        rms,
        False,
        output_dtype,
    )
    return out, mean.reshape(-1), invvar.reshape(-1)


def _backward(dout, mean, invvar, input_or_output, normalized_shape, gamma, beta, memory_efficient, rms):
    memory_efficient = bool(memory_efficient)
    saved = input_or_output.contiguous()
    gamma, beta = _contiguous(gamma), _contiguous(beta)
    if mean is None or rms or memory_efficient:
        mean = invvar.new_empty((0,))
    grad_input, grad_gamma, grad_beta = _ops.norm_backward(
        dout.contiguous(),
        saved,
        gamma,
        beta,
        mean.contiguous(),
        invvar.contiguous(),
        normalized_shape_tuple(normalized_shape),
        rms,
        memory_efficient,
        saved.dtype,
        gamma is not None,
    )
    return grad_input, grad_gamma, grad_beta


def forward_affine(input, normalized_shape, gamma, beta, epsilon):
    return list(_forward(input, normalized_shape, gamma, beta, epsilon, False, False))


def forward_affine_mixed_dtypes(input, normalized_shape, gamma, beta, epsilon):
    return list(_forward(input, normalized_shape, gamma, beta, epsilon, False, True))


def forward(input, normalized_shape, epsilon):
    return list(_forward(input, normalized_shape, None, None, epsilon, False, False))


def backward_affine(dout, mean, invvar, input_or_output, normalized_shape, gamma, beta, epsilon, memory_efficient):
    return list(_backward(dout, mean, invvar, input_or_output, normalized_shape, gamma, beta, memory_efficient, False))


def backward(dout, mean, invvar, input_or_output, normalized_shape, epsilon, memory_efficient):
    return _backward(dout, mean, invvar, input_or_output, normalized_shape, None, None, memory_efficient, False)[0]


def rms_forward_affine(input, normalized_shape, gamma, epsilon):
    out, _, invvar = _forward(input, normalized_shape, gamma, None, epsilon, True, False)
    return [out, invvar]


def rms_forward_affine_mixed_dtypes(input, normalized_shape, gamma, epsilon):
    out, _, invvar = _forward(input, normalized_shape, gamma, None, epsilon, True, True)
    return [out, invvar]


def rms_forward(input, normalized_shape, epsilon):
    out, _, invvar = _forward(input, normalized_shape, None, None, epsilon, True, False)
    return [out, invvar]


def rms_backward_affine(dout, invvar, input_or_output, normalized_shape, gamma, epsilon, memory_efficient):
    grad_input, grad_gamma, _ = _backward(
        dout, None, invvar, input_or_output, normalized_shape, gamma, None, memory_efficient, True
    )
    return [grad_input, grad_gamma]


def rms_backward(dout, invvar, input_or_output, normalized_shape, epsilon, memory_efficient):
    return _backward(dout, None, invvar, input_or_output, normalized_shape, None, None, memory_efficient, True)[0]
