"""The deprecated FusedAdam's ops (``adam``, ``adam_undo``, ``maybe_cast``, ``strided_check_finite``) on
every device, on what ``test_legacy.py`` leaves out: many-chunk tensors at odd alignments, every parameter
dtype (fp64 included), every copy dtype, the reversible signal of a non-finite gradient in a later chunk,
all cast pairs. On CUDA they run this package's kernels (``csrc/legacy_adam.cu``)."""

from __future__ import annotations

import math

import pytest
import torch

from apex.contrib.optimizers import _ops

from ._reference import OFFSETS, ContribAdam, bits, shard
from .test_legacy import BAD

OPS = torch.ops.apex_contrib_optimizers
SIZES = [0, 1, 7, 33, 140001]  # the kernels' chunks are 65536 elements
F64, F32, F16, BF16, U8 = torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.uint8
HYPER = dict(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, decay=0.01)


def adam_lists(device, param, grad, copy, offsets, sizes=SIZES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    state = F64 if param == F64 else F32
    lists = {"p": [], "p_copy": [], "m": [], "v": [], "g": []}
    for n in sizes:
        values = {
            "p": torch.randn(n, generator=gen, dtype=F64),
            "m": torch.randn(n, generator=gen, dtype=F64) * 0.1,
            "v": torch.rand(n, generator=gen, dtype=F64) * 0.1,
            "g": torch.randn(n, generator=gen, dtype=F64) * 64,
        }
        dtypes = {"p": param, "m": state, "v": state, "g": grad}
        for k, name in enumerate(("p", "m", "v", "g")):
            lists[name].append(shard(values[name].to(device), offsets[k], dtypes[name]))
        if copy is not None:
            fill = torch.full((n,), 0 if copy == U8 else math.nan, dtype=F64)
            lists["p_copy"].append(shard(fill.to(device), offsets[4], copy))
    return lists


def call_adam(lists, eps_mode, step=3, grad_scale=64.0, reversible=False):
    OPS.adam(lists["p"], lists["p_copy"], lists["m"], lists["v"], lists["g"], HYPER["lr"], HYPER["beta1"],
             HYPER["beta2"], HYPER["eps"], grad_scale, step, eps_mode, True, HYPER["decay"], reversible)  # fmt: skip


def reference_after(lists, eps_mode, step=3, grad_scale=64.0):
    """float64 (p, m, v) per tensor after one step from the current state (ContribAdam at step ``step``)."""
    ref = ContribAdam(lists["p"], HYPER["lr"], (HYPER["beta1"], HYPER["beta2"]), HYPER["eps"], HYPER["decay"],
                      eps_mode == 0)  # fmt: skip
    ref.m = [t.double().clone() for t in lists["m"]]
    ref.v = [t.double().clone() for t in lists["v"]]
    ref.t = step - 1
    ref.step(lists["g"], divisor=grad_scale)
    return list(zip(ref.p, ref.m, ref.v))


def tol(dtype):
    if dtype == F64:
        return dict(rtol=1e-12, atol=1e-14)
    if dtype == F32:
        return dict(rtol=1e-5, atol=1e-6)
    return dict(rtol=torch.finfo(dtype).eps, atol=1e-5)


def decoded(copy):
    return _ops.from_e5m2(copy).double() if copy.dtype == U8 else copy.double()


COPY_TOL = {F32: dict(rtol=1e-5, atol=1e-6), F16: dict(rtol=2**-10, atol=1e-6), BF16: dict(rtol=2**-7, atol=1e-6),
            U8: dict(rtol=2**-2, atol=2**-16)}  # fmt: skip


@pytest.mark.parametrize("offsets", ["aligned", "mixed"])
@pytest.mark.parametrize("eps_mode", [0, 1])
@pytest.mark.parametrize(
    "param,grad,copy",
    [(F32, F32, None), (F32, F16, F16), (F32, BF16, BF16), (F16, F16, F32), (BF16, BF16, None), (F64, F64, F32),
     (F64, F64, None)],
    ids=str,
)  # fmt: skip
def test_adam_matches_float64(device, param, grad, copy, eps_mode, offsets):
    lists = adam_lists(device, param, grad, copy, OFFSETS[offsets])
    expected = reference_after(lists, eps_mode)
    call_adam(lists, eps_mode)
    for i, (p, m, v) in enumerate(expected):
        state = F64 if param == F64 else F32
        torch.testing.assert_close(lists["p"][i].double().cpu(), p.cpu(), **tol(param))
        torch.testing.assert_close(lists["m"][i].double().cpu(), m.cpu(), **tol(state))
        torch.testing.assert_close(lists["v"][i].double().cpu(), v.cpu(), **tol(state))
        if copy is not None:
            torch.testing.assert_close(decoded(lists["p_copy"][i]).cpu(), p.cpu(), **COPY_TOL[copy])


@pytest.mark.parametrize("copy", [F16, U8])
def test_reversible_signal_from_a_later_chunk(device, copy):
    """A non-finite gradient far from element 0 (another chunk) still puts the infinity in p_copy[i][0];
    tensors with finite gradients are untouched by it."""
    lists = adam_lists(device, F32, F16, copy, OFFSETS["aligned"], sizes=[140001, 33])
    lists["g"][0][100_000] = math.inf
    before = [t.clone() for t in lists["p"]]
    call_adam(lists, 1, reversible=True)
    assert float(decoded(lists["p_copy"][0][:1])) == math.inf
    assert math.isfinite(float(decoded(lists["p_copy"][1][:1])))
    assert lists["p"][0][100_000] == before[0][100_000], "the non-finite element keeps its parameter"
    assert bool((lists["p"][1] != before[1]).all())


@pytest.mark.parametrize("eps_mode", [0, 1])
@pytest.mark.parametrize("param", [F32, BF16, F64], ids=str)
def test_adam_undo_inverts_adam_on_many_chunks(device, param, eps_mode):
    grad = F16 if param == F32 else param
    lists = adam_lists(device, param, grad, None, OFFSETS["mixed"], sizes=[140001, 7])
    lists["g"][0][70_000] = math.nan  # not undone: adam changed nothing there either
    before = {k: [t.clone() for t in v] for k, v in lists.items()}
    call_adam(lists, eps_mode, reversible=True)
    args = (lists["p"], lists["m"], lists["v"], lists["g"], HYPER["lr"], HYPER["beta1"], HYPER["beta2"],
            HYPER["eps"], 64.0, 3, eps_mode, True, HYPER["decay"])  # fmt: skip
    after = {k: [bits(t.clone()) for t in v] for k, v in lists.items()}
    OPS.adam_undo(torch.zeros(1, dtype=torch.int32, device=device), *args)
    for name in ("p", "m", "v"):
        for a, b in zip(lists[name], after[name]):
            assert torch.equal(bits(a), b), "a clear flag undoes nothing"
    OPS.adam_undo(torch.ones(1, dtype=torch.int32, device=device), *args)
    undo_tol = dict(rtol=1e-9, atol=1e-11) if param == F64 else dict(rtol=1e-3, atol=1e-4)
    if param == BF16:
        undo_tol = dict(rtol=2**-7, atol=1e-2)  # p went through two bf16 roundings
    for name in ("p", "m", "v"):
        for a, b in zip(lists[name], before[name]):
            torch.testing.assert_close(a.double(), b.double(), **undo_tol)


CAST = [F32, F64, F16, BF16, U8]


@pytest.mark.parametrize("dst", CAST, ids=str)
@pytest.mark.parametrize("src", CAST, ids=str)
def test_maybe_cast_every_pair(device, src, dst):
    values = torch.randn(70001, dtype=F64) * 100
    values[[3, 7]] = torch.tensor([math.inf, -math.inf], dtype=F64)
    p_in = shard((_ops.to_e5m2(values) if src == U8 else values.to(src)).to(device), 3)
    p_out = shard(torch.zeros(70001, dtype=dst, device=device), 3)
    OPS.maybe_cast(torch.ones(1, dtype=torch.int32, device=device), [p_in], [p_out])
    assert bool((p_out == 0).all()), "flag set: untouched"
    OPS.maybe_cast(torch.zeros(1, dtype=torch.int32, device=device), [p_in], [p_out])
    source = _ops.from_e5m2(p_in).double() if src == U8 else p_in.double()
    expected = _ops.to_e5m2(source) if dst == U8 else source.to(dst)
    assert torch.equal(bits(p_out), bits(expected))


@pytest.mark.parametrize("dtype", CAST, ids=str)
def test_strided_check_finite_large_and_transposed(device, dtype):
    values = torch.randn(700, 300, dtype=F64)
    x = (_ops.to_e5m2(values) if dtype == U8 else values.to(dtype)).to(device).t()  # dense, not contiguous
    flag = torch.full((1,), 5, dtype=torch.int32, device=device)
    OPS.strided_check_finite(flag, x, 3, True)
    assert int(flag) == 0
    bad = _ops.to_e5m2(torch.tensor([math.nan])) if dtype == U8 else torch.tensor([math.nan], dtype=dtype)
    x[200, 650] = bad.to(device)[0]  # flat index 200 * 700 + 650 = 140650: not a multiple of 3
    OPS.strided_check_finite(flag, x, 3, True)
    assert int(flag) == 0
    x[200, 651] = bad.to(device)[0]  # 140651 = 3 * 46883 + 2: still not sampled;
    x[200, 652] = bad.to(device)[0]  # 140652 = 3 * 46884: sampled
    OPS.strided_check_finite(flag, x, 3, False)
    assert int(flag) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(BAD))
def test_adam_bad_input_on_cuda_names_the_argument(case):
    make, overrides, error, message = BAD[case]
    kwargs = dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, grad_scale=1.0, step=1, eps_mode=1, bias_correction=True,
                  decay=0.0) | overrides  # fmt: skip
    lists = [[t.cuda() for t in ts] for ts in make()]
    with pytest.raises(error, match=r"^adam: " + message):
        _ops.adam(*lists, **kwargs)
