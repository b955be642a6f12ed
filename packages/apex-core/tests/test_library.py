"""apex.core.library: an op defined with define() and given its backward with register_autograd().

A toy op in its own namespace, ``scaled_square(x, w, scale) -> (y, x_sum)`` with
``y = scale * x**2 * w`` and a non-differentiable second output: the caller that
register_autograd returns must give what the op gives, values and gradients, with or without
grad mode, under torch.compile, and must run the registered backward through its own
autograd.Function rather than the op's registered autograd.
"""

from __future__ import annotations

import pytest
import torch

from apex.core.descriptors import KernelLibrary
from apex.core.library import define, register_autograd

LIB = KernelLibrary(name="apex_core_library_test", package="apex_core_library_test", sources=())
SCHEMA = "scaled_square(Tensor x, Tensor? w, float scale) -> (Tensor y, Tensor x_sum)"
calls = {"backward": 0}


def _reference(x, w, scale):
    y = scale * x * x if w is None else scale * x * x * w
    return y, x.sum().reshape(1)


def _fake(x, w, scale):
    return torch.empty_like(x), x.new_empty((1,))


def _setup_context(ctx, inputs, output):
    x, w, scale = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, w)
    ctx.scale = scale


def _backward(ctx, grad_y, _grad_sum):
    calls["backward"] += 1
    x, w = ctx.saved_tensors
    factor = 2 * ctx.scale * x
    grad_x = grad_y * factor if w is None else grad_y * factor * w
    grad_w = None if w is None or not ctx.needs_input_grad[1] else grad_y * ctx.scale * x * x
    return grad_x, grad_w, None


OP = define(LIB, SCHEMA, _reference, _fake)
CALL = register_autograd(OP, _backward, _setup_context)


def leaves():
    torch.manual_seed(0)
    return torch.randn(5, 3, requires_grad=True), torch.randn(5, 3, requires_grad=True)


@pytest.mark.parametrize("with_weight", [True, False])
def test_caller_gives_the_ops_values_and_gradients(with_weight):
    x, w = leaves()
    weight = w if with_weight else None
    dy = torch.randn(5, 3)
    results = []
    for fn in (OP, CALL):
        calls["backward"] = 0
        y, total = fn(x, weight, 1.5)
        assert not total.requires_grad
        grads = torch.autograd.grad(y, [x, w] if with_weight else [x], dy)
        assert calls["backward"] == 1
        results.append((y.detach(), total, *grads))
    for got, expected in zip(results[1], results[0]):
        assert torch.equal(got, expected)
    torch.testing.assert_close(results[1][2], dy * 3.0 * x.detach() * (w.detach() if with_weight else 1.0))


def test_caller_uses_its_own_function_not_the_ops_autograd():
    x, w = leaves()
    y, _ = CALL(x, w, 2.0)
    assert type(y.grad_fn).__name__ == "scaled_squareBackward"
    y_op, _ = OP(x, w, 2.0)
    assert type(y_op.grad_fn).__name__ != "scaled_squareBackward"  # torch.library's own wrapper


def test_only_the_inputs_that_need_it_get_a_gradient():
    x, w = leaves()
    w.requires_grad_(False)
    y, _ = CALL(x, w, 2.0)
    (grad_x,) = torch.autograd.grad(y.sum(), [x])
    torch.testing.assert_close(grad_x, 4.0 * x.detach() * w)


def test_without_grad_the_op_runs_below_autograd():
    x, w = leaves()
    with torch.no_grad():
        y, _ = CALL(x, w, 2.0)
    assert y.grad_fn is None and not y.requires_grad
    y, _ = CALL(x.detach(), w.detach(), 2.0)
    assert y.grad_fn is None
    torch.testing.assert_close(y, 2.0 * x.detach() ** 2 * w.detach())


def test_caller_compiles_fullgraph():
    x, w = leaves()
    compiled = torch.compile(lambda a, b: CALL(a, b, 0.5)[0], fullgraph=True, backend="aot_eager")
    y = compiled(x, w)
    (grad_x,) = torch.autograd.grad(y.sum(), [x])
    torch.testing.assert_close(y, 0.5 * x.detach() ** 2 * w.detach())
    torch.testing.assert_close(grad_x, x.detach() * w.detach())


def test_caller_calls_the_op_where_its_autograd_is_native():
    """A kernel registered for the device's own autograd key (as a compiled library registers
    AutogradCUDA) takes over from the Python registration; the caller then calls the op."""
    schema = "native_square(Tensor x, Tensor? w, float scale) -> (Tensor y, Tensor x_sum)"
    op = define(LIB, schema, _reference, _fake)
    call = register_autograd(op, _backward, _setup_context)
    x, w = leaves()
    y, _ = call(x, w, 1.0)
    assert type(y.grad_fn).__name__ == "native_squareBackward"  # no native kernel yet

    class Native(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, scale):
            with torch._C._AutoDispatchBelowAutograd():
                y, total = op(x, w, scale)
            ctx.mark_non_differentiable(total)
            ctx.save_for_backward(x, w)
            ctx.scale = scale
            return y, total

        @staticmethod
        def backward(ctx, grad_y, _grad_sum):
            return _backward(ctx, grad_y, _grad_sum)

    library = torch.library.Library(LIB.name, "IMPL")
    library.impl("native_square", lambda x, w, scale: Native.apply(x, w, scale), "AutogradCPU")
    try:
        y, _ = call(x, w, 1.0)
        assert type(y.grad_fn).__name__ == "NativeBackward"
        (grad_x,) = torch.autograd.grad(y.sum(), [x])
        torch.testing.assert_close(grad_x, 2.0 * x.detach() * w.detach())
    finally:
        library._destroy()
