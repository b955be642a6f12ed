"""The transducer loss (op, module, legacy module) against a float64 RNN-T recursion written here (and
torchaudio's ``rnnt_loss`` where it is installed), on the CPU and (marked gpu) on CUDA: padded and
packed, with the softmax's backward folded in or not, bad input, opcheck and torch.compile."""

from __future__ import annotations

import pytest
import torch
import transducer_loss_cuda

from apex.contrib.transducer import TransducerLoss, _ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# (B, T, U, V): U is the label length + 1; V odd (no vector path), one time step, no labels.
SHAPES = [(3, 6, 4, 8), (2, 9, 5, 33), (2, 1, 3, 16), (2, 4, 1, 8)]


def case(shape, dtype, device, blank=0, full=False):
    B, T, U, V = shape
    x = (torch.randn(B, T, U, V, dtype=torch.float64) * 2).to(dtype=dtype, device=device)
    label = torch.randint(0, V, (B, U - 1), dtype=torch.int32)
    label[label == blank] = (blank + 1) % V
    f_len = torch.randint(1, T + 1, (B,), dtype=torch.int32)
    y_len = torch.randint(0, U, (B,), dtype=torch.int32)
    f_len[0], y_len[0] = T, U - 1
    if full:
        f_len[:], y_len[:] = T, U - 1
    return x, label.to(device), f_len.to(device), y_len.to(device)


def rnnt_float64(x, label, f_len, y_len, blank):
    """-log P(y | x) per batch element, by the plain recursion over alpha, in float64."""
    lp = torch.log_softmax(x.double(), dim=-1)
    losses = []
    for b in range(x.shape[0]):
        F, Y = int(f_len[b]), int(y_len[b])
        alpha = [[None] * (Y + 1) for _ in range(F)]
        for t in range(F):
            for u in range(Y + 1):
                if t == 0 and u == 0:
                    alpha[t][u] = lp.new_zeros(())
                    continue
                terms = []
                if t > 0:
                    terms.append(alpha[t - 1][u] + lp[b, t - 1, u, blank])
                if u > 0:
                    terms.append(alpha[t][u - 1] + lp[b, t, u - 1, int(label[b, u - 1])])
                alpha[t][u] = torch.logsumexp(torch.stack(terms), 0)
        losses.append(-(alpha[F - 1][Y] + lp[b, F - 1, Y, blank]))
    return torch.stack(losses)


def expected_loss_and_grad(x, label, f_len, y_len, blank, loss_grad):
    x64 = x.detach().double().cpu().requires_grad_()
    loss = rnnt_float64(x64, label.cpu(), f_len.cpu(), y_len.cpu(), blank)
    (grad,) = torch.autograd.grad(loss, x64, loss_grad.double().cpu())
    return loss, grad


def tolerance(dtype):
    # float32 arithmetic over ~T + U log-sum-exps, then one rounding to the output's dtype
    return {"rtol": max(2 * torch.finfo(dtype).eps, 1e-5), "atol": 1e-5}


def pack(x, f_len, y_len):
    rows = [x[b, : int(f_len[b]), : int(y_len[b]) + 1].reshape(-1, x.shape[-1]) for b in range(x.shape[0])]
    offsets = torch.cumsum(f_len.long() * (y_len.long() + 1), 0)
    return torch.cat(rows).contiguous(), offsets


def unpack(grad, f_len, y_len, shape):
    full = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
    start = 0
    for b in range(shape[0]):
        F, Y = int(f_len[b]), int(y_len[b]) + 1
        full[b, :F, :Y] = grad[start : start + F * Y].view(F, Y, -1)
        start += F * Y
    return full


# values and gradients -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fuse", [True, False])
def test_loss_and_gradient(device, dtype, shape, fuse):
    blank = shape[3] - 1  # not 0, as upstream's tests also use
    x, label, f_len, y_len = case(shape, dtype, device, blank)
    x.requires_grad_()
    loss_grad = torch.rand(shape[0], dtype=torch.float64) + 0.5
    loss = TransducerLoss(fuse_softmax_backward=fuse)(x, label, f_len, y_len, blank)
    assert loss.shape == (shape[0],) and loss.dtype == dtype
    (grad,) = torch.autograd.grad(loss, x, loss_grad.to(dtype=dtype, device=device))
    want_loss, want_grad = expected_loss_and_grad(x, label, f_len, y_len, blank, loss_grad.to(dtype).double())
    torch.testing.assert_close(loss.double().cpu(), want_loss, **tolerance(dtype))
    # the gradient: exponentials of float32 sums of ~T + U terms (a few 1e-6 relative), rounded to dtype
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(grad.double().cpu(), want_grad, rtol=max(2 * eps, 2e-5), atol=max(2 * eps, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fuse", [True, False])
def test_packed_input_matches_padded(device, dtype, fuse):
    shape = (3, 7, 5, 16)
    x, label, f_len, y_len = case(shape, dtype, device)
    packed, offsets = pack(x, f_len, y_len)
    packed.requires_grad_()
    x.requires_grad_()
    padded_loss = TransducerLoss(fuse_softmax_backward=fuse)(x, label, f_len, y_len, 0)
    packed_loss = TransducerLoss(fuse_softmax_backward=fuse, packed_input=True)(
        packed, label, f_len, y_len, 0, offsets, int(f_len.max())
    )
    torch.testing.assert_close(packed_loss, padded_loss)
    (padded_grad,) = torch.autograd.grad(padded_loss.sum(), x)
    (packed_grad,) = torch.autograd.grad(packed_loss.sum(), packed)
    torch.testing.assert_close(unpack(packed_grad, f_len, y_len, shape), padded_grad)


def test_padding_gets_zero_gradient_and_alpha_beta_are_the_recursions(device):
    shape = (3, 6, 4, 8)
    x, label, f_len, y_len = case(shape, torch.float32, device)
    debug = []
    x.requires_grad_()
    loss = TransducerLoss()(x, label, f_len, y_len, 0, debug_list=debug)
    alpha, beta = debug
    assert alpha.shape == beta.shape == (3, 6, 4) and alpha.dtype == torch.float32
    (grad,) = torch.autograd.grad(loss.sum(), x)
    for b in range(3):
        F, Y = int(f_len[b]), int(y_len[b])
        assert not grad[b, F:].any() and not grad[b, :, Y + 1 :].any()
        assert not alpha[b, F:].any() and not beta[b, :, Y + 1 :].any()
        # beta(0, 0) = alpha(F-1, Y) + log p(blank) = -loss
        torch.testing.assert_close(-beta[b, 0, 0], loss[b])
        lp = torch.log_softmax(x[b].detach().double(), -1)
        torch.testing.assert_close(
            -(alpha[b, F - 1, Y].double() + lp[F - 1, Y, 0]), loss[b].double(), rtol=1e-6, atol=0
        )


def test_zero_and_negative_loss_grad(device):
    x, label, f_len, y_len = case((2, 5, 3, 8), torch.float32, device)
    x.requires_grad_()
    loss = TransducerLoss()(x, label, f_len, y_len, 0)
    (grad,) = torch.autograd.grad(loss, x, torch.tensor([0.0, -2.0], device=device))
    _, want = expected_loss_and_grad(x, label, f_len, y_len, 0, torch.tensor([0.0, -2.0]))
    torch.testing.assert_close(grad.double().cpu(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_against_torchaudio(device, dtype):
    torchaudio = pytest.importorskip("torchaudio")
    shape = (4, 20, 7, 32)
    x, label, f_len, y_len = case(shape, dtype, device, blank=0, full=False)
    x = x.float().requires_grad_()
    ours = TransducerLoss()(x, label, f_len, y_len, 0)
    theirs = torchaudio.functional.rnnt_loss(x, label, f_len, y_len, blank=0, reduction="none")
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    (g_ours,) = torch.autograd.grad(ours.sum(), x)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), x)
    # torchaudio leaves the gradient of padded rows unwritten or zero; compare the valid ones
    for b in range(shape[0]):
        F, Y = int(f_len[b]), int(y_len[b]) + 1
        torch.testing.assert_close(g_ours[b, :F, :Y], g_theirs[b, :F, :Y], rtol=1e-4, atol=1e-5)


# bad input -------------------------------------------------------------------------------------


def bad_loss_cases(device):
    x, label, f_len, y_len = case((2, 4, 3, 8), torch.float32, device)
    fwd, bwd = _ops.loss_forward, _ops.loss_backward
    alpha, beta, loss, lse = fwd(x, label, f_len, y_len, None, 4, 0, True)
    lg = torch.ones_like(loss)
    return {
        "x dtype": (
            fwd,
            (x.int(), label, f_len, y_len, None, 4, 0),
            TypeError,
            "loss_forward: x has dtype torch.int32",
        ),
        "x dims": (fwd, (x[0], label, f_len, y_len, None, 4, 0), ValueError, r"x must be 4-D \[B, T, U, V\]"),
        "x shape": (
            fwd,
            (x, label[:, :1].contiguous(), f_len, y_len, None, 4, 0),
            ValueError,
            "expected \\[B=2, max_f_len=4, U=2",
        ),
        "max_f_len": (fwd, (x, label, f_len, y_len, None, 5, 0), ValueError, "max_f_len=5"),
        "label dtype": (fwd, (x, label.long(), f_len, y_len, None, 4, 0), TypeError, "label has dtype torch.int64"),
        "y_len dtype": (fwd, (x, label, f_len, y_len.long(), None, 4, 0), TypeError, "y_len has dtype torch.int64"),
        "f_len shape": (fwd, (x, label, f_len[:1], y_len, None, 4, 0), ValueError, r"f_len has shape \(1,\)"),
        "blank_idx": (fwd, (x, label, f_len, y_len, None, 4, 8), ValueError, r"blank_idx must lie in \[0, 7\], got 8"),
        "packed x": (fwd, (x, label, f_len, y_len, f_len.long(), 4, 0), ValueError, r"x must be 2-D \[rows, V\]"),
        "x device": (fwd, (x.to("meta"), label, f_len, y_len, None, 4, 0), ValueError, "label is on"),
        "alpha dtype": (
            bwd,
            (x, lg, alpha.double(), beta, lse, label, f_len, y_len, None, 0),
            TypeError,
            "alpha has dtype torch.float64; expected torch.float32",
        ),
        "beta shape": (
            bwd,
            (x, lg, alpha, beta[:, :, :2].contiguous(), lse, label, f_len, y_len, None, 0),
            ValueError,
            r"beta has shape \(2, 4, 2\)",
        ),
        "loss_grad dtype": (
            bwd,
            (x, lg.half(), alpha, beta, lse, label, f_len, y_len, None, 0),
            TypeError,
            "loss_grad has dtype torch.float16 but x has",
        ),
        "lse without fuse": (
            bwd,
            (x, lg, alpha, beta, lse, label, f_len, y_len, None, 0, False),
            ValueError,
            "lse is only used with fuse_softmax",
        ),
        "lse shape": (
            bwd,
            (x, lg, alpha, beta, lse[:3], label, f_len, y_len, None, 0),
            ValueError,
            r"lse has shape \(3,\)",
        ),
    }


@pytest.mark.parametrize("case_name", list(bad_loss_cases("cpu")))
def test_bad_input_raises_naming_the_argument(device, case_name):
    fn, args, error, message = bad_loss_cases(device)[case_name]
    with pytest.raises(error, match=message):
        fn(*args)


def test_bad_values_raise_in_the_reference():
    x, label, f_len, y_len = case((2, 4, 3, 8), torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"f_len must lie in \[1, 4\]"):
        _ops.loss_forward(x, label, torch.tensor([0, 4], dtype=torch.int32), y_len, None, 4, 0)
    with pytest.raises(ValueError, match=r"y_len must lie in \[0, 2\]"):
        _ops.loss_forward(x, label, f_len, torch.tensor([3, 0], dtype=torch.int32), None, 4, 0)
    bad = label.clone()
    bad[0, 0] = 8
    with pytest.raises(ValueError, match=r"label must lie in \[0, 7\]"):
        _ops.loss_forward(x, bad, f_len, torch.tensor([2, 2], dtype=torch.int32), None, 4, 0)
    packed, offsets = pack(x, f_len, y_len)
    with pytest.raises(ValueError, match="batch_offset must be the running sum"):
        _ops.loss_forward(packed, label, f_len, y_len, offsets + 1, 4, 0)


def test_labels_past_y_len_are_not_read():
    x, label, f_len, y_len = case((2, 4, 3, 8), torch.float32, "cpu")
    y_len[:] = 1
    padded = label.clone()
    padded[:, 1:] = -1  # padding as many pipelines write it
    want = _ops.loss_forward(x, label, f_len, y_len, None, 4, 0, True)[2]
    torch.testing.assert_close(_ops.loss_forward(x, padded, f_len, y_len, None, 4, 0, True)[2], want)


def test_module_argument_checks():
    x, label, f_len, y_len = case((2, 4, 3, 8), torch.float32, "cpu")
    with pytest.raises(ValueError, match="packed_input needs batch_offset and max_f_len"):
        TransducerLoss(packed_input=True)(x.view(-1, 8), label, f_len, y_len, 0)
    with pytest.raises(ValueError, match="opt must be one of"):
        TransducerLoss(opt=2)


# opcheck, torch.compile --------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_opcheck(device, normalize, packed):
    shape = (2, 5, 3, 16)
    x, label, f_len, y_len = case(shape, torch.float16, device)
    offsets = None
    if packed:
        x, offsets = pack(x, f_len, y_len)
    args = (x, label, f_len, y_len, offsets, 5, 0, normalize)
    torch.library.opcheck(_ops.loss_forward, args)
    alpha, beta, loss, lse = _ops.loss_forward(*args)
    lg = torch.rand_like(loss) + 0.5
    for fuse in (True, False) if not normalize else (True,):
        torch.library.opcheck(
            _ops.loss_backward,
            (x, lg, alpha, beta, lse if normalize else None, label, f_len, y_len, offsets, 0, fuse),
        )


@pytest.mark.slow
@pytest.mark.parametrize("fuse", [True, False])
def test_torch_compile_fullgraph(device, fuse):
    torch._dynamo.reset()
    x, label, f_len, y_len = case((2, 6, 4, 16), torch.float32, device)
    w = torch.randn(16, 16, device=device, requires_grad=True)
    criterion = TransducerLoss(fuse_softmax_backward=fuse)

    def loss(w):
        return criterion(x @ w, label, f_len, y_len, 0).mean()

    compiled = torch.compile(loss, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    results = []
    for fn in (loss, compiled):
        value = fn(w)
        results.append((value.detach(), *torch.autograd.grad(value, w)))
    # Inductor generates its own matmul and log_softmax (fuse=False): float32 roundings apart.
    tol = 1e-4 if device == "cuda" else 1e-5
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


# the legacy module -------------------------------------------------------------------------------


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_legacy_module_matches_upstreams_use(device, fuse, packed):
    """The sequence upstream's TransducerLossFunc runs: log_softmax, forward, backward (and, without
    fusion, the log_softmax's backward), against the public module."""
    shape = (3, 5, 4, 16)
    x, label, f_len, y_len = case(shape, torch.float32, device)
    batch_offset = torch.empty(0, dtype=torch.int64, device=device)
    inputs = x
    if packed:
        inputs, batch_offset = pack(x, f_len, y_len)
    logits = inputs.detach().requires_grad_()
    logp = torch.log_softmax(logits, dim=-1)
    max_f_len = int(f_len.max()) if packed else shape[1]
    alpha, beta, loss = transducer_loss_cuda.forward(
        logp.detach(), label, f_len, y_len, batch_offset, max_f_len, 0, 1, packed
    )
    lg = torch.rand(shape[0], device=device) + 0.5
    x_grad = transducer_loss_cuda.backward(
        logp.detach(), lg, alpha, beta, f_len, y_len, label, batch_offset, max_f_len, 0, 1, fuse, packed
    )
    if not fuse:
        (x_grad,) = torch.autograd.grad(logp, logits, x_grad)
    module = TransducerLoss(fuse_softmax_backward=fuse, packed_input=packed)
    ref_in = inputs.detach().requires_grad_()
    ref_loss = module(ref_in, label, f_len, y_len, 0, batch_offset if packed else None, max_f_len)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_in, lg)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_grad, ref_grad, rtol=1e-5, atol=1e-6)


# CUDA specifics ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cuda_matches_the_cpu_reference(dtype):
    shape = (4, 33, 9, 40)
    x, label, f_len, y_len = case(shape, dtype, "cpu")
    for normalize in (True, False):
        ref = _ops.loss_forward(x, label, f_len, y_len, None, 33, 3, normalize)
        got = _ops.loss_forward(x.cuda(), label.cuda(), f_len.cuda(), y_len.cuda(), None, 33, 3, normalize)
        # alpha, beta and lse in float32 (float64); the loss rounded to dtype, where float32 values a
        # few ulp apart can round to neighbouring values
        out_tol = {"rtol": max(1e-5, 2 * torch.finfo(dtype).eps), "atol": 1e-5}
        for r, g in zip(ref, got):
            torch.testing.assert_close(g.cpu(), r, **(out_tol if r.dtype == dtype else {"rtol": 1e-5, "atol": 1e-5}))
        lg = torch.rand(4, dtype=dtype) + 0.5
        lse = ref[3] if normalize else None
        for fuse in (True, False) if not normalize else (True,):
            want = _ops.loss_backward(x, lg, ref[0], ref[1], lse, label, f_len, y_len, None, 3, fuse)
            have = _ops.loss_backward(
                x.cuda(),
                lg.cuda(),
                got[0],
                got[1],
                None if lse is None else got[3],
                label.cuda(),
                f_len.cuda(),
                y_len.cuda(),
                None,
                3,
                fuse,
            )
            torch.testing.assert_close(have.cpu(), want, rtol=max(1e-4, 2 * torch.finfo(dtype).eps), atol=1e-5)


@pytest.mark.gpu
def test_long_label_sequences_use_several_u_per_thread():
    shape = (2, 6, 1500, 4)  # U > 1024 threads
    x, label, f_len, y_len = case(shape, torch.float32, "cpu", full=True)
    ref = _ops.loss_forward(x, label, f_len, y_len, None, 6, 0, True)[2]
    got = _ops.loss_forward(x.cuda(), label.cuda(), f_len.cuda(), y_len.cuda(), None, 6, 0, True)[2]
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_float64_at_the_u_limit_runs_or_is_refused_clearly():
    # float64 keeps two diagonals of 8192 doubles (128 KB) in shared memory: the sweep runs where a
    # block may hold that (sm_80, sm_90) and is refused naming the label length where not (sm_86, sm_89).
    shape = (1, 2, 8192, 2)
    x, label, f_len, y_len = case(shape, torch.float64, "cpu", full=True)
    args = (None, 2, 0, True)
    on_gpu = (x.cuda(), label.cuda(), f_len.cuda(), y_len.cuda())
    if 2 * 8192 * 8 <= torch.cuda.get_device_properties(0).shared_memory_per_block_optin:
        ref = _ops.loss_forward(x, label, f_len, y_len, *args)[2]
        torch.testing.assert_close(_ops.loss_forward(*on_gpu, *args)[2].cpu(), ref, rtol=1e-10, atol=1e-9)
    else:
        with pytest.raises(ValueError, match=r"label length \+ 1 \(8192\) needs 131072 bytes of shared memory"):
            _ops.loss_forward(*on_gpu, *args)


@pytest.mark.multigpu
def test_second_gpu():
    x, label, f_len, y_len = case((2, 5, 3, 16), torch.float32, "cuda:1")
    x.requires_grad_()
    loss = TransducerLoss()(x, label, f_len, y_len, 0)
    (grad,) = torch.autograd.grad(loss.sum(), x)
    want_loss, want_grad = expected_loss_and_grad(x, label, f_len, y_len, 0, torch.ones(2))
    assert grad.device == x.device
    torch.testing.assert_close(loss.double().cpu(), want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double().cpu(), want_grad, rtol=1e-5, atol=1e-6)
