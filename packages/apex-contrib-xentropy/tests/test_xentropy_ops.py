"""apex_contrib_xentropy's ops against float64 PyTorch (``F.cross_entropy`` and its autograd), on the CPU
and (marked gpu) on CUDA: values and gradients for every dtype, odd, empty and multi-chunk sizes,
unaligned rows, padding rows, out-of-range labels, bad input, opcheck, and CUDA specifics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from apex.contrib.xentropy._plugin import KERNELS
from apex.core import loader

OPS = torch.ops.apex_contrib_xentropy
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (tokens, vocab): empty, one row, one column, odd, not a multiple of a vector, both kernel layouts
# (a warp a row up to 2048 columns, a block a row above), several vectors per thread.
SHAPES = [(0, 7), (1, 1), (1, 33), (5, 8), (7, 33), (3, 1000), (4, 2048), (3, 2049), (5, 5003)]
SMOOTHINGS = [0.0, 0.1]


def random_logits(tokens, vocab, dtype, device, offset=0):
    """Normal logits times 3 (a softmax far from uniform) in ``dtype``, ``offset`` elements into their storage."""
    numel = tokens * vocab
    storage = (3 * torch.randn(numel + offset, dtype=torch.float64)).to(dtype=dtype, device=device)
    return storage[offset:].view(tokens, vocab)


def random_labels(tokens, vocab, device, padding_idx=None, padded_rows=()):
    labels = torch.randint(0, vocab, (tokens,), device=device)
    for row in padded_rows:
        if row < tokens:
            labels[row] = padding_idx
    return labels


def expected(logits, labels, smoothing, padding_idx, grad_losses):
    """float64 losses and logits gradient of PyTorch's cross entropy (padding rows through
    ignore_index, which zeroes their loss and gradient)."""
    x = logits.detach().cpu().double().requires_grad_()
    y = labels.cpu()
    ignore = -(10**9) if padding_idx is None else padding_idx
    losses = F.cross_entropy(x, y, label_smoothing=smoothing, reduction="none", ignore_index=ignore)
    (grad,) = torch.autograd.grad(losses, x, grad_losses.cpu().double())
    return losses.detach(), grad


def assert_losses_close(actual, reference):
    """Within two roundings of ``actual``'s dtype, plus the float32 accumulation over a row."""
    eps = torch.finfo(actual.dtype).eps
    torch.testing.assert_close(actual.cpu().double(), reference, rtol=2 * eps + 2e-5, atol=1e-5)


def assert_grad_close(actual, reference):
    """Within two roundings of ``actual``'s dtype, and float32 error relative to the largest element."""
    eps = torch.finfo(actual.dtype).eps
    # At least 1: the gradient's terms are probabilities and (smoothed) one-hot weights, so float32
    # cancellation leaves errors of order 1e-7 even where they cancel to 0 (a vocabulary of one).
    scale = max(reference.abs().max().item(), 1.0) if reference.numel() else 1.0
    torch.testing.assert_close(actual.cpu().double(), reference, rtol=2 * eps + 2e-5, atol=2e-5 * scale)


def poison_allocator(like):
    """Leave NaNs in a freed block like ``like`` so that unwritten output elements show up."""
    torch.full_like(like, float("nan"))


def run_forward_and_backward(logits, labels, smoothing, padding_idx, half_to_float, grad_dtype=None):
    losses, lse = OPS.softmax_cross_entropy_forward(logits, labels, smoothing, padding_idx, half_to_float)
    grad_losses = torch.randn(labels.shape[0], dtype=torch.float64).to(grad_dtype or losses.dtype).to(logits.device)
    poison_allocator(logits)
    grad = OPS.softmax_cross_entropy_backward(grad_losses, logits, lse, labels, smoothing, padding_idx)
    return losses, lse, grad_losses, grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("smoothing", SMOOTHINGS)
def test_forward_and_backward_match_float64(device, dtype, shape, smoothing):
    tokens, vocab = shape
    logits = random_logits(tokens, vocab, dtype, device)
    labels = random_labels(tokens, vocab, device)
    losses, lse, grad_losses, grad = run_forward_and_backward(logits, labels, smoothing, None, False)
    assert (losses.dtype, lse.dtype, grad.dtype) == (dtype, torch.float32, dtype)
    assert (losses.shape, lse.shape, grad.shape) == ((tokens,), (tokens,), (tokens, vocab))
    ref_losses, ref_grad = expected(logits, labels, smoothing, None, grad_losses)
    assert_losses_close(losses, ref_losses)
    torch.testing.assert_close(lse.cpu().double(), torch.logsumexp(logits.cpu().double(), 1), rtol=2e-6, atol=1e-5)
    assert_grad_close(grad, ref_grad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_to_float_and_float32_grad_losses(device, dtype):
    logits = random_logits(6, 515, dtype, device)
    labels = random_labels(6, 515, device)
    losses, _, grad_losses, grad = run_forward_and_backward(logits, labels, 0.1, None, True)
    assert losses.dtype == torch.float32 and grad_losses.dtype == torch.float32 and grad.dtype == dtype
    ref_losses, ref_grad = expected(logits, labels, 0.1, None, grad_losses)
    assert_losses_close(losses, ref_losses)
    assert_grad_close(grad, ref_grad)


@pytest.mark.parametrize("padding_idx", [0, 5, -100])
@pytest.mark.parametrize("smoothing", SMOOTHINGS)
def test_padding_rows_are_zero(device, padding_idx, smoothing):
    tokens, vocab = 9, 2100  # the block-per-row kernel; rows 1, 4 and 8 are padding
    logits = random_logits(tokens, vocab, torch.bfloat16, device)
    labels = random_labels(tokens, vocab, device, padding_idx, padded_rows=(1, 4, 8))
    if padding_idx in range(vocab):  # also an ordinary row whose class is not padding_idx
        labels[2] = (padding_idx + 1) % vocab
    losses, lse, grad_losses, grad = run_forward_and_backward(logits, labels, smoothing, padding_idx, True)
    padded = (labels == padding_idx).cpu()
    assert padded.sum() == 3
    assert torch.all(losses.cpu()[padded] == 0) and torch.all(lse.cpu()[padded] == 0)
    assert torch.all(grad.cpu()[padded] == 0)
    ref_losses, ref_grad = expected(logits, labels, smoothing, padding_idx, grad_losses)
    assert_losses_close(losses, ref_losses)
    assert_grad_close(grad, ref_grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_off_16_byte_boundaries(device, dtype):
    # 1 element into the storage and an odd row length: every row starts at another misalignment.
    logits = random_logits(6, 2101, dtype, device, offset=1)
    labels = random_labels(6, 2101, device)
    labels[0], labels[1] = 0, 2100  # the first and the last column
    losses, _, grad_losses, grad = run_forward_and_backward(logits, labels, 0.1, None, False)
    ref_losses, ref_grad = expected(logits, labels, 0.1, None, grad_losses)
    assert_losses_close(losses, ref_losses)
    assert_grad_close(grad, ref_grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab, width", [(515, 520), (2101, 2109), (33, 40)])
def test_rows_at_a_stride_are_read_and_written_in_place(device, dtype, vocab, width):
    # The first `vocab` columns of a wider tensor: what Inductor's padded matmul hands on
    # (mm(a, pad(b))[:, :n]). Rows 16-byte aligned (520, 40) or each at another misalignment.
    wide = random_logits(7, width, dtype, device)
    logits = wide[:, :vocab]
    assert not logits.is_contiguous()
    labels = random_labels(7, vocab, device, padding_idx=-1, padded_rows=(2,))
    losses, lse, grad_losses, grad = run_forward_and_backward(logits, labels, 0.1, -1, False)
    assert grad.is_contiguous()
    ref_losses, ref_grad = expected(logits, labels, 0.1, -1, grad_losses)
    assert_losses_close(losses, ref_losses)
    assert_grad_close(grad, ref_grad)
    untouched = wide[:, vocab:].clone()
    assert OPS.softmax_cross_entropy_backward_(grad_losses, logits, lse, labels, 0.1, -1) is None
    assert torch.equal(logits, grad)
    assert torch.equal(wide[:, vocab:], untouched)  # the padding columns are not written


def test_masked_vocabulary_without_smoothing(device):
    # -inf logits (a masked part of the vocabulary) have probability 0; the loss stays finite.
    logits = random_logits(4, 300, torch.float32, device)
    logits[:, 200:] = float("-inf")
    labels = random_labels(4, 200, device)
    losses, _, grad_losses, grad = run_forward_and_backward(logits, labels, 0.0, None, False)
    assert torch.isfinite(losses).all() and torch.all(grad[:, 200:] == 0)
    ref_losses, ref_grad = expected(logits, labels, 0.0, None, grad_losses)
    assert_losses_close(losses, ref_losses)
    assert_grad_close(grad, ref_grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace_backward_writes_the_gradient_over_the_logits(device, dtype):
    logits = random_logits(5, 2500, dtype, device)
    labels = random_labels(5, 2500, device, padding_idx=-1, padded_rows=(3,))
    losses, lse = OPS.softmax_cross_entropy_forward(logits, labels, 0.1, -1, False)
    grad_losses = torch.randn(5, device=device).to(dtype)
    expected_grad = OPS.softmax_cross_entropy_backward(grad_losses, logits, lse, labels, 0.1, -1)
    ref_losses, ref_grad = expected(logits, labels, 0.1, -1, grad_losses)
    buffer = logits.clone()
    assert OPS.softmax_cross_entropy_backward_(grad_losses, buffer, lse, labels, 0.1, -1) is None
    assert torch.equal(buffer, expected_grad)
    assert_grad_close(buffer, ref_grad)
    assert_losses_close(losses, ref_losses)


def test_out_of_range_labels_raise_on_the_cpu():
    logits = random_logits(5, 33, torch.float32, "cpu")
    labels = random_labels(5, 33, "cpu")
    lse = torch.zeros(5)
    for bad, padding_idx, message in [
        (33, None, r"labels\[3\] = 33 is out of range \[0, 33\)$"),
        (-1, None, r"labels\[3\] = -1 is out of range \[0, 33\)$"),
        (-5, -100, r"labels\[3\] = -5 is out of range \[0, 33\) and is not padding_idx \(-100\)$"),
    ]:
        labels[3] = bad
        with pytest.raises(ValueError, match="^softmax_cross_entropy_forward: " + message):
            OPS.softmax_cross_entropy_forward(logits, labels, 0.0, padding_idx)
        with pytest.raises(ValueError, match="^softmax_cross_entropy_backward: " + message):
            OPS.softmax_cross_entropy_backward(torch.ones(5), logits, lse, labels, 0.0, padding_idx)


def valid_args(device, dtype=torch.bfloat16):
    logits = random_logits(4, 37, dtype, device)
    labels = random_labels(4, 37, device)
    return {
        "grad_losses": torch.randn(4, device=device),
        "logits": logits,
        "lse": torch.randn(4, device=device),
        "labels": labels,
        "smoothing": 0.1,
    }


FORWARD = ("logits", "labels", "smoothing")
BACKWARD = ("grad_losses", "logits", "lse", "labels", "smoothing")
BAD_INPUT = {  # case: (argument, replacement (device -> value), error, message)
    "float64 logits": (
        "logits",
        lambda d: torch.zeros(4, 37, dtype=torch.float64, device=d),
        TypeError,
        "logits has dtype torch.float64; expected one of float32, float16, bfloat16",
    ),
    "1-D logits": (
        "logits",
        lambda d: torch.zeros(37, device=d),
        ValueError,
        r"logits must be 2-D \[tokens, vocab\], got shape \(37,\)",
    ),
    "no classes": (
        "logits",
        lambda d: torch.zeros(4, 0, device=d),
        ValueError,
        r"logits must have at least one column \(class\), got shape \(4, 0\)",
    ),
    "transposed logits": (
        "logits",
        lambda d: torch.zeros(37, 4, device=d).t(),
        ValueError,
        r"logits must have contiguous rows \(unit stride along its last dimension, rows not overlapping\), "
        r"got strides \(1, 4\) for shape \(4, 37\)",
    ),
    "overlapping logits rows": (
        "logits",
        lambda d: torch.zeros(40, device=d).as_strided((4, 37), (1, 1)),
        ValueError,
        r"logits must have contiguous rows .* got strides \(1, 1\) for shape \(4, 37\)",
    ),
    "int32 labels": (
        "labels",
        lambda d: torch.zeros(4, dtype=torch.int32, device=d),
        TypeError,
        "labels has dtype torch.int32; expected torch.int64",
    ),
    "labels of another length": (
        "labels",
        lambda d: torch.zeros(5, dtype=torch.int64, device=d),
        ValueError,
        r"labels has shape \(5,\); expected \(4,\) for logits of shape \(4, 37\)",
    ),
    "2-D labels": (
        "labels",
        lambda d: torch.zeros(4, 1, dtype=torch.int64, device=d),
        ValueError,
        r"labels has shape \(4, 1\); expected \(4,\)",
    ),
    "non-contiguous labels": (
        "labels",
        lambda d: torch.zeros(8, dtype=torch.int64, device=d)[::2],
        ValueError,
        "labels is not contiguous",
    ),
    "smoothing above 1": ("smoothing", lambda d: 1.5, ValueError, r"smoothing must be in \[0, 1\], got 1.5"),
    "negative smoothing": ("smoothing", lambda d: -0.1, ValueError, r"smoothing must be in \[0, 1\], got -0.1"),
    "nan smoothing": ("smoothing", lambda d: math.nan, ValueError, r"smoothing must be in \[0, 1\], got nan"),
    "float64 grad_losses": (
        "grad_losses",
        lambda d: torch.zeros(4, dtype=torch.float64, device=d),
        TypeError,
        "grad_losses has dtype torch.float64; expected torch.float32 or torch.bfloat16",
    ),
    "float16 grad_losses": (
        "grad_losses",
        lambda d: torch.zeros(4, dtype=torch.float16, device=d),
        TypeError,
        "grad_losses has dtype torch.float16; expected torch.float32 or torch.bfloat16",
    ),
    "grad_losses of another length": (
        "grad_losses",
        lambda d: torch.zeros(3, device=d),
        ValueError,
        r"grad_losses has shape \(3,\); expected \(4,\)",
    ),
    "bfloat16 lse": (
        "lse",
        lambda d: torch.zeros(4, dtype=torch.bfloat16, device=d),
        TypeError,
        "lse has dtype torch.bfloat16; expected torch.float32",
    ),
    "lse of another length": (
        "lse",
        lambda d: torch.zeros(2, device=d),
        ValueError,
        r"lse has shape \(2,\); expected \(4,\)",
    ),
}


def call(op_name, names, args, extra=()):
    return getattr(OPS, op_name)(*(args[n] for n in names), *extra)


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_raises_naming_the_argument(device, case):
    argument, make, error, message = BAD_INPUT[case]
    targets = [("softmax_cross_entropy_backward", BACKWARD), ("softmax_cross_entropy_backward_", BACKWARD)]
    if argument in FORWARD:
        targets.insert(0, ("softmax_cross_entropy_forward", FORWARD))
    for op_name, names in targets:
        args = valid_args(device)
        args[argument] = make(device)
        with pytest.raises(error, match=f"^{op_name}: {message}"):
            call(op_name, names, args)


def test_float32_logits_take_only_float32_grad_losses(device):
    args = valid_args(device, torch.float32)
    args["grad_losses"] = args["grad_losses"].half()
    with pytest.raises(TypeError, match=r"grad_losses has dtype torch.float16; expected torch.float32$"):
        call("softmax_cross_entropy_backward", BACKWARD, args)


@pytest.mark.gpu
@pytest.mark.parametrize("argument", ["labels", "grad_losses", "lse"])
def test_tensors_on_another_device_raise(argument):
    args = valid_args("cuda")
    args[argument] = args[argument].cpu()
    with pytest.raises(ValueError, match=f"^softmax_cross_entropy_backward: {argument} is on cpu, expected cuda:0"):
        call("softmax_cross_entropy_backward", BACKWARD, args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(device, dtype):
    args = valid_args(device, dtype)
    args["labels"][1] = -100
    args["grad_losses"] = args["grad_losses"].to(dtype)
    for half_to_float in (False, True):
        torch.library.opcheck(
            OPS.softmax_cross_entropy_forward, (args["logits"], args["labels"], 0.1, -100, half_to_float)
        )
    backward_args = (args["grad_losses"], args["logits"], args["lse"].abs(), args["labels"], 0.1, -100)
    torch.library.opcheck(OPS.softmax_cross_entropy_backward, backward_args)
    torch.library.opcheck(OPS.softmax_cross_entropy_backward_, backward_args)


def test_fakes_give_the_outputs_metadata():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = torch.empty(6, 11, dtype=torch.bfloat16)
        labels = torch.empty(6, dtype=torch.int64)
        for half_to_float, losses_dtype in ((False, torch.bfloat16), (True, torch.float32)):
            losses, lse = OPS.softmax_cross_entropy_forward(logits, labels, 0.0, None, half_to_float)
            assert (losses.shape, losses.dtype, lse.shape, lse.dtype) == ((6,), losses_dtype, (6,), torch.float32)
        grad = OPS.softmax_cross_entropy_backward(torch.empty(6), logits, torch.empty(6), labels)
        assert (grad.shape, grad.dtype) == ((6, 11), torch.bfloat16)
        with pytest.raises(TypeError, match=r"labels has dtype torch.int32"):
            OPS.softmax_cross_entropy_forward(logits, labels.int())


# CUDA --------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_kernel_is_loaded():
    status = loader.load(KERNELS)
    assert status.has_kernels, f"{KERNELS.name}: tier {status.tier} ({status.reason})"


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [100, 50_000])
def test_out_of_range_labels_give_nan_rows_on_cuda(vocab):
    logits = random_logits(6, vocab, torch.bfloat16, "cuda")
    labels = random_labels(6, vocab, "cuda", padding_idx=-100, padded_rows=(5,))
    labels[1], labels[3] = vocab, -7
    losses, lse, grad_losses, grad = run_forward_and_backward(logits, labels, 0.1, -100, True)
    bad = torch.tensor([False, True, False, True, False, False])
    assert torch.isnan(losses.cpu()[bad]).all() and torch.isnan(lse.cpu()[bad]).all()
    assert torch.isnan(grad.cpu()[bad]).all()
    good = ~bad
    assert torch.isfinite(losses.cpu()[good]).all() and torch.isfinite(grad.cpu()[good]).all()
    labels_ok = labels.clone()
    labels_ok[bad.cuda()] = -100  # PyTorch's values for the other rows
    ref_losses, ref_grad = expected(logits, labels_ok, 0.1, -100, grad_losses)
    assert_losses_close(losses[good.cuda()], ref_losses[good])
    assert_grad_close(grad[good.cuda()], ref_grad[good])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [128_256, (1 << 20) + 3])
def test_long_rows_stream_on_cuda(dtype, vocab):
    logits = random_logits(3, vocab, dtype, "cuda", offset=3)
    labels = random_labels(3, vocab, "cuda")
    losses, _, grad_losses, grad = run_forward_and_backward(logits, labels, 0.1, None, False)
    ref_losses, ref_grad = expected(logits, labels, 0.1, None, grad_losses)
    assert_losses_close(losses, ref_losses)
    assert_grad_close(grad, ref_grad)


@pytest.mark.gpu
def test_many_rows_on_cuda():
    # More rows than one wave of blocks, in both kernel layouts.
    for vocab in (1000, 3000):
        logits = random_logits(20_000, vocab, torch.bfloat16, "cuda")
        labels = random_labels(20_000, vocab, "cuda", padding_idx=0, padded_rows=range(0, 20_000, 7))
        losses, _, grad_losses, grad = run_forward_and_backward(logits, labels, 0.1, 0, False)
        ref_losses, ref_grad = expected(logits, labels, 0.1, 0, grad_losses)
        assert_losses_close(losses, ref_losses)
        assert_grad_close(grad, ref_grad)


@pytest.mark.gpu
@pytest.mark.slow
def test_more_than_2_pow_31_elements():
    tokens, vocab = 16_800, 128_256  # 2.15e9 elements
    logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16)
    labels = random_labels(tokens, vocab, "cuda")
    rows = [0, 1, tokens - 2, tokens - 1]  # the last rows lie past element 2**31
    kept = logits[rows].clone()
    losses, lse = OPS.softmax_cross_entropy_forward(logits, labels, 0.1, None, True)
    grad_losses = torch.randn(tokens, device="cuda")
    OPS.softmax_cross_entropy_backward_(grad_losses, logits, lse, labels, 0.1, None)  # logits now hold the gradient
    ref_losses, ref_grad = expected(kept, labels[rows], 0.1, None, grad_losses[rows])
    assert_losses_close(losses[rows], ref_losses)
    assert_grad_close(logits[rows], ref_grad)


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    source = random_logits(4096, 4097, torch.bfloat16, "cuda")
    labels = random_labels(4096, 4097, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        logits = source * 1.0
        losses, _ = OPS.softmax_cross_entropy_forward(logits, labels, 0.0, None, True)
    torch.cuda.current_stream().wait_stream(side)
    ref_losses, _ = expected(source, labels, 0.0, None, torch.zeros(4096))
    assert_losses_close(losses, ref_losses)


@pytest.mark.multigpu
def test_second_gpu():
    logits = random_logits(7, 3001, torch.bfloat16, "cuda:1")
    labels = random_labels(7, 3001, "cuda:1")
    losses, lse, grad_losses, grad = run_forward_and_backward(logits, labels, 0.1, None, False)
    assert losses.device == grad.device == lse.device == logits.device
    ref_losses, ref_grad = expected(logits, labels, 0.1, None, grad_losses)
    assert_losses_close(losses, ref_losses)
    assert_grad_close(grad, ref_grad)
