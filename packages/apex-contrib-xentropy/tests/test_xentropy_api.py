"""The public API as upstream code calls it: ``SoftmaxCrossEntropyLoss.apply`` (autograd, padding,
half_to_float, the in-place backward, double backward, torch.compile), the legacy ``xentropy_cuda``
module against it, and what importing the package registers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import apex.core
from apex.contrib.xentropy import SoftmaxCrossEntropyLoss, _ops
from apex.contrib.xentropy import softmax_xentropy as softmax_xentropy_module
from apex.contrib.xentropy._plugin import PLUGIN
from apex.core.testing import graph_reaches, load_example

OPS_NAMES = ["softmax_cross_entropy_forward", "softmax_cross_entropy_backward", "softmax_cross_entropy_backward_"]


def random_case(tokens, vocab, dtype, device, padding_idx=0):
    logits = (3 * torch.randn(tokens, vocab, dtype=torch.float64)).to(dtype=dtype, device=device)
    labels = torch.randint(1, vocab, (tokens,), device=device)
    labels[::3] = padding_idx  # upstream's default padding_idx is 0
    return logits, labels


def torch_losses(logits, labels, smoothing, padding_idx):
    """float64 PyTorch losses of ``logits`` (a float64 leaf for autograd)."""
    return F.cross_entropy(logits, labels, label_smoothing=smoothing, reduction="none", ignore_index=padding_idx)


def float64_reference(logits, labels, smoothing, padding_idx, grad_losses):
    x = logits.detach().cpu().double().requires_grad_()
    losses = torch_losses(x, labels.cpu(), smoothing, padding_idx)
    (grad,) = torch.autograd.grad(losses, x, grad_losses.detach().cpu().double())
    return losses.detach(), grad


def assert_close(actual, reference, dtype):
    eps = torch.finfo(dtype).eps
    scale = reference.abs().max().item() if reference.numel() else 1.0
    torch.testing.assert_close(actual.detach().cpu().double(), reference, rtol=2 * eps + 2e-5, atol=2e-5 * scale)


@pytest.fixture(autouse=True)
def _op_off_cuda(monkeypatch):
    """Off CUDA the loss is torch's F.cross_entropy by default; these tests run the op's reference there
    (test_off_cuda_the_loss_is_torchs checks the default)."""
    monkeypatch.setattr(softmax_xentropy_module, "_TORCH_OFF_CUDA", False)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("off_cuda", ["torch", "op"])
def test_non_finite_logits_in_padding_rows_count_for_nothing(monkeypatch, bad, off_cuda):
    monkeypatch.setattr(softmax_xentropy_module, "_TORCH_OFF_CUDA", off_cuda == "torch")
    logits, labels = random_case(6, 50, torch.float32, "cpu", padding_idx=0)
    labels[1] = 0
    logits[1, 7] = bad
    leaf = logits.clone().requires_grad_()
    losses = SoftmaxCrossEntropyLoss.apply(leaf, labels, 0.1, 0, False)
    losses.sum().backward()
    pad = labels == 0
    assert torch.isfinite(losses).all() and torch.all(losses[pad] == 0)
    assert torch.all(leaf.grad[pad] == 0) and torch.isfinite(leaf.grad).all()
    clean = logits.clone()
    clean[pad] = 0.0
    want = SoftmaxCrossEntropyLoss.apply(clean, labels, 0.1, 0, False)
    torch.testing.assert_close(losses, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("padding_idx", [0, None, -100])
def test_off_cuda_the_loss_is_torchs(monkeypatch, dtype, padding_idx):
    monkeypatch.setattr(softmax_xentropy_module, "_TORCH_OFF_CUDA", True)
    # rows 0, 3, 6, 9 of class 0: padding for padding_idx 0, ordinary rows for None; -100 pads them (a
    # label outside [0, vocab) that is padding)
    logits, labels = random_case(10, 3001, dtype, "cpu", padding_idx=0 if padding_idx is None else padding_idx)
    for half_to_float in (False, True):
        leaf = logits.clone().requires_grad_()
        losses = SoftmaxCrossEntropyLoss.apply(leaf, labels, 0.1, padding_idx, half_to_float)
        assert graph_reaches(losses.grad_fn, "NllLoss", depth=6)
        assert not graph_reaches(losses.grad_fn, "SoftmaxCrossEntropy", depth=6)
        assert losses.dtype == (torch.float32 if half_to_float else dtype) and losses.shape == (10,)
        ignore = -100 if padding_idx is None else padding_idx
        want = F.cross_entropy(logits.float(), labels, label_smoothing=0.1, ignore_index=ignore, reduction="none")
        torch.testing.assert_close(losses, want.to(losses.dtype), rtol=0, atol=0)
        grad_losses = torch.randn(10).to(losses.dtype)
        losses.backward(grad_losses)
        assert leaf.grad.dtype == dtype
        ref_losses, ref_grad = float64_reference(logits, labels, 0.1, ignore, grad_losses)
        assert_close(losses, ref_losses, losses.dtype)
        assert_close(leaf.grad, ref_grad, dtype)
        assert torch.all(losses.detach()[::3] == 0) == (padding_idx is not None)
    # non-contiguous logits, as the op's path takes them
    leaf = logits.t().contiguous().requires_grad_()
    losses = SoftmaxCrossEntropyLoss.apply(leaf.t(), labels, 0.1, padding_idx, True)
    torch.testing.assert_close(losses, SoftmaxCrossEntropyLoss.apply(logits, labels, 0.1, padding_idx, True))
    # the op's checks and errors
    labels[3] = 3001
    with pytest.raises(ValueError, match=r"^softmax_cross_entropy_forward: labels\[3\] = 3001 is out of range"):
        SoftmaxCrossEntropyLoss.apply(logits, labels, 0.1, padding_idx)
    with pytest.raises(TypeError, match=r"^softmax_cross_entropy_forward: logits has dtype torch.float64"):
        SoftmaxCrossEntropyLoss.apply(logits.double(), labels, 0.1, padding_idx)
    with pytest.raises(ValueError, match=r"^softmax_cross_entropy_forward: smoothing must be in \[0, 1\]"):
        SoftmaxCrossEntropyLoss.apply(logits, labels.clamp(max=3000), 1.5, padding_idx)
    # inplace_backward keeps the op (torch's loss cannot write its gradient over the logits)
    head = logits.clone().requires_grad_() * 1
    losses = SoftmaxCrossEntropyLoss.apply(head, labels.clamp(max=3000), 0.1, padding_idx, True, True)
    assert graph_reaches(losses.grad_fn, "SoftmaxCrossEntropy", depth=6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("half_to_float", [False, True])
def test_apply_as_upstream(device, dtype, half_to_float):
    logits, labels = random_case(10, 3001, dtype, device)
    leaf = logits.clone().requires_grad_()
    losses = SoftmaxCrossEntropyLoss.apply(leaf, labels, 0.1, 0, half_to_float)
    assert losses.dtype == (torch.float32 if half_to_float else dtype) and losses.shape == (10,)
    grad_losses = torch.randn(10, device=device).to(losses.dtype)
    losses.backward(grad_losses)
    ref_losses, ref_grad = float64_reference(logits, labels, 0.1, 0, grad_losses)
    assert_close(losses, ref_losses, losses.dtype)
    assert_close(leaf.grad, ref_grad, dtype)
    assert torch.all(losses.detach()[labels == 0] == 0)


def test_defaults_are_upstreams(device):
    # smoothing 0.0, padding_idx 0 (rows of class 0 are ignored), half_to_float False
    logits, labels = random_case(6, 40, torch.float32, device)
    losses = SoftmaxCrossEntropyLoss.apply(logits, labels)
    ref_losses, _ = float64_reference(logits, labels, 0.0, 0, torch.zeros(6))
    assert_close(losses, ref_losses, torch.float32)
    assert torch.all(losses[labels == 0] == 0) and torch.all(losses[labels != 0] > 0)


def test_padding_idx_none_ignores_no_row(device):
    logits, labels = random_case(6, 40, torch.float32, device)
    losses = SoftmaxCrossEntropyLoss.apply(logits, labels, 0.0, None)
    ref_losses = torch_losses(logits.double().cpu(), labels.cpu(), 0.0, -100)
    assert_close(losses, ref_losses, torch.float32)
    assert torch.all(losses > 0)


def test_non_contiguous_logits_are_copied(device):
    logits, labels = random_case(5, 64, torch.float32, device)
    transposed = logits.t().contiguous().t().requires_grad_()  # same values, column-major
    losses = SoftmaxCrossEntropyLoss.apply(transposed, labels, 0.1, 0, False, True)
    losses.sum().backward()
    _, ref_grad = float64_reference(logits, labels, 0.1, 0, torch.ones(5))
    assert_close(transposed.grad, ref_grad, torch.float32)
    assert torch.equal(transposed.detach(), logits)  # the copy was overwritten, not the caller's tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward(device, dtype):
    logits, labels = random_case(8, 2100, dtype, device)
    weight = torch.randn(8, 1, device=device, dtype=dtype, requires_grad=True)
    results = []
    for inplace in (False, True):
        head = logits * weight  # a non-leaf, as the LM head's output
        losses = SoftmaxCrossEntropyLoss.apply(head, labels, 0.1, 0, True, inplace)
        (grad_head,) = torch.autograd.grad(losses.sum(), head, retain_graph=False)
        results.append((head.detach().clone(), grad_head, grad_head.data_ptr() == head.data_ptr()))
    (head_kept, grad_kept, aliased_kept), (head_destroyed, grad_inplace, aliased) = results
    assert not aliased_kept and aliased
    assert torch.equal(grad_inplace, grad_kept)
    assert torch.equal(head_destroyed, grad_kept)  # the logits buffer now holds the gradient
    assert torch.equal(head_kept, logits * weight.detach())


def test_inplace_backward_through_a_layer(device):
    hidden = torch.randn(6, 16, device=device)
    weight = torch.randn(16, 300, device=device, requires_grad=True)
    labels = torch.randint(0, 300, (6,), device=device)
    grads = []
    for inplace in (False, True):
        losses = SoftmaxCrossEntropyLoss.apply(hidden @ weight, labels, 0.1, None, False, inplace)
        (grad,) = torch.autograd.grad(losses.sum(), weight)
        grads.append(grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    x = (hidden.double() @ weight.detach().double()).requires_grad_()
    (grad_x,) = torch.autograd.grad(torch_losses(x, labels, 0.1, -100).sum(), x)
    torch.testing.assert_close(grads[1].double(), hidden.double().t() @ grad_x, rtol=1e-5, atol=1e-5)


def test_inplace_backward_refuses_a_leaf_and_a_second_backward(device):
    logits, labels = random_case(4, 50, torch.float32, device)
    leaf = logits.clone().requires_grad_()
    with pytest.raises(ValueError, match=r"^SoftmaxCrossEntropyLoss: inplace_backward writes the gradient into logits"):
        SoftmaxCrossEntropyLoss.apply(leaf, labels, 0.0, 0, False, True)
    head = leaf * 2
    losses = SoftmaxCrossEntropyLoss.apply(head, labels, 0.0, 0, False, True)
    losses.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        losses.sum().backward()


def test_double_backward(device):
    logits, labels = random_case(5, 23, torch.float32, device, padding_idx=4)
    x = logits.clone().requires_grad_()
    v = torch.randn_like(logits)
    losses = SoftmaxCrossEntropyLoss.apply(x, labels, 0.2, 4)
    (gx,) = torch.autograd.grad(losses.sum(), x, create_graph=True)
    (ggx,) = torch.autograd.grad((gx * v).sum(), x)
    x64 = logits.double().cpu().requires_grad_()
    (gx64,) = torch.autograd.grad(torch_losses(x64, labels.cpu(), 0.2, 4).sum(), x64, create_graph=True)
    (ggx64,) = torch.autograd.grad((gx64 * v.double().cpu()).sum(), x64)
    assert_close(gx, gx64.detach(), torch.float32)
    assert_close(ggx, ggx64, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("inplace", [False, True])
def test_torch_compile_fullgraph(device, inplace):
    def loss(hidden, weight, labels):
        return SoftmaxCrossEntropyLoss.apply(hidden @ weight, labels, 0.1, 0, True, inplace).sum()

    # Inductor on the GPU; on the CPU, AOT autograd without code generation (fast, same tracing).
    compiled = torch.compile(loss, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    hidden = torch.randn(12, 32, device=device, dtype=torch.bfloat16)
    weight = torch.randn(32, 515, device=device, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 515, (12,), device=device)
    results = []
    for fn in (loss, compiled):
        value = fn(hidden, weight, labels)
        results.append((value.detach(), *torch.autograd.grad(value, weight)))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=1e-2)


def test_compiled_backward_is_the_traced_formula():
    # Dynamo traces the autograd Function's backward itself: there it is torch ops (one pass for
    # Inductor, which may reuse the dead logits' buffer), not our op. The in-place op traced there was
    # functionalized into a copy of the logits (GPT-2's step: 1.09 ms on an H100), the out-of-place op
    # held a second [tokens, vocab] tensor at the peak.
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def keep(name):
        def compiler(gm, inputs):
            graphs[name] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return gm

        return compiler

    def loss(hidden, weight, labels):
        return SoftmaxCrossEntropyLoss.apply(hidden @ weight, labels, 0.1, 7, True, True).mean()

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    hidden = torch.randn(12, 32, dtype=torch.bfloat16)
    weight = torch.randn(32, 515, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 515, (12,))
    labels[3] = 7  # a padding row
    (grad,) = torch.autograd.grad(compiled(hidden, weight, labels), weight)
    (expected,) = torch.autograd.grad(loss(hidden, weight, labels), weight)
    torch.testing.assert_close(grad, expected, rtol=2e-2, atol=1e-2)
    assert "apex_contrib_xentropy.softmax_cross_entropy_forward.default" in graphs["forward"]
    assert not any("xentropy" in t or "auto_functionalized" in t for t in graphs["backward"]), graphs["backward"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("smoothing, padding_idx", [(0.0, None), (0.1, 5), (0.2, None)])
def test_traced_backward_against_float64(device, dtype, smoothing, padding_idx):
    ops = torch.ops.apex_contrib_xentropy
    logits, labels = random_case(37, 1001, dtype, device, padding_idx=0 if padding_idx is None else padding_idx)
    _, lse = ops.softmax_cross_entropy_forward(logits, labels, smoothing, padding_idx, True)
    for grad_losses in (torch.randn(37, device=device), torch.randn(37, device=device).to(dtype)):
        got = _ops.traced_backward(grad_losses, logits, lse, labels, smoothing, padding_idx)
        assert got.dtype == logits.dtype and got.shape == logits.shape
        _, expected = float64_reference(
            logits, labels, smoothing, -100 if padding_idx is None else padding_idx, grad_losses
        )
        assert_close(got, expected, dtype)
    if padding_idx is not None:
        assert (got[labels == padding_idx] == 0).all()


# the legacy module --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_legacy_module_against_the_public_api(device, dtype):
    import xentropy_cuda

    logits, labels = random_case(9, 777, dtype, device, padding_idx=5)
    half_to_float = dtype != torch.float32
    losses, max_log_sum_exp = xentropy_cuda.forward(logits, labels, 0.1, half_to_float)
    assert losses.dtype == torch.float32 and max_log_sum_exp.dtype == torch.float32
    torch.testing.assert_close(max_log_sum_exp, torch.logsumexp(logits.float(), 1), rtol=1e-5, atol=1e-5)
    leaf = logits.clone().requires_grad_()
    api = SoftmaxCrossEntropyLoss.apply(leaf, labels, 0.1, None, half_to_float)
    torch.testing.assert_close(losses, api.detach(), rtol=0, atol=0)
    grad_loss = torch.randn(9, device=device)
    grad = xentropy_cuda.backward(grad_loss, logits, max_log_sum_exp, labels, 0.1)
    api.backward(grad_loss)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, leaf.grad, rtol=0, atol=0)
    # upstream's Python class masks padding rows itself, after the module's forward
    ref_losses, _ = float64_reference(logits, labels, 0.1, -100, grad_loss)
    assert_close(losses, ref_losses, torch.float32)


def test_legacy_module_takes_a_16_bit_max_log_sum_exp_and_0_d_grad(device):
    import xentropy_cuda

    logits, labels = random_case(1, 50, torch.bfloat16, device, padding_idx=3)
    losses, max_log_sum_exp = xentropy_cuda.forward(logits, labels, 0.0, False)
    assert losses.dtype == torch.bfloat16
    grad = xentropy_cuda.backward(torch.tensor(1.0, device=device), logits, max_log_sum_exp.bfloat16(), labels, 0.0)
    _, ref_grad = float64_reference(logits, labels, 0.0, -100, torch.ones(1))
    # a bfloat16 logsumexp is off by up to 2**-8 relative: the softmax by up to ~5%
    torch.testing.assert_close(grad.double().cpu(), ref_grad, rtol=0.1, atol=0.05 * ref_grad.abs().max().item())


def test_legacy_module_version_and_functions():
    import xentropy_cuda

    assert isinstance(xentropy_cuda.__version__, str) and xentropy_cuda.__version__
    assert callable(xentropy_cuda.forward) and callable(xentropy_cuda.backward)


# the package --------------------------------------------------------------------------------------


def test_fresh_interpreter_imports():
    code = (
        "import apex.contrib.xentropy, sys, torch; "
        "cls = apex.contrib.xentropy.SoftmaxCrossEntropyLoss; "
        f"missing = [n for n in {OPS_NAMES!r} if not hasattr(torch.ops.apex_contrib_xentropy, n)]; "
        "import xentropy_cuda; "
        "from apex.contrib.xentropy.softmax_xentropy import SoftmaxCrossEntropyLoss; "
        "print(missing); sys.exit(1 if missing or cls is not SoftmaxCrossEntropyLoss else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_plugin_provides_the_legacy_module():
    assert PLUGIN.provides == ("apex.contrib.xentropy", "xentropy_cuda")
    assert PLUGIN.kernel_library.name == "apex_contrib_xentropy"


@pytest.mark.gpu
def test_peak_memory_of_forward_and_backward_is_one_gradient():
    # No float32 copy of the logits: beyond the inputs, one bfloat16 gradient (none in place) and
    # per-row vectors.
    ops = torch.ops.apex_contrib_xentropy
    tokens, vocab = 4096, 32_000
    logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    grad_losses = torch.randn(tokens, device="cuda")
    logits_bytes = logits.numel() * logits.element_size()
    for inplace, bound in ((False, 1.1 * logits_bytes), (True, 0.1 * logits_bytes)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        losses, lse = ops.softmax_cross_entropy_forward(logits, labels, 0.1, 0, True)
        if inplace:
            ops.softmax_cross_entropy_backward_(grad_losses, logits, lse, labels, 0.1, 0)
        else:
            grad = ops.softmax_cross_entropy_backward(grad_losses, logits, lse, labels, 0.1, 0)
            del grad
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        assert peak <= bound, f"inplace={inplace}: {peak / logits_bytes:.2f}x one logits tensor"
        del losses, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_demo_trains_with_softmax_cross_entropy(device, dtype):
    # The demo's loss: the mean of this op's float32 losses over every token, class 0 included
    # (upstream's default padding_idx would drop those), matching float64 in value and gradient.
    demo = load_example("train_gpt", __file__)
    if demo is None:
        pytest.skip("not running from a source checkout")
    loss_fn, choice = demo.pick_loss()
    assert choice.name == "apex.contrib.xentropy.SoftmaxCrossEntropyLoss"
    assert apex.core.status(choice.kernels).name == "apex_contrib_xentropy"
    logits = (3 * torch.randn(2, 5, 37, dtype=torch.float64)).to(dtype=dtype, device=device).requires_grad_()
    targets = torch.randint(0, 37, (2, 5), device=device)
    targets[0] = 0
    loss = loss_fn(logits, targets)
    assert loss.dtype == torch.float32 and loss.shape == ()
    exact = logits.detach().double().cpu().requires_grad_()
    expected = F.cross_entropy(exact.flatten(0, 1), targets.cpu().flatten())
    expected.backward()
    loss.backward()
    assert_close(loss.double(), expected.detach(), dtype)
    assert_close(logits.grad.double(), exact.grad, dtype)
    native_fn, native = demo.pick_loss("native")
    assert native.name == "F.cross_entropy"
    assert_close(native_fn(logits.detach(), targets).double(), expected.detach(), dtype)
