"""Weight gradients as autograd nodes of their own on the side stream (``APEX_SIDE_STREAM=layers``).

Inside an op the side stream can only overlap the op's own GEMMs: the op joins it before returning,
since autograd hands a node's gradients to the next node on the stream the node ran on. Here a dense
layer's graph has two nodes instead of one. A *weight-gradient node*, whose forward runs with the
side stream current (so autograd runs its backward there), takes the layer's input and parameters
and returns a *token*: a stride-0 tensor of the output's shape, no memory. The *input node* (on the
caller's stream) computes the output from detached parameters and takes the token as an input; its
backward returns the input's gradient and passes the output's gradient on to the token. Autograd
then runs the weight-gradient GEMM on the side stream after it (an event) while the caller's stream
goes on with the layers before, and accumulates the parameters' gradients there; ``backward()``
returns with the caller's stream waiting on every stream a leaf's gradient was made on (autograd's
stream rules), so the optimizer sees finished gradients.

Gradients and saved inputs that the side stream reads are recorded on it (``record_stream``), so the
caller's stream does not reuse their memory before the side stream is done.
"""

from __future__ import annotations

import contextlib

import torch

from apex.core.streams import side_stream, side_stream_mode
from apex.fused_dense import _ops


def wanted(input: torch.Tensor, *parameters: torch.Tensor | None) -> bool:
    """Whether a call should build the two-node graph: ``APEX_SIDE_STREAM=layers``, a CUDA input, a
    parameter that needs a gradient, autograd recording, and neither torch.compile tracing nor a CUDA
    graph being captured."""
    return (
        input.is_cuda
        and torch.is_grad_enabled()
        and any(p is not None and p.requires_grad for p in parameters)
        and side_stream_mode() == "layers"
        and not torch.compiler.is_compiling()
        and not torch.cuda.is_current_stream_capturing()
    )


def _token(like: torch.Tensor | tuple, device, dtype) -> torch.Tensor:
    shape = like if isinstance(like, tuple) else tuple(like.shape)
    return torch.empty((), device=device, dtype=dtype).expand(shape)


class _WeightGrad(torch.autograd.Function):
    """``d_weight = grad.T @ input`` and ``d_bias = grad.sum(0)`` on the side stream; the token's
    gradient is the layer output's gradient."""

    @staticmethod
    def forward(ctx, input, weight, bias, shape):
        ctx.save_for_backward(input)
        ctx.has_bias = bias is not None
        return _token(shape, input.device, input.dtype)

    @staticmethod
    def backward(ctx, grad):
        (input,) = ctx.saved_tensors
        if input.is_cuda:
            stream = torch.cuda.current_stream(input.device)  # the side stream: autograd made it current
            grad.record_stream(stream)
            input.record_stream(stream)
        d_weight = grad.t().mm(input)
        d_bias = grad.sum(0) if ctx.has_bias else None
        return None, d_weight, d_bias, None


def _weight_grad(input, weight, bias, shape) -> torch.Tensor:
    # Off CUDA (the tests of the graph on the CPU) there is no side stream: the same nodes in order.
    on_side = torch.cuda.stream(side_stream(input.device)) if input.is_cuda else contextlib.nullcontext()
    with on_side:
        return _WeightGrad.apply(input, weight, bias, shape)


class _Dense(torch.autograd.Function):
    """``input @ weight.T (+ bias)`` by the op; backward: ``grad @ weight`` for the input, ``grad`` for the token."""

    @staticmethod
    def forward(ctx, input, weight, bias, token):
        ctx.save_for_backward(weight)
        return _ops.linear_forward(input, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        grad = grad.contiguous()
        d_input = grad.mm(weight) if ctx.needs_input_grad[0] else None
        return d_input, None, None, grad


def dense(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``fused_dense_function`` on 2-D ``rows`` as the two-node graph."""
    token = _weight_grad(rows, weight, bias, (rows.size(0), weight.size(0)))
    return _Dense.apply(rows, weight.detach(), None if bias is None else bias.detach(), token)


class _GeluDense(torch.autograd.Function):
    """The fused forward op; returns ``(output2, output1)`` (output1, the GELU's output, feeds the
    second layer's weight-gradient node). Backward: the GELU gradient and the input's, and the
    pre-activation's gradient for the first layer's token."""

    @staticmethod
    def forward(ctx, input, weight1, bias1, weight2, bias2, token1):
        output1, output2, gelu_in = _ops.linear_gelu_linear_forward(input, weight1, bias1, weight2, bias2)
        ctx.save_for_backward(weight1, weight2, gelu_in)
        ctx.mark_non_differentiable(output1)
        ctx.set_materialize_grads(False)
        return output2, output1

    @staticmethod
    def backward(ctx, grad, _grad_output1):
        if grad is None:
            return None, None, None, None, None, None
        weight1, weight2, gelu_in = ctx.saved_tensors
        d_gelu_in = torch.ops.aten.gelu_backward(grad.contiguous().mm(weight2), gelu_in, approximate="tanh")
        d_input = d_gelu_in.mm(weight1) if ctx.needs_input_grad[0] else None
        return d_input, None, None, None, None, d_gelu_in


class _Join(torch.autograd.Function):
    """``output`` unchanged; its gradient goes to both ``output``'s node and the token's."""

    @staticmethod
    def forward(ctx, output, token):
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def gelu_dense(rows, weight1, bias1, weight2, bias2) -> torch.Tensor:
    """``fused_dense_gelu_dense_function`` on 2-D ``rows`` as the two-node graphs of both layers."""
    token1 = _weight_grad(rows, weight1, bias1, (rows.size(0), weight1.size(0)))
    detached = (t.detach() for t in (weight1, bias1, weight2, bias2))
    output2, output1 = _GeluDense.apply(rows, *detached, token1)
    token2 = _weight_grad(output1, weight2, bias2, tuple(output2.shape))
    return _Join.apply(output2, token2)
