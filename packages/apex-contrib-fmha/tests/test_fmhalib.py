"""The legacy module ``fmhalib`` (upstream's extension's fwd / bwd / bwd_nl) against the float64
per-sequence reference, with the dropout mask it encodes in the sign bits of S_dmask."""

from __future__ import annotations

import math

import fmhalib
import pytest
import torch

from . import _reference as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LENGTHS, HEADS, HEAD_DIM, MAX_S = [6, 1, 9, 0, 4], 3, 16, 11


def tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps


def assert_close_to(actual, expected, dtype):
    tol = tolerance(dtype)
    scale = max(expected.abs().max().item(), 1e-3)
    torch.testing.assert_close(actual.double().cpu(), expected.cpu(), rtol=tol, atol=tol * scale)


def reference_gradients(qkv, dout, keep, p_dropout):
    """float64 ``(dqkv, dscores)``: ``dscores [batch, heads, MAX_S, MAX_S]`` is the gradient of each
    sequence's scaled scores (zero outside its ``length x length`` block), computed on the CPU."""
    leaf = qkv.detach().cpu().double().requires_grad_()
    dscores = torch.zeros(len(LENGTHS), HEADS, MAX_S, MAX_S, dtype=torch.float64)
    outputs, score_leaves, start = [], [], 0
    for index, length in enumerate(LENGTHS):
        q, k, v = leaf[start : start + length].unbind(1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
        scores.retain_grad()
        probs = torch.softmax(scores, dim=-1) * keep[index, :, :length, :length].cpu().double() / (1 - p_dropout)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, v))
        score_leaves.append(scores)
        start += length
    torch.cat(outputs).backward(dout.double().cpu())
    for index, (length, scores) in enumerate(zip(LENGTHS, score_leaves)):
        dscores[index, :, :length, :length] = scores.grad
    return leaf.grad, dscores


def blocks(tensor):
    """The entries of ``[batch, heads, MAX_S, MAX_S]`` inside each sequence's ``length x length`` block."""
    inside = torch.zeros(tensor.shape, dtype=torch.bool)
    for index, length in enumerate(LENGTHS):
        inside[index, :, :length, :length] = True
    return tensor.cpu()[inside]


@pytest.mark.parametrize("p_dropout", [0.0, 0.4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fwd_bwd_bwd_nl_match_float64(device, dtype, p_dropout):
    qkv = ref.random_qkv(LENGTHS, HEADS, HEAD_DIM, dtype, device)
    cu_seqlens = ref.cu_seqlens_of(LENGTHS, device)
    result = fmhalib.fwd(qkv, cu_seqlens, p_dropout, MAX_S, True, False, False, None)
    assert isinstance(result, list) and len(result) == 2
    context, s_dmask = result
    assert (context.shape, context.dtype) == ((sum(LENGTHS), HEADS, HEAD_DIM), dtype)
    assert (s_dmask.shape, s_dmask.dtype, s_dmask.device) == ((5, HEADS, MAX_S, MAX_S), dtype, qkv.device)

    keep = ~torch.signbit(s_dmask).cpu()
    dropped = 1.0 - blocks(keep).double().mean().item()
    assert abs(dropped - p_dropout) < 0.05  # about 1400 entries
    assert_close_to(blocks(s_dmask.abs()), blocks(ref.probabilities(qkv.cpu(), LENGTHS, MAX_S)), dtype)
    assert_close_to(context, ref.attention(qkv.cpu(), LENGTHS, p_dropout, keep), dtype)

    dout = torch.randn(context.shape, dtype=torch.float64).to(dtype).to(device)
    expected_dqkv, expected_dscores = reference_gradients(qkv, dout, keep, p_dropout)
    dqkv, dscores = fmhalib.bwd(dout, qkv, s_dmask, cu_seqlens, p_dropout, MAX_S, False)
    assert (dqkv.shape, dqkv.dtype, dscores.shape, dscores.dtype) == (qkv.shape, dtype, s_dmask.shape, dtype)
    assert_close_to(dqkv, expected_dqkv, dtype)
    assert_close_to(blocks(dscores), blocks(expected_dscores), dtype)

    nl = fmhalib.bwd_nl(dout, qkv, s_dmask, cu_seqlens, p_dropout, MAX_S, False)
    assert len(nl) == 3
    torch.testing.assert_close(nl[0], dqkv, rtol=0, atol=0)
    assert nl[2].shape == (sum(LENGTHS), 1, 2, HEADS, HEAD_DIM)
    torch.testing.assert_close(nl[2].sum(1), dqkv[:, 1:], rtol=0, atol=0)


def test_fwd_without_training_drops_nothing(device):
    qkv = ref.random_qkv(LENGTHS, HEADS, HEAD_DIM, torch.float32, device)
    cu_seqlens = ref.cu_seqlens_of(LENGTHS, device)
    context, s_dmask = fmhalib.fwd(qkv, cu_seqlens, 0.5, MAX_S, False, True, False, None)
    assert not torch.signbit(s_dmask).any()
    assert_close_to(context, ref.attention(qkv.cpu(), LENGTHS), torch.float32)


def test_fwd_draws_from_the_generator(device):
    qkv = ref.random_qkv(LENGTHS, HEADS, HEAD_DIM, torch.float32, device)
    cu_seqlens = ref.cu_seqlens_of(LENGTHS, device)
    results = []
    for seed in (5, 5, 6):
        generator = torch.Generator(device=device).manual_seed(seed)
        results.append(fmhalib.fwd(qkv, cu_seqlens, 0.3, MAX_S, True, False, False, generator))
    assert torch.equal(results[0][1], results[1][1]) and torch.equal(results[0][0], results[1][0])
    assert not torch.equal(results[0][1], results[2][1])
    generator = torch.Generator(device=device).manual_seed(5)
    small_batch = fmhalib.fwd_nl(qkv, cu_seqlens, 0.3, MAX_S, True, True, False, generator)
    assert torch.equal(small_batch[0], results[0][0]) and torch.equal(small_batch[1], results[0][1])


def test_zero_tensors_rows(device):
    qkv = ref.random_qkv(LENGTHS, HEADS, HEAD_DIM, torch.float32, device, extra_rows=3)
    cu_seqlens = ref.cu_seqlens_of(LENGTHS, device)
    context, s_dmask = fmhalib.fwd(qkv, cu_seqlens, 0.0, MAX_S, True, False, True, None)
    assert torch.equal(context[-3:], torch.zeros_like(context[-3:]))
    dqkv, _ = fmhalib.bwd(torch.randn_like(context), qkv, s_dmask, cu_seqlens, 0.0, MAX_S, True)
    assert torch.equal(dqkv[-3:], torch.zeros_like(dqkv[-3:]))


def test_bad_input(device):
    qkv = ref.random_qkv(LENGTHS, HEADS, HEAD_DIM, torch.float32, device)
    cu_seqlens = ref.cu_seqlens_of(LENGTHS, device)
    context, s_dmask = fmhalib.fwd(qkv, cu_seqlens, 0.0, MAX_S, True, False, False, None)
    with pytest.raises(ValueError, match=r"fmhalib\.fwd: qkv has shape"):
        fmhalib.fwd(qkv[:, :2], cu_seqlens, 0.0, MAX_S, True, False, False, None)
    with pytest.raises(TypeError, match=r"fmhalib\.fwd: generator must be None or a torch\.Generator"):
        fmhalib.fwd(qkv, cu_seqlens, 0.0, MAX_S, True, False, False, 3)
    with pytest.raises(ValueError, match=r"fmhalib\.bwd: dout has shape"):
        fmhalib.bwd(context[1:], qkv, s_dmask, cu_seqlens, 0.0, MAX_S, False)
    with pytest.raises(ValueError, match=r"fmhalib\.bwd_nl: softmax \(fwd's S_dmask\) has shape"):
        fmhalib.bwd_nl(context, qkv, s_dmask[:, :, :-1], cu_seqlens, 0.0, MAX_S, False)
    with pytest.raises(ValueError, match=r"fmhalib\.bwd: a sequence has 9 tokens"):
        fmhalib.bwd(context, qkv, s_dmask, cu_seqlens, 0.0, 8, False)
