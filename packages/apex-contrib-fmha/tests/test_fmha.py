"""FMHAFun and FMHA against a float64 per-sequence reference, on the CPU and (marked gpu) on CUDA:
values, the qkv gradient, every path, dropout, zero_tensors, bad input, torch.compile."""

from __future__ import annotations

import types

import pytest
import torch

from apex.contrib.fmha import FMHA, FMHAFun, _attention

from . import _reference as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (lengths, heads, head_dim, max_s): unequal lengths with 1, a single token, an empty sequence, odd
# head_dims, BERT's head_dim 64; max_s above every length and equal to the longest.
CASES = [
    ([5, 1, 9, 3], 2, 8, 12),
    ([1], 1, 1, 1),
    ([7, 0, 4], 3, 5, 7),
    ([33, 17, 2], 4, 64, 40),
]
CASE_IDS = ["unequal", "single-token", "empty-sequence", "bert-head-dim"]


def tolerance(dtype, device="cpu", gradient=False):
    """Relative tolerance. The CPU path computes in float32 and rounds once: a few units in the
    last place. The CUDA kernels (flash, memory-efficient) round the probabilities, and in the
    backward the score gradients, to 16 bits before the next matmul, and sum over many keys in
    tiles: twice that for the output, four times for the gradient."""
    if dtype == torch.float32:
        return 1e-5 if torch.device(device).type == "cpu" else 1e-4
    factor = 1 if torch.device(device).type == "cpu" else (4 if gradient else 2)
    return 4 * factor * torch.finfo(dtype).eps


def assert_close_to(actual, expected, dtype, gradient=False):
    tol = tolerance(dtype, actual.device, gradient)
    scale = max(expected.abs().max().item(), 1e-3)
    torch.testing.assert_close(actual.double().cpu(), expected.cpu(), rtol=tol, atol=tol * scale)


def check_against_reference(device, dtype, case, path=None):
    lengths, heads, head_dim, max_s = case
    qkv = ref.random_qkv(lengths, heads, head_dim, dtype, device).requires_grad_()
    cu_seqlens = ref.cu_seqlens_of(lengths, device)
    out = _attention.attention(qkv, cu_seqlens, 0.0, max_s, True, False, name="test", path=path)
    assert (out.shape, out.dtype, out.device) == ((sum(lengths), heads, head_dim), dtype, qkv.device)
    dout = torch.randn(out.shape, dtype=torch.float64).to(dtype).to(device)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)

    leaf = qkv.detach().double().requires_grad_()
    expected = ref.attention(leaf, lengths)
    (expected_dqkv,) = torch.autograd.grad(expected, leaf, dout.double())
    assert_close_to(out.detach(), expected.detach(), dtype)
    assert dqkv.dtype == dtype
    assert_close_to(dqkv, expected_dqkv, dtype, gradient=True)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fmhafun_matches_float64(device, dtype, case):
    check_against_reference(device, dtype, case)


@pytest.mark.parametrize("path", ["padded", "dense", "nested"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_path_matches_float64(device, dtype, path):
    # The dense and nested paths run on the CPU too (SDPA), so all three are checked here.
    check_against_reference(device, dtype, CASES[0], path)
    check_against_reference(device, dtype, CASES[3], path)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_varlen_path_matches_float64(dtype):
    if _attention._varlen_attn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    assert _attention.plan(torch.empty(1, 3, 2, 64, dtype=dtype, device="cuda"), 0.1, False) == "varlen"
    check_against_reference("cuda", dtype, CASES[0], "varlen")
    check_against_reference("cuda", dtype, CASES[3], "varlen")


def test_strided_qkv(device):
    # Another layout viewed as [total, 3, heads, head_dim]: no dimension is contiguous.
    lengths = [4, 7]
    storage = torch.randn(8, 2, 3, 11, dtype=torch.float64).to(torch.float16).to(device)
    qkv = storage.permute(3, 2, 1, 0)  # [11, 3, 2, 8]
    out = FMHAFun.apply(qkv, ref.cu_seqlens_of(lengths, device), 0.0, 7, False, False)
    assert_close_to(out, ref.attention(qkv.cpu(), lengths), torch.float16)


def test_plan():
    cpu = torch.empty(4, 3, 2, 64, dtype=torch.float16)
    assert _attention.plan(cpu, 0.1, True) == "dense"
    assert _attention.plan(cpu.to("meta"), 0.0, False) == "dense"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_path_matches_float64(dtype):
    # Dropout with flash-eligible input takes the flash path; forced here without dropout so the
    # float64 reference applies: unequal lengths, an empty sequence, BERT's head_dim.
    assert _attention.plan(torch.empty(1, 3, 2, 64, dtype=dtype, device="cuda"), 0.1, True) == "flash"
    for case in [([5, 1, 9, 3], 2, 8, 12), ([7, 0, 4], 3, 16, 7), CASES[3]]:
        check_against_reference("cuda", dtype, case, "flash")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_dropout_backward_replays_the_forward_mask(dtype):
    # For one dropout mask the output is linear in v: out = A v, so <out, dout> = <v, A^T dout> =
    # <v, dv>. A backward that drew another mask A' would give <A' v, dout> instead: the two differ by
    # a sum of 8192 terms each about sqrt(p / (1 - p) / length) = 0.35 of a term of <out, dout> (p =
    # 0.5, 8 keys), i.e. by about 0.35 of the terms' root-sum-square; 16-bit rounding of out and dv
    # moves the sums by about eps of it (bfloat16 on an H100: 0.065 against a root-sum-square near
    # 40). Allowed: 4 eps of it.
    lengths = [8, 5, 0, 8, 3, 8]
    qkv = ref.random_qkv(lengths, 4, 64, dtype, "cuda").requires_grad_()
    cu_seqlens = ref.cu_seqlens_of(lengths, "cuda")
    out = FMHAFun.apply(qkv, cu_seqlens, 0.5, 8, True, False)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    terms = out.double() * dout.double()
    forward, scale = terms.sum().item(), terms.square().sum().sqrt().item()
    backward = (qkv[:, 2].double() * dqkv[:, 2].double()).sum().item()
    assert abs(forward - backward) <= 4 * torch.finfo(dtype).eps * scale
    assert dqkv[:, :2].abs().sum() > 0  # the query and key gradients are there too


def test_cu_seqlens_is_read_once_per_tensor(monkeypatch):
    # The layers of a step share one cu_seqlens: only the first call reads it (a device-to-host
    # copy); a write into it, or other arguments it must agree with, make the next call read again.
    reads = []
    read = _attention._read_offsets
    monkeypatch.setattr(_attention, "_read_offsets", lambda t: reads.append(1) or read(t))
    lengths = [3, 5]
    qkv = ref.random_qkv(lengths, 2, 8, torch.float32, "cpu", extra_rows=1)
    cu_seqlens = ref.cu_seqlens_of(lengths)
    first = FMHAFun.apply(qkv, cu_seqlens, 0.0, 5, False, True)
    assert torch.equal(FMHAFun.apply(qkv, cu_seqlens, 0.0, 5, False, True), first)
    assert len(reads) == 1
    FMHAFun.apply(qkv, cu_seqlens, 0.0, 6, False, True)  # another max_s
    assert len(reads) == 2
    cu_seqlens[2] = 9  # lengths 3 and 6, all 9 rows: valid, and read again
    FMHAFun.apply(qkv, cu_seqlens, 0.0, 6, False, True)
    assert len(reads) == 3
    cu_seqlens[1] = 10  # a negative length: the in-place write is seen, and the error raised
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        FMHAFun.apply(qkv, cu_seqlens, 0.0, 6, False, True)
    other = ref.cu_seqlens_of(lengths)
    FMHAFun.apply(qkv, other, 0.0, 5, False, True)
    with pytest.raises(ValueError, match="ends at 8 but qkv has 9 tokens"):
        FMHAFun.apply(qkv, other, 0.0, 5, False, False)  # zero_tensors is part of what was checked


def test_float64_gradcheck():
    lengths = [3, 1, 4]
    qkv = ref.random_qkv(lengths, 2, 3, torch.float64, "cpu").requires_grad_()
    cu_seqlens = ref.cu_seqlens_of(lengths)
    assert torch.autograd.gradcheck(lambda x: FMHAFun.apply(x, cu_seqlens, 0.0, 5, True, False), (qkv,))


def test_gradient_with_dropout_is_the_gradient_of_that_output():
    # Reseeding makes the dropped function deterministic; gradcheck then checks its backward.
    lengths = [4, 2]
    qkv = ref.random_qkv(lengths, 2, 3, torch.float64, "cpu").requires_grad_()
    cu_seqlens = ref.cu_seqlens_of(lengths)

    def dropped(x):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            return FMHAFun.apply(x, cu_seqlens, 0.4, 4, True, False)

    assert not torch.equal(dropped(qkv), FMHAFun.apply(qkv, cu_seqlens, 0.0, 4, True, False))
    assert torch.autograd.gradcheck(dropped, (qkv,))


def dropout_inputs(device, dtype=torch.float32):
    lengths = [6, 1, 3]
    return ref.random_qkv(lengths, 2, 8, dtype, device), ref.cu_seqlens_of(lengths, device), lengths


def test_dropout_off_when_not_training_is_exact(device):
    qkv, cu_seqlens, _ = dropout_inputs(device)
    plain = FMHAFun.apply(qkv, cu_seqlens, 0.0, 6, True, False)
    assert torch.equal(FMHAFun.apply(qkv, cu_seqlens, 0.5, 6, False, False), plain)


def test_dropout_is_seeded(device):
    qkv, cu_seqlens, _ = dropout_inputs(device)
    outputs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        outputs.append(FMHAFun.apply(qkv, cu_seqlens, 0.3, 6, True, False))
    assert torch.equal(outputs[0], outputs[1])
    assert not torch.equal(outputs[0], outputs[2])
    assert not torch.equal(outputs[0], FMHAFun.apply(qkv, cu_seqlens, 0.0, 6, True, False))


def test_dropout_mean_over_runs_is_the_undropped_output(device):
    # Each run's output is an unbiased estimate (kept probabilities scaled by 1 / (1 - p)); the
    # per-element standard deviation of one run is below 1 here, so of the mean below 0.04.
    qkv, cu_seqlens, lengths = dropout_inputs(device)
    runs = 1000
    total = sum(FMHAFun.apply(qkv, cu_seqlens, 0.3, 6, True, False).double() for _ in range(runs))
    expected = ref.attention(qkv, lengths)
    torch.testing.assert_close(total.cpu() / runs, expected.cpu(), rtol=0, atol=0.15)


def uniform_attention_runs(device, dtype, runs):
    """``[runs, 128, heads 4, 8]`` outputs of two sequences of 64 tokens with zero queries (uniform
    probabilities 1/64) and every value row 1, dropout 0.3: an output element is
    ``sum_j keep_j / (64 (1 - p))``, the same for the 8 features of a (token, head)."""
    lengths = [64, 64]
    qkv = ref.random_qkv(lengths, 4, 8, dtype, device)
    qkv[:, 0] = 0.0
    qkv[:, 2] = 1.0
    cu_seqlens = ref.cu_seqlens_of(lengths, device)
    return torch.stack([FMHAFun.apply(qkv, cu_seqlens, 0.3, 64, True, False) for _ in range(runs)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dropout_keeps_the_expectation(device, dtype):
    # An element is 1 in expectation, standard deviation sqrt(p / (1 - p) / 64) = 0.08; the mean of
    # the 16384 (run, token, head) values (independent masks: checked below) is within 0.003 of 1
    # (4.7 sigma). float16 on CUDA takes the flash path (rounding moves a value by at most 5e-4).
    runs = uniform_attention_runs(device, dtype, 32)
    assert abs(runs.double().mean().item() - 1.0) < 0.003
    assert runs.double().std().item() > 0.05  # dropout happened: without it every element is 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_masks_are_independent_across_heads_and_sequences(device, dtype):
    # Two (token, head) values are equal when their kept counts are, which for independent masks
    # (Binomial(64, 0.7) counts, sd 3.7) happens with probability sum_k P(k)^2 = 0.08; a kernel that
    # reuses one mask for every head or every sequence of a call makes them all equal. Over 1024
    # pairs each fraction is 0.08 +- 0.01, far below the bound 0.5. In 16 bits distinct counts stay
    # distinct: they differ by 1 / 44.8 = 0.022, and rounding moves each by at most 0.004 (bfloat16).
    runs = uniform_attention_runs(device, dtype, 8)[..., 0].double()  # [runs, token, head]
    assert runs.std().item() > 0.05
    assert (runs[:, :, 0] == runs[:, :, 1]).double().mean().item() < 0.5  # heads 0 and 1
    assert (runs[:, :64] == runs[:, 64:]).double().mean().item() < 0.5  # sequence 0 and 1, token by token


def test_zero_tensors_zeroes_the_rows_past_cu_seqlens(device):
    lengths = [3, 5]
    qkv = ref.random_qkv(lengths, 2, 8, torch.float32, device, extra_rows=4).requires_grad_()
    cu_seqlens = ref.cu_seqlens_of(lengths, device)
    out = FMHAFun.apply(qkv, cu_seqlens, 0.0, 5, True, True)
    assert out.shape == (12, 2, 8)
    assert torch.equal(out[8:], torch.zeros_like(out[8:]))
    assert_close_to(out[:8].detach(), ref.attention(qkv[:8].detach(), lengths), torch.float32)
    out.sum().backward()
    assert torch.equal(qkv.grad[8:], torch.zeros_like(qkv.grad[8:]))
    with pytest.raises(ValueError, match="cu_seqlens ends at 8 but qkv has 12 tokens"):
        FMHAFun.apply(qkv, cu_seqlens, 0.0, 5, True, False)


class Config(types.SimpleNamespace):
    pass


def bert_config(hidden=32, heads=4, dropout=0.0):
    return Config(hidden_size=hidden, num_attention_heads=heads, attention_probs_dropout_prob=dropout)


@pytest.mark.parametrize("dtype", DTYPES)
def test_module_matches_float64(device, dtype):
    lengths = [5, 2, 8]
    module = FMHA(bert_config())
    qkv = ref.random_qkv(lengths, 4, 8, dtype, device).reshape(15, 96).requires_grad_()
    cu_seqlens = ref.cu_seqlens_of(lengths, device)
    out = module(qkv, cu_seqlens, 8)
    assert (out.shape, out.dtype) == ((15, 32), dtype)
    expected = ref.attention(qkv.detach().view(15, 3, 4, 8), lengths).reshape(15, 32)
    assert_close_to(out.detach(), expected, dtype)
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape


def test_module_dropout_follows_is_training(device):
    lengths = [5, 2, 8]
    module = FMHA(bert_config(dropout=0.5))
    qkv = ref.random_qkv(lengths, 4, 8, torch.float32, device).reshape(15, 96)
    cu_seqlens = ref.cu_seqlens_of(lengths, device)
    plain = FMHA(bert_config())(qkv, cu_seqlens, 8)
    assert torch.equal(module(qkv, cu_seqlens, 8, is_training=False), plain)
    assert not torch.equal(module(qkv, cu_seqlens, 8), plain)


def compile_and_compare(module, qkv, cu_seqlens, max_s, backend, fullgraph):
    compiled = torch.compile(module, backend=backend, fullgraph=fullgraph)
    leaf = qkv.clone().requires_grad_()
    out = compiled(leaf, cu_seqlens, max_s, is_training=False)
    out.square().sum().backward()
    eager_leaf = qkv.clone().requires_grad_()
    expected = module(eager_leaf, cu_seqlens, max_s, is_training=False)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(leaf.grad, eager_leaf.grad, rtol=1e-5, atol=1e-5)


def test_torch_compile_of_the_module_cpu():
    torch._dynamo.reset()
    lengths = [5, 1, 7]
    qkv = ref.random_qkv(lengths, 4, 8, torch.float32, "cpu").reshape(13, 96)
    compile_and_compare(FMHA(bert_config(dropout=0.2)), qkv, ref.cu_seqlens_of(lengths), 8, "aot_eager", True)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "eager_path"), [(torch.float16, "varlen"), (torch.float32, "nested")])
def test_torch_compile_of_the_module_cuda(dtype, eager_path):
    # Inductor, one graph. The varlen path is a custom op; in eager mode float32 takes the nested
    # path, which torch.compile cannot carry through a backward (nested tensors across the graph
    # break SDPA makes), so while compiling plan() gives the padded path.
    torch._dynamo.reset()
    lengths = [64, 1, 100]
    module = FMHA(Config(hidden_size=1024, num_attention_heads=16, attention_probs_dropout_prob=0.1))
    qkv = ref.random_qkv(lengths, 16, 64, dtype, "cuda").reshape(165, 3072)
    if eager_path == "varlen" and _attention._varlen_attn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    assert _attention.plan(qkv.view(165, 3, 16, 64), 0.1, False) == eager_path
    compiled = torch.compile(module, fullgraph=True)
    leaf = qkv.clone().requires_grad_()
    out = compiled(leaf, ref.cu_seqlens_of(lengths, "cuda"), 128, is_training=False)
    dout = torch.randn_like(out)
    out.backward(dout)
    expected_leaf = qkv.double().requires_grad_()
    expected = ref.attention(expected_leaf.view(165, 3, 16, 64), lengths).reshape(165, 1024)
    expected.backward(dout.double())
    assert_close_to(out.detach(), expected.detach(), dtype)
    assert_close_to(leaf.grad, expected_leaf.grad, dtype, gradient=True)


def on(device):
    return lambda *tensors: [t.to(device) for t in tensors]


I32 = torch.int32
BAD_INPUT = {  # case: (qkv, cu_seqlens, p_dropout, max_s, error, message)
    "qkv 3-d": (torch.zeros(4, 3, 8), [0, 4], 0.0, 4, ValueError, r"qkv has shape \(4, 3, 8\)"),
    "qkv not 3 parts": (torch.zeros(4, 2, 2, 8), [0, 4], 0.0, 4, ValueError, "qkv has shape"),
    "qkv int": (torch.zeros(4, 3, 2, 8, dtype=I32), [0, 4], 0.0, 4, TypeError, "qkv has dtype torch.int32"),
    "cu_seqlens int64": (torch.zeros(4, 3, 2, 8), [0, 4], 0.0, 4, TypeError, "cu_seqlens has dtype torch.int64"),
    "cu_seqlens no batch": (torch.zeros(4, 3, 2, 8), [4], 0.0, 4, ValueError, "cu_seqlens has shape"),
    "cu_seqlens not at 0": (torch.zeros(4, 3, 2, 8), [1, 4], 0.0, 4, ValueError, "cu_seqlens must start at 0"),
    "cu_seqlens decreasing": (torch.zeros(4, 3, 2, 8), [0, 3, 2, 4], 0.0, 4, ValueError, "non-decreasing"),
    "cu_seqlens short": (torch.zeros(4, 3, 2, 8), [0, 3], 0.0, 4, ValueError, "cu_seqlens ends at 3"),
    "cu_seqlens long": (torch.zeros(4, 3, 2, 8), [0, 5], 0.0, 5, ValueError, "cu_seqlens ends at 5"),
    "sequence over max_s": (torch.zeros(4, 3, 2, 8), [0, 1, 4], 0.0, 2, ValueError, "3 tokens .* max_s=2"),
    "max_s zero": (torch.zeros(4, 3, 2, 8), [0, 4], 0.0, 0, ValueError, "max_s must be a positive int"),
    "max_s float": (torch.zeros(4, 3, 2, 8), [0, 4], 0.0, 4.0, ValueError, "max_s must be a positive int"),
    "p_dropout one": (torch.zeros(4, 3, 2, 8), [0, 4], 1.0, 4, ValueError, r"p_dropout must be in \[0, 1\)"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_raises_naming_the_argument(device, case):
    qkv, offsets, p_dropout, max_s, error, message = BAD_INPUT[case]
    dtype = torch.int64 if case == "cu_seqlens int64" else I32
    cu_seqlens = torch.tensor(offsets, dtype=dtype, device=device)
    with pytest.raises(error, match=message):
        FMHAFun.apply(qkv.to(device), cu_seqlens, p_dropout, max_s, True, False)


@pytest.mark.gpu
def test_cu_seqlens_on_another_device():
    with pytest.raises(ValueError, match="cu_seqlens is on cpu, qkv on cuda"):
        FMHAFun.apply(torch.zeros(4, 3, 2, 8, device="cuda"), torch.tensor([0, 4], dtype=I32), 0.0, 4, True, False)


def test_module_bad_config_and_input():
    with pytest.raises(ValueError, match=r"config\.hidden_size \(30\) must be a positive multiple"):
        FMHA(bert_config(hidden=30, heads=4))
    with pytest.raises(ValueError, match="attention_probs_dropout_prob must be in"):
        FMHA(bert_config(dropout=1.0))
    with pytest.raises(ValueError, match="FMHA: qkv has shape \\(4, 64\\)"):
        FMHA(bert_config())(torch.zeros(4, 64), torch.tensor([0, 4], dtype=I32), 4)
