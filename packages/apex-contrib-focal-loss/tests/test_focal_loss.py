"""apex.contrib.focal_loss against a float64 expression of the sigmoid focal loss (torchvision's formula,
written here) and, where installed, torchvision itself, on the CPU and (marked gpu) on CUDA: the loss and
its gradient with ignored rows, padding classes and label smoothing, bad input, opcheck, torch.compile,
the legacy ``focal_loss_cuda`` module, and on CUDA the kernel itself (64-bit offsets, streams, a second
device, the same bits on every run)."""

from __future__ import annotations

import subprocess
import sys

import focal_loss_cuda
import pytest
import torch
import torch.nn.functional as F

from apex.contrib.focal_loss import _ops, focal_loss
from apex.contrib.focal_loss._plugin import KERNELS
from apex.core import loader

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ALPHA, GAMMA = 0.25, 2.0
# (leading shape, classes, real classes): no rows, one row of one class, odd class counts (vectors
# straddle rows, a scalar tail), classes below one vector, a 3-D batch, RetinaNet's 91 with padding
CASES = [((0,), 8, 8), ((1,), 1, 1), ((7,), 91, 91), ((33,), 5, 3), ((2, 17), 13, 11), ((300,), 96, 91), ((5,), 3, 0)]


def random_logits(shape, dtype, device, offset=0):
    """Logits in ``dtype`` (exact in float64), spread wide enough to reach both tails of the sigmoid;
    the tensor starts ``offset`` elements into its storage."""
    numel = 1
    for n in shape:
        numel *= n
    storage = (torch.randn(numel + offset, dtype=torch.float64) * 4).to(dtype=dtype, device=device)
    return storage[offset:].view(shape)


def random_targets(rows_shape, real_classes, device):
    """Classes in [0, real_classes), with some rows ignored (-2) and some background (-1)."""
    targets = torch.randint(0, max(real_classes, 1), rows_shape)
    kind = torch.rand(rows_shape)
    targets[kind < 0.2] = -2
    targets[(kind >= 0.2) & (kind < 0.35)] = -1
    return targets.to(device)


def expected_loss(x, targets, num_pos, real_classes, alpha, gamma, smoothing=0.0):
    """torchvision's sigmoid_focal_loss (reduction "sum") in float64, on the real classes of the rows
    not ignored, with the cross entropy's targets smoothed, divided by num_pos; differentiable."""
    classes = torch.arange(x.shape[-1], device=x.device)
    one_hot = (targets.unsqueeze(-1) == classes).double()
    counted = ((classes < real_classes) & (targets.unsqueeze(-1) != -2)).double()
    p = torch.sigmoid(x)
    smoothed = one_hot * (1 - smoothing / 2) + (1 - one_hot) * smoothing / 2
    ce = F.binary_cross_entropy_with_logits(x, smoothed, reduction="none")
    p_t = p * one_hot + (1 - p) * (1 - one_hot)
    alpha_t = alpha * one_hot + (1 - alpha) * (1 - one_hot)
    return (alpha_t * ce * (1 - p_t) ** gamma * counted).sum() / num_pos.double().reshape(())


def loss_and_gradient(x, targets, num_pos, real_classes, alpha=ALPHA, gamma=GAMMA, smoothing=0.0):
    x64 = x.detach().double().requires_grad_()
    loss = expected_loss(x64, targets, num_pos, real_classes, alpha, gamma, smoothing)
    (grad,) = torch.autograd.grad(loss, x64)
    return loss.detach(), grad


def assert_loss_close(actual, expected, dtype):
    # float32 math whatever the logits' dtype (they are exact in float32): only the sum's rounding
    assert actual.shape == () and actual.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    rtol = 1e-9 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(actual.cpu().double(), expected.cpu(), rtol=rtol, atol=1e-30)


def assert_gradient_close(actual, expected):
    """Two roundings to the gradient's dtype (the partial gradient, then the scaled one) after float32 math."""
    info = torch.finfo(actual.dtype)
    rtol = 2 * info.eps if actual.dtype != torch.float32 else 2e-5
    scale = expected.abs().max().item() if expected.numel() else 0.0
    atol = max(1e-6 * scale, info.smallest_normal)
    torch.testing.assert_close(actual.cpu().double(), expected.cpu(), rtol=rtol, atol=atol)


def poison_allocator(like):
    """Leave NaNs in a freed block like ``like``: the next allocation of that size likely gets it,
    so output elements the op does not write show up."""
    torch.full_like(like, float("nan"))


# values -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}x{c[1]}r{c[2]}")
def test_loss_and_gradient_match_float64(device, dtype, case, smoothing):
    rows_shape, classes, real = case
    x = random_logits((*rows_shape, classes), dtype, device).requires_grad_()
    targets = random_targets(rows_shape, real, device)
    num_pos = torch.tensor([3.5], device=device)
    poison_allocator(x)
    loss = focal_loss.focal_loss(x, targets, num_pos, real, ALPHA, GAMMA, smoothing)
    (grad,) = torch.autograd.grad(loss, x)
    expected, expected_grad = loss_and_gradient(x, targets, num_pos, real, smoothing=smoothing)
    assert_loss_close(loss.detach(), expected, dtype)
    assert grad.dtype == dtype and grad.shape == x.shape
    assert_gradient_close(grad, expected_grad)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("alpha", [0.0, 0.75, 1.0])
def test_other_alphas_and_gammas(device, alpha, gamma):
    x = random_logits((40, 21), torch.float32, device).requires_grad_()
    targets = random_targets((40,), 21, device)
    num_pos = torch.tensor([7.0], device=device)
    loss = focal_loss.focal_loss(x, targets, num_pos, 21, alpha, gamma)
    (grad,) = torch.autograd.grad(loss, x)
    expected, expected_grad = loss_and_gradient(x, targets, num_pos, 21, alpha, gamma)
    assert_loss_close(loss.detach(), expected, torch.float32)
    assert_gradient_close(grad, expected_grad)


def test_extreme_logits_stay_finite_and_accurate(device):
    # |x| up to 80: exp(-|x|) underflows, p rounds to 0 or 1; the loss of confident wrong answers is
    # large but finite, that of confident right ones tiny but not lost to cancellation
    x = torch.tensor([[-80.0, 80.0, -30.0, 30.0, 0.0, -1e-3]], device=device).repeat(6, 1)
    targets = torch.tensor([0, 1, 2, 3, 4, -1], device=device)
    num_pos = torch.ones(1, device=device)
    x.requires_grad_()
    loss = focal_loss.focal_loss(x, targets, num_pos, 6, ALPHA, GAMMA)
    (grad,) = torch.autograd.grad(loss, x)
    expected, expected_grad = loss_and_gradient(x, targets, num_pos, 6)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert_loss_close(loss.detach(), expected, torch.float32)
    assert_gradient_close(grad, expected_grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_logits_take_the_scalar_path(device, dtype):
    x = random_logits((50, 16), dtype, device, offset=1)  # one element into its storage
    targets = random_targets((50,), 16, device)
    num_pos = torch.tensor([10.0], device=device)
    loss, partial = _ops.focal_loss_forward(x, targets, num_pos, 16, ALPHA, GAMMA)
    expected, expected_grad = loss_and_gradient(x, targets, num_pos, 16)
    assert_loss_close(loss, expected, dtype)
    assert_gradient_close(_ops.focal_loss_backward(torch.tensor(1.0, device=device), partial, num_pos), expected_grad)


def test_gradient_of_num_positives_sum(device):
    x = random_logits((20, 9), torch.float32, device)
    targets = random_targets((20,), 9, device)
    num_pos = torch.tensor([4.0], device=device, requires_grad=True)
    loss = focal_loss.focal_loss(x, targets, num_pos, 9, ALPHA, GAMMA)
    (grad,) = torch.autograd.grad(loss * 3, num_pos)
    assert grad.shape == (1,) and grad.dtype == torch.float32
    torch.testing.assert_close(grad, -3 * loss.detach().reshape(1) / 4.0, rtol=1e-6, atol=0)


def test_ignored_rows_and_padding_classes_get_zero_gradient(device):
    x = (random_logits((10, 12), torch.float16, device) / 4).requires_grad_()  # no gradient underflows
    targets = torch.tensor([3, -2, 0, -1, -2, 8, 8, -2, 1, 2], device=device)
    loss = focal_loss.focal_loss(x, targets, torch.tensor([5.0], device=device), 9, ALPHA, GAMMA)
    (grad,) = torch.autograd.grad(loss, x)
    assert torch.equal(grad[targets == -2], torch.zeros_like(grad[targets == -2]))
    assert torch.equal(grad[:, 9:], torch.zeros_like(grad[:, 9:]))
    assert (grad[targets != -2][:, :9] != 0).all()  # every counted element has a gradient


def test_non_finite_logits_of_ignored_rows_and_padding_classes_count_for_nothing(device):
    # they are not read (the kernel) or masked exactly (the reference), never multiplied by 0
    x = random_logits((6, 10), torch.float32, device)
    targets = torch.tensor([1, -2, 3, -2, -1, 8], device=device)
    finite = x.clone()
    finite[targets == -2] = 0
    finite[:, 9:] = 0
    x[1] = float("nan")
    x[3, :4] = float("inf")
    x[3, 4:] = -float("inf")
    x[:, 9] = float("nan")
    num_pos = torch.tensor([2.0], device=device)
    loss, partial = _ops.focal_loss_forward(x, targets, num_pos, 9, ALPHA, GAMMA)
    expected, expected_grad = loss_and_gradient(finite, targets, num_pos, 9)
    assert torch.isfinite(loss) and torch.isfinite(partial).all()
    assert_loss_close(loss, expected, torch.float32)
    assert_gradient_close(partial / num_pos, expected_grad)
    assert torch.equal(partial[targets == -2], torch.zeros_like(partial[targets == -2]))
    assert torch.equal(partial[:, 9:], torch.zeros_like(partial[:, 9:]))


def test_a_second_derivative_raises(device):
    x = random_logits((4, 6), torch.float32, device).requires_grad_()
    targets = random_targets((4,), 6, device)
    loss = focal_loss.focal_loss(x, targets, torch.ones(1, device=device), 6, ALPHA, GAMMA)
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(grad.sum(), x)
    loss = focal_loss.focal_loss(x, targets, torch.ones(1, device=device), 6, ALPHA, GAMMA)
    seed = torch.ones((), device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="focal_loss: a second derivative is not supported"):
        torch.autograd.grad(loss, x, seed, create_graph=True)


def test_backward_twice_through_one_graph(device):
    # upstream scaled the saved partial gradient in place, so a second backward scaled it twice
    x = random_logits((8, 10), torch.float32, device).requires_grad_()
    targets = random_targets((8,), 10, device)
    loss = focal_loss.focal_loss(x, targets, torch.tensor([2.0], device=device), 10, ALPHA, GAMMA)
    (first,) = torch.autograd.grad(loss, x, retain_graph=True)
    (second,) = torch.autograd.grad(loss, x)
    assert torch.equal(first, second)


def test_torchvision_sigmoid_focal_loss(device):
    # upstream's test: one-hot targets, reduction "sum", a normaliser of one
    ops = pytest.importorskip("torchvision.ops")
    for dtype in (torch.float32, torch.float16):
        x = random_logits((64, 24), dtype, device) / 2
        classes = torch.randint(0, 24, (64,), device=device)
        x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        ours = focal_loss.FocalLoss.apply(x_ours, classes, torch.ones([], device=device), 24, ALPHA, GAMMA, 0.0)
        theirs = ops.sigmoid_focal_loss(
            x_theirs, F.one_hot(classes, 24).to(dtype), alpha=ALPHA, gamma=GAMMA, reduction="sum"
        )
        ours.backward()
        theirs.backward()
        # torchvision computes in the logits' dtype: float16 differs by its rounding
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(ours, theirs.float(), rtol=tolerance, atol=tolerance)
        scale = x_theirs.grad.abs().max().item()
        torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=tolerance, atol=tolerance * scale)


# bad input --------------------------------------------------------------------------------------


def good_arguments(device):
    return [
        torch.zeros(4, 6, device=device),
        torch.zeros(4, dtype=torch.int64, device=device),
        torch.ones(1, device=device),
        6,
        ALPHA,
        GAMMA,
        0.0,
    ]


BAD_FORWARD = {  # case: (argument index, replacement on a device, error, message)
    "float64 num_pos": (2, lambda d: torch.ones(1, dtype=torch.float64, device=d), TypeError,
                        r"num_positives_sum has dtype torch\.float64; expected float32"),
    "int logits": (0, lambda d: torch.zeros(4, 6, dtype=torch.int32, device=d), TypeError,
                   r"cls_output has dtype torch\.int32; expected one of float32, float16, bfloat16, float64"),
    "0-d logits": (0, lambda d: torch.zeros((), device=d), ValueError,
                   r"cls_output must have a class dimension \(at least 1-D\), got shape \(\)"),
    "non-contiguous logits": (0, lambda d: torch.zeros(6, 4, device=d).t(), ValueError, "cls_output is not contiguous"),
    "int32 targets": (1, lambda d: torch.zeros(4, dtype=torch.int32, device=d), TypeError,
                      r"cls_targets_at_level has dtype torch\.int32; expected int64"),
    "targets of another shape": (1, lambda d: torch.zeros(5, dtype=torch.int64, device=d), ValueError,
                                 r"cls_targets_at_level must have cls_output's shape without the class dimension, "
                                 r"\(4,\), got \(5,\)"),
    "non-contiguous targets": (1, lambda d: torch.zeros(8, dtype=torch.int64, device=d)[::2], ValueError,
                               "cls_targets_at_level is not contiguous"),
    "two-element num_pos": (2, lambda d: torch.ones(2, device=d), ValueError,
                            r"num_positives_sum must have exactly one element, got shape \(2,\)"),
    "too many real classes": (3, lambda d: 7, ValueError,
                              r"num_real_classes must be in \[0, 6\] \(cls_output's last dimension\), got 7"),
    "negative real classes": (3, lambda d: -1, ValueError, r"num_real_classes must be in \[0, 6\]"),
    "infinite alpha": (4, lambda d: float("inf"), ValueError, "alpha must be finite, got inf"),
    "nan gamma": (5, lambda d: float("nan"), ValueError, "gamma must be finite, got nan"),
    "infinite smoothing": (6, lambda d: float("-inf"), ValueError, "label_smoothing must be finite, got -inf"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_FORWARD))
def test_bad_forward_input_raises_naming_the_argument(device, case):
    index, make, error, message = BAD_FORWARD[case]
    args = good_arguments(device)
    _ops.focal_loss_forward(*args)  # the good arguments pass
    args[index] = make(device)
    with pytest.raises(error, match="^focal_loss_forward: " + message):
        _ops.focal_loss_forward(*args)


BAD_BACKWARD = {  # case: (argument index, replacement on a device, error, message)
    "int partial_grad": (1, lambda d: torch.zeros(4, 6, dtype=torch.int32, device=d), TypeError,
                         r"partial_grad has dtype torch\.int32; expected one of float32, float16, bfloat16, float64"),
    "non-contiguous partial_grad": (1, lambda d: torch.zeros(6, 4, device=d).t(), ValueError,
                                    "partial_grad is not contiguous"),
    "float16 grad_output": (0, lambda d: torch.ones((), dtype=torch.float16, device=d), TypeError,
                            r"grad_output has dtype torch\.float16; expected float32"),
    "two-element grad_output": (0, lambda d: torch.ones(2, device=d), ValueError,
                                r"grad_output must have exactly one element, got shape \(2,\)"),
    "empty num_pos": (2, lambda d: torch.ones(0, device=d), ValueError,
                      r"num_positives_sum must have exactly one element, got shape \(0,\)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_BACKWARD))
def test_bad_backward_input_raises_naming_the_argument(device, case):
    index, make, error, message = BAD_BACKWARD[case]
    args = [torch.ones((), device=device), torch.zeros(4, 6, device=device), torch.ones(1, device=device)]
    _ops.focal_loss_backward(*args)
    args[index] = make(device)
    with pytest.raises(error, match="^focal_loss_backward: " + message):
        _ops.focal_loss_backward(*args)
    with pytest.raises(error, match="^focal_loss_backward_: " + message):
        _ops.focal_loss_backward_(args[1], args[0], args[2])


@pytest.mark.gpu
def test_tensors_on_another_device_raise_naming_the_argument():
    args = good_arguments("cuda")
    args[2] = torch.ones(1)
    with pytest.raises(ValueError, match=r"^focal_loss_forward: num_positives_sum is on cpu, expected cuda:0"):
        _ops.focal_loss_forward(*args)
    args = good_arguments("cuda")
    args[1] = args[1].cpu()
    with pytest.raises(ValueError, match=r"^focal_loss_forward: cls_targets_at_level is on cpu, expected cuda:0"):
        _ops.focal_loss_forward(*args)
    with pytest.raises(ValueError, match=r"^focal_loss_backward: grad_output is on cpu, expected cuda:0"):
        _ops.focal_loss_backward(torch.ones(()), torch.zeros(4, 6, device="cuda"), torch.ones(1, device="cuda"))


# opcheck and torch.compile ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
def test_opcheck(device, dtype):
    x = random_logits((37, 13), dtype, device)
    targets = random_targets((37,), 11, device)
    num_pos = torch.tensor([5.0], device=device)
    torch.library.opcheck(_ops.focal_loss_forward, (x, targets, num_pos, 11, ALPHA, GAMMA, 0.1))
    grad_output = torch.tensor(0.5, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=device)
    torch.library.opcheck(_ops.focal_loss_backward, (grad_output, x, num_pos))
    torch.library.opcheck(_ops.focal_loss_backward_, (x.clone(), grad_output, num_pos))


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    def loss(x, w, targets, num_pos):
        return focal_loss.focal_loss(x * w, targets, num_pos, 17, ALPHA, GAMMA, 0.05) * 2

    torch._dynamo.reset()
    # Inductor on the GPU; on the CPU, AOT autograd without code generation (fast, same tracing).
    compiled = torch.compile(loss, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    x = random_logits((30, 19), torch.float32, device)
    w = torch.rand(30, 19, device=device).requires_grad_()
    targets = random_targets((30,), 17, device)
    num_pos = torch.tensor([6.0], device=device)
    results = []
    for fn in (loss, compiled):
        value = fn(x, w, targets, num_pos)
        results.append((value.detach(), *torch.autograd.grad(value, w)))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


# the legacy module --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_legacy_module_matches_the_public_function(device, dtype):
    x = random_logits((40, 24), dtype, device)
    targets = random_targets((40,), 20, device)
    num_pos = torch.tensor([6.0], device=device)
    loss, partial_grad = focal_loss_cuda.forward(x, targets, num_pos, 20, ALPHA, GAMMA, 0.1)
    x_grad = x.clone().requires_grad_()
    expected = focal_loss.focal_loss(x_grad, targets, num_pos, 20, ALPHA, GAMMA, 0.1)
    (expected_grad,) = torch.autograd.grad(expected * 3, x_grad)
    assert torch.equal(loss, expected.detach())
    grad_output = torch.tensor(3.0, device=device)
    scaled = focal_loss_cuda.backward(grad_output, partial_grad, num_pos)
    assert scaled is partial_grad  # in place, as upstream
    assert torch.equal(scaled, expected_grad)


def test_upstream_import_paths_in_a_fresh_interpreter():
    code = (
        "import sys, torch; from apex.contrib.focal_loss import focal_loss; import focal_loss_cuda; "
        "ok = callable(focal_loss.focal_loss) and callable(focal_loss.FocalLoss.apply); "
        "ok = ok and callable(focal_loss_cuda.forward) and callable(focal_loss_cuda.backward); "
        "names = ['focal_loss_forward', 'focal_loss_backward', 'focal_loss_backward_']; "
        "ok = ok and all(hasattr(torch.ops.apex_contrib_focal_loss, n) for n in names); "
        "sys.exit(0 if ok else 1)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_plugin_provides_the_legacy_module():
    from apex.contrib.focal_loss._plugin import PLUGIN

    assert PLUGIN.provides == ("apex.contrib.focal_loss", "focal_loss_cuda")


# CUDA only ----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_kernel_is_loaded():
    status = loader.load(KERNELS)
    assert status.has_kernels, f"{KERNELS.name}: tier {status.tier} ({status.reason})"


@pytest.mark.gpu
def test_the_same_bits_on_every_run():
    x = random_logits((5000, 91), torch.float16, "cuda")
    targets = random_targets((5000,), 91, "cuda")
    num_pos = torch.tensor([100.0], device="cuda")
    first = _ops.focal_loss_forward(x, targets, num_pos, 91, ALPHA, GAMMA)
    for _ in range(3):
        again = _ops.focal_loss_forward(x, targets, num_pos, 91, ALPHA, GAMMA)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@pytest.mark.gpu
@pytest.mark.slow
def test_more_than_2_pow_31_elements():
    # every row but the first and last thousand is ignored, so the float64 expectation stays small
    classes = 91
    rows = (1 << 31) // classes + 1000
    x = torch.randn(rows, classes, dtype=torch.float16, device="cuda")
    targets = torch.full((rows,), -2, dtype=torch.int64, device="cuda")
    ends = (slice(0, 1000), slice(rows - 1000, rows))
    for part in ends:
        targets[part] = torch.randint(-1, classes, (1000,), device="cuda")
    num_pos = torch.tensor([50.0], device="cuda")
    loss, partial_grad = _ops.focal_loss_forward(x, targets, num_pos, classes, ALPHA, GAMMA)
    expected = sum(loss_and_gradient(x[part], targets[part], num_pos, classes)[0] for part in ends)
    assert_loss_close(loss, expected, torch.float16)
    grad = _ops.focal_loss_backward(torch.ones((), device="cuda"), partial_grad, num_pos)
    assert_gradient_close(grad[ends[1]], loss_and_gradient(x[ends[1]], targets[ends[1]], num_pos, classes)[1])
    assert not grad[1000 : rows - 1000].any()


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    # work on another stream than the caller's would race with the side stream's writes to x
    source = random_logits((1 << 16, 91), torch.float16, "cuda")
    targets = random_targets((1 << 16,), 91, "cuda")
    num_pos = torch.tensor([1000.0], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = source * 1.0
        loss, _ = _ops.focal_loss_forward(x, targets, num_pos, 91, ALPHA, GAMMA)
    torch.cuda.current_stream().wait_stream(side)
    assert_loss_close(loss, loss_and_gradient(source, targets, num_pos, 91)[0], torch.float16)


@pytest.mark.multigpu
def test_second_gpu():
    # cuda:0 is current; the tensors live on cuda:1
    x = random_logits((500, 91), torch.bfloat16, "cuda:1").requires_grad_()
    targets = random_targets((500,), 91, "cuda:1")
    num_pos = torch.tensor([30.0], device="cuda:1")
    loss = focal_loss.focal_loss(x, targets, num_pos, 91, ALPHA, GAMMA)
    (grad,) = torch.autograd.grad(loss, x)
    assert loss.device == x.device and grad.device == x.device
    expected, expected_grad = loss_and_gradient(x, targets, num_pos, 91)
    assert_loss_close(loss.detach(), expected, torch.bfloat16)
    assert_gradient_close(grad, expected_grad)
