"""apex.core.library: ops defined with op() and made differentiable with autograd().

Toy ops in their own namespace: an out-of-place ``scaled_square(x, w, scale) -> (y, x_sum)``
(``y = scale * x**2 * w``, a non-differentiable second output) and an in-place ``add_`` whose
fake is derived. The check must run once per call on every path, the reference must see the
schema's defaults, and the caller that autograd() returns must give the op's values and the
registered backward's gradients in eager mode, without grad, under torch.compile and torch.func.
"""

from __future__ import annotations

import pytest
import torch

from apex.core.descriptors import KernelLibrary
from apex.core.library import CONTIGUOUS_INPUTS, autograd, direct, op, plain_cpu

LIB = KernelLibrary(name="apex_core_library_test", package="apex_core_library_test", sources=())
calls = {"check": 0}
seen = {}


def _check(a):
    calls["check"] += 1
    if a.w is not None and a.w.shape != a.x.shape:
        raise ValueError(f"{a.op}: w has shape {tuple(a.w.shape)} but x has {tuple(a.x.shape)}")
    a.numel = a.x.numel()  # derived by the check, read by the reference and the fake


def _fake(a):
    return torch.empty_like(a.x), a.x.new_empty((1,))


@op(LIB, "scaled_square(Tensor x, Tensor? w, float scale=2.0) -> (Tensor y, Tensor x_sum)", check=_check, fake=_fake)
def scaled_square(a):
    seen["scale"], seen["numel"] = a.scale, a.numel
    y = a.scale * a.x * a.x if a.w is None else a.scale * a.x * a.x * a.w
    return y, a.x.sum().reshape(1)


def _check_add(a):
    calls["check"] += 1
    if a.out.shape != a.x.shape:
        raise ValueError(f"{a.op}: out has shape {tuple(a.out.shape)} but x has {tuple(a.x.shape)}")


@op(LIB, "add_(Tensor(a!) out, Tensor x, *, float alpha=1.0) -> ()", check=_check_add)
def add_(a):
    a.out.add_(a.x, alpha=a.alpha)


def _check_dense(a):
    if not a.x.is_contiguous():
        raise ValueError(f"{a.op}: x is not contiguous")


@op(
    LIB,
    "dense_double(Tensor x) -> Tensor",
    check=_check_dense,
    fake=lambda a: torch.empty_like(a.x),
    tags=CONTIGUOUS_INPUTS,
)
def dense_double(a):
    return 2 * a.x


def _setup_context(ctx, inputs, output):
    x, w, scale = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, w)
    ctx.scale = scale


def _backward(ctx, grad_y, _grad_sum):
    x, w = ctx.saved_tensors
    factor = 2 * ctx.scale * x
    grad_x = grad_y * factor if w is None else grad_y * factor * w
    grad_w = None if w is None or not ctx.needs_input_grad[1] else grad_y * ctx.scale * x * x
    return grad_x, grad_w, None


CALL = autograd(scaled_square, _setup_context, _backward, "ScaledSquare")


def leaves():
    torch.manual_seed(0)
    return torch.randn(5, 3, requires_grad=True), torch.randn(5, 3, requires_grad=True)


def test_op_is_the_dispatcher_op_and_binds_defaults_by_name():
    assert scaled_square is torch.ops.apex_core_library_test.scaled_square.default
    x = torch.randn(4, 3)
    y, total = torch.ops.apex_core_library_test.scaled_square(x, None)
    assert seen == {"scale": 2.0, "numel": 12}
    torch.testing.assert_close(y, 2.0 * x * x)
    torch.testing.assert_close(total, x.sum().reshape(1))
    scaled_square(x, None, scale=0.5)
    assert seen["scale"] == 0.5


def test_check_runs_once_per_call_and_names_the_argument():
    x = torch.randn(3)
    before = calls["check"]
    scaled_square(x, torch.ones(3))
    assert calls["check"] == before + 1
    with pytest.raises(ValueError, match=r"^scaled_square: w has shape \(2,\) but x has \(3,\)$"):
        scaled_square(x, torch.ones(2))
    out = torch.zeros(3)
    add_(out, x, alpha=3.0)
    torch.testing.assert_close(out, 3.0 * x)
    with pytest.raises(ValueError, match=r"^add_: out has shape \(2,\)"):
        add_(torch.zeros(2), x)


def test_the_fake_runs_the_check_and_is_derived_for_an_in_place_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(6, 2)
        before = calls["check"]
        y, total = scaled_square(x, None)
        assert (y.shape, total.shape, calls["check"]) == (x.shape, (1,), before + 1)
        assert add_(torch.empty(6, 2), x) is None
        with pytest.raises(ValueError, match="add_: out has shape"):
            add_(torch.empty(1), x)


@pytest.mark.skipif(not CONTIGUOUS_INPUTS, reason="this torch has no needs_contiguous_strides tag")
def test_an_op_tagged_for_contiguous_inputs_has_the_tag_and_its_fake_sees_them_contiguous():
    overload = torch.ops.apex_core_library_test.dense_double.default
    assert torch.Tag.needs_contiguous_strides in overload.tags
    strided = torch.randn(4, 6).t()  # what a graph's fake tensor may carry; the kernel gets a copy
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        out = overload(mode.from_tensor(strided))
    assert out.shape == (6, 4) and out.is_contiguous()
    with pytest.raises(ValueError, match="x is not contiguous"):  # a real call still checks
        overload(strided)


def test_opcheck_passes_for_both_ops():
    x = torch.randn(4, 3)
    torch.library.opcheck(scaled_square, (x, torch.randn(4, 3), 1.5))
    torch.library.opcheck(add_, (torch.randn(4, 3), x), {"alpha": 0.5})


def test_an_op_returning_tensors_needs_a_fake_and_op_is_a_reserved_name():
    with pytest.raises(TypeError, match="no_fake: an op that returns tensors needs a fake"):
        op(LIB, "no_fake(Tensor x) -> Tensor")
    with pytest.raises(ValueError, match="an argument may not be called 'op'"):
        op(LIB, "named_op(Tensor x, int op) -> ()")(lambda a: None)


@pytest.mark.parametrize("with_weight", [True, False])
def test_caller_gives_the_ops_values_and_the_backwards_gradients(with_weight):
    x, w = leaves()
    weight = w if with_weight else None
    y, total = CALL(x, weight, 1.5)
    assert type(y.grad_fn).__name__ == "ScaledSquareBackward"
    assert not total.requires_grad
    y.sum().backward()  # the op has no autograd formula: these gradients are the backward's
    expected_x = 2 * 1.5 * x.detach() * (w.detach() if with_weight else 1)
    torch.testing.assert_close(x.grad, expected_x)
    if with_weight:
        torch.testing.assert_close(w.grad, 1.5 * x.detach() ** 2)


def test_caller_without_grad_calls_the_op_directly():
    x, w = leaves()
    with torch.no_grad():
        y, _ = CALL(x, w, 1.0)
    assert y.grad_fn is None and not y.requires_grad
    y, _ = CALL(x.detach(), w.detach(), 1.0)
    assert y.grad_fn is None


def test_caller_compiles_fullgraph_forward_and_backward():
    x, w = leaves()
    compiled = torch.compile(lambda x, w: CALL(x, w, 0.5)[0].sum(), fullgraph=True, backend="aot_eager")
    compiled(x, w).backward()
    torch.testing.assert_close(x.grad, 2 * 0.5 * x.detach() * w.detach())
    torch.testing.assert_close(w.grad, 0.5 * x.detach() ** 2)


def test_caller_under_torch_func_grad():
    x, w = leaves()
    grad_x = torch.func.grad(lambda x: CALL(x, w.detach(), 1.0)[0].sum())(x.detach())
    torch.testing.assert_close(grad_x, 2 * x.detach() * w.detach())


# direct and plain_cpu: the eager CPU path past the dispatcher ------------------------------------


def test_direct_runs_the_check_and_the_reference_without_the_dispatcher():
    run = direct(scaled_square)
    x = torch.randn(4, 3)
    before = calls["check"]
    y, total = run(x, None, scale=0.5)
    torch.testing.assert_close(total, x.sum().reshape(1))
    assert calls["check"] == before + 1 and seen == {"scale": 0.5, "numel": 12}
    torch.testing.assert_close(y, 0.5 * x * x)
    with pytest.raises(ValueError, match=r"^scaled_square: w has shape \(2,\) but x has \(3,\)$"):
        run(torch.randn(3), torch.ones(2))
    x, w = leaves()
    eager = autograd(run, _setup_context, _backward, "ScaledSquareEager")
    y, _ = eager(x, w, 3.0)
    assert type(y.grad_fn).__name__ == "ScaledSquareEagerBackward"
    grads = torch.autograd.grad(y.sum(), (x, w))
    reference = torch.autograd.grad((3.0 * x * x * w).sum(), (x, w))
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want)


def test_plain_cpu_holds_only_for_plain_cpu_tensors_outside_modes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(3)
    assert plain_cpu(x, None, torch.nn.Parameter(torch.randn(3)))
    assert not plain_cpu(x, torch.empty(3, device="meta"))

    class Sub(torch.Tensor):
        pass

    assert not plain_cpu(x.as_subclass(Sub))
    with FlopCounterMode(display=False):
        assert not plain_cpu(x)
    with torch.device("cpu"):  # a torch function mode
        assert not plain_cpu(x)
    with FakeTensorMode():
        assert not plain_cpu(torch.empty(3))
    assert torch.func.grad(lambda t: (t * float(plain_cpu(t))).sum())(x).eq(0).all()  # a functorch wrapper
    seen_when_tracing = []
    torch.jit.trace(lambda t: seen_when_tracing.append(plain_cpu(t)) or t * 2, (x,), check_trace=False)
    assert seen_when_tracing == [False]
    assert plain_cpu(x)


# Inductor: every op is registered as a fallback kernel before Inductor lowers it, so its implicit-
# fallback branch (which on torch <= 2.11 formats the op's IR arguments eagerly, exponential in a deep
# graph's depth) never runs for our ops. In a fresh interpreter, so the op is new to Inductor.
_INDUCTOR_SCRIPT = r"""
import logging, sys
import torch
import torch._inductor.exc as exc
from apex.core.descriptors import KernelLibrary
from apex.core.library import op

formatted = []
original = exc.OperatorIssue.operator_str
def spy(target, args, kwargs):
    formatted.append(str(target))
    return original(target, args, kwargs)
exc.OperatorIssue.operator_str = staticmethod(spy)
logging.getLogger("torch._inductor.graph").setLevel(logging.INFO)  # its LazyString is formatted
logging.getLogger("torch._inductor.graph").addHandler(logging.StreamHandler(sys.stdout))

LIB = KernelLibrary(name="apex_core_inductor_test", package="apex_core_inductor_test", sources=())
late = sys.argv[1] == "late"
if late:  # Inductor's lowering module is loaded before the op is defined
    import torch._inductor.lowering

@op(LIB, "mix(Tensor x, Tensor y) -> (Tensor, Tensor)", fake=lambda a: (torch.empty_like(a.x), torch.empty_like(a.x)))
def mix(a):
    return a.x + a.y, a.x * 0.5

@op(LIB, "tail(Tensor x, Tensor y) -> Tensor", fake=lambda a: torch.empty_like(a.x))
def tail(a):
    return a.x * 3 + a.y

if late:
    assert mix in torch._inductor.lowering.lowerings, "not registered at definition"

def deep(x, y):
    for _ in range(12):  # each step reads both of the last step's outputs
        x, y = mix(x, y)
    # tail is first met at the end of the chain: on torch 2.11 formatting its arguments took 2.4 s
    # at a depth of 10, 17 s at 14 and over 100 s at 18 (CPU); registered first, 1.8 s at each
    return tail(torch.sin(x), y)

x, y = torch.randn(8), torch.randn(8)
torch.testing.assert_close(torch.compile(deep)(x, y), deep(x, y))
from torch._inductor import lowering
from torch._library.utils import get_layout_constraint_tag
for o in (mix, tail):
    assert o in lowering.lowerings
    expected = lowering.tag_to_layout_constraint(get_layout_constraint_tag(o, with_default=True))
    assert lowering.maybe_layout_constraints(o) is expected, (o, lowering.maybe_layout_constraints(o), expected)
assert not [t for t in formatted if "apex_core_inductor_test" in t], formatted
print("OK")
"""


def _inductor_layout_api() -> bool:
    """Whether this torch has the private Inductor API the early registration uses (torch >= 2.7)."""
    try:
        from torch._inductor import lowering
        from torch._library.utils import get_layout_constraint_tag  # noqa: F401
    except Exception:
        return False
    return hasattr(lowering, "make_fallback") and hasattr(lowering, "tag_to_layout_constraint")


@pytest.mark.parametrize("when", ["fake", "late"])
def test_ops_are_inductor_fallbacks_before_inductor_lowers_them(when):
    import os
    import subprocess
    import sys

    if not _inductor_layout_api():
        pytest.skip(f"torch {torch.__version__} lacks the private Inductor API (Inductor's own path applies)")

    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}  # a cached graph is never lowered
    done = subprocess.run(
        [sys.executable, "-c", _INDUCTOR_SCRIPT, when], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout[-2000:] + done.stderr[-4000:]
