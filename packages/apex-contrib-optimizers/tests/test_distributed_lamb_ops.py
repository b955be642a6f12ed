"""The ops ``lamb_compute_update_term`` and ``lamb_update_weights`` (DistributedFusedLAMB's two stages) on
every device: against float64 LAMB written from the math, with per-tensor hyperparameters, shards of odd
sizes and alignments, every gradient, parameter and copy dtype; the noop flag; bad input. On CUDA they
run this package's kernels (``csrc/distributed_lamb.cu``), also compared with the PyTorch references (on
the CPU) and opchecked."""

from __future__ import annotations

import math

import pytest
import torch

from apex.contrib.optimizers import _ops

from ._reference import OFFSETS, bits, shard

OPS = torch.ops.apex_contrib_optimizers
SIZES = [0, 1, 7, 33, 4099, 140001]  # the kernels' chunks are 65536 elements: the last spans three
F32, F16, BF16, U8 = torch.float32, torch.float16, torch.bfloat16, torch.uint8


def per_tensor(values, device, dtype=F32):
    return torch.tensor(values, dtype=dtype, device=device)


def update_term_inputs(device, grad, param, offsets, sizes=SIZES, seed=0):
    """Lists g, p, m, v, u (u poisoned) and per-tensor hyperparameters that differ by tensor."""
    gen = torch.Generator().manual_seed(seed)
    lists = {"g": [], "p": [], "m": [], "v": [], "u": []}
    for n in sizes:
        values = [
            torch.randn(n, generator=gen, dtype=torch.float64) * 3,
            torch.randn(n, generator=gen, dtype=torch.float64),
            torch.randn(n, generator=gen, dtype=torch.float64) * 0.1,
            torch.rand(n, generator=gen, dtype=torch.float64) * 0.01 + 1e-4,
            torch.full((n,), math.nan, dtype=torch.float64),
        ]
        for (name, dtype), value, offset in zip(
            [("g", grad), ("p", param), ("m", F32), ("v", F32), ("u", F32)], values, offsets
        ):
            lists[name].append(shard(value.to(device), offset, dtype))
    k = len(sizes)
    hyper = dict(
        beta1=per_tensor([0.9 - 0.01 * i for i in range(k)], device),
        beta2=per_tensor([0.999 - 0.001 * i for i in range(k)], device),
        beta3=per_tensor([0.1 + 0.01 * i if i % 3 else 1.0 for i in range(k)], device),
        bias_correction=per_tensor([i % 2 for i in range(k)], device, torch.int32),
        step=torch.tensor([3], dtype=torch.int32, device=device),
        epsilon=per_tensor([1e-6 * (i + 1) for i in range(k)], device),
        decay=per_tensor([0.0 if i % 3 == 1 else 0.01 * (i + 1) for i in range(k)], device),
        global_scale=torch.tensor([16.0], device=device),
        global_grad_norm=torch.tensor([400.0], device=device),
    )
    return lists, hyper


def update_term_float64(lists, hyper, moment_mode, max_grad_norm):
    scale, norm = float(hyper["global_scale"]), float(hyper["global_grad_norm"])
    divisor = scale * max(1.0, (norm / scale + 1e-6) / max_grad_norm) if max_grad_norm > 0 else scale
    step = int(hyper["step"])
    out = []
    for i, (g, p, m, v) in enumerate(zip(lists["g"], lists["p"], lists["m"], lists["v"])):
        b1, b2, b3, eps, wd = (float(hyper[k][i]) for k in ("beta1", "beta2", "beta3", "epsilon", "decay"))
        g, p, m, v = (t.double() for t in (g, p, m, v))
        g = g / divisor
        if moment_mode == 0:
            g = g + wd * p
        m = b1 * m + b3 * g
        v = b2 * v + (1 - b2) * g * g
        bc1, bc2 = (1 - b1**step, 1 - b2**step) if int(hyper["bias_correction"][i]) else (1.0, 1.0)
        u = (m / bc1) / ((v / bc2).sqrt() + eps)
        if moment_mode == 1:
            u = u + wd * p
        out.append((m, v, u))
    return out


def close(actual, expected, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("offsets", list(OFFSETS), ids=list(OFFSETS))
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
@pytest.mark.parametrize("moment_mode", [0, 1])
@pytest.mark.parametrize("grad,param", [(F32, F32), (BF16, F32), (F16, F16), (BF16, F16)], ids=str)
def test_update_term_matches_float64(device, grad, param, moment_mode, max_grad_norm, offsets):
    lists, hyper = update_term_inputs(device, grad, param, OFFSETS[offsets])
    expected = update_term_float64(lists, hyper, moment_mode, max_grad_norm)
    p_before = [bits(t.clone()) for t in lists["p"]]
    OPS.lamb_compute_update_term(device_flag(device), **lists, **hyper, moment_mode=moment_mode,
                                 max_grad_norm=max_grad_norm)  # fmt: skip
    for i, (m, v, u) in enumerate(expected):
        close(lists["m"][i], m)
        close(lists["v"][i], v)
        close(lists["u"][i], u)
        assert torch.equal(bits(lists["p"][i]), p_before[i]), "p is read only"


def device_flag(device, value=0):
    return torch.full((1,), value, dtype=torch.int32, device=device)


def update_weights_inputs(device, param, copy, offsets, sizes=SIZES, seed=1):
    gen = torch.Generator().manual_seed(seed)
    lists = {"u": [], "p": [], "p_copy": []}
    for n in sizes:
        u = torch.randn(n, generator=gen, dtype=torch.float64)
        p = torch.randn(n, generator=gen, dtype=torch.float64)
        lists["u"].append(shard(u.to(device), offsets[0], F32))
        lists["p"].append(shard(p.to(device), offsets[1], param))
        fill = torch.full((n,), 255 if copy == U8 else math.nan, dtype=torch.float64)
        lists["p_copy"].append(shard(fill.to(device), offsets[2], copy))
    k = len(sizes)
    # per tensor: norms (one parameter norm and one update norm zero), decays (some zero), and the
    # update norms at a permutation of the tensors' places
    param_norm = per_tensor([0.0 if i == 2 else 1.0 + i for i in range(k)], device)
    update_norm = per_tensor([0.0 if i == 3 else 0.5 + 0.25 * i for i in range(k + 2)], device)
    offset = torch.tensor([(i + 2) % (k + 2) for i in range(k)], dtype=torch.int64, device=device)
    decay = per_tensor([0.0 if i % 3 == 1 else 0.01 for i in range(k)], device)
    hyper = dict(
        param_norm=param_norm, update_norm=update_norm, update_norm_offset=offset,
        learning_rate=torch.tensor([0.03], device=device), decay=decay,
        global_grad_norm=torch.tensor([1.0], device=device),
    )  # fmt: skip
    return lists, hyper


def update_weights_float64(lists, hyper, use_nvlamb):
    lr = float(hyper["learning_rate"])
    out = []
    for i, (u, p) in enumerate(zip(lists["u"], lists["p"])):
        pn = float(hyper["param_norm"][i])
        un = float(hyper["update_norm"][int(hyper["update_norm_offset"][i])])
        trusted = pn != 0 and un != 0 and (use_nvlamb or float(hyper["decay"][i]) != 0)
        ratio = lr * pn / un if trusted else lr
        out.append(p.double() - ratio * u.double())
    return out


def decoded(copy):
    return _ops.from_e5m2(copy).double() if copy.dtype == U8 else copy.double()


COPY_TOL = {
    F32: dict(rtol=1e-6, atol=1e-7),
    F16: dict(rtol=2**-10, atol=1e-7),
    BF16: dict(rtol=2**-7, atol=1e-7),
    U8: dict(rtol=2**-2, atol=2**-16),
}  # fmt: skip  (one ulp of the copy dtype: rounded from fp32)


@pytest.mark.parametrize("offsets", list(OFFSETS), ids=list(OFFSETS))
@pytest.mark.parametrize("use_nvlamb", [False, True])
@pytest.mark.parametrize("param,copy", [(F32, F32), (F32, BF16), (F32, U8), (F16, F16), (F16, F32), (F16, U8)],
                         ids=str)  # fmt: skip
def test_update_weights_matches_float64(device, param, copy, use_nvlamb, offsets):
    lists, hyper = update_weights_inputs(device, param, copy, OFFSETS[offsets])
    expected = update_weights_float64(lists, hyper, use_nvlamb)
    OPS.lamb_update_weights(device_flag(device), **lists, **hyper, use_nvlamb=use_nvlamb)
    p_tol = dict(rtol=1e-6, atol=1e-7) if param == F32 else dict(rtol=2**-10, atol=1e-7)
    for i, p in enumerate(expected):
        close(lists["p"][i], p, **p_tol)
        close(decoded(lists["p_copy"][i]), p, **COPY_TOL[copy])


@pytest.mark.parametrize("stage", ["update_term", "update_weights"])
def test_noop_flag_leaves_every_bit(device, stage):
    if stage == "update_term":
        lists, hyper = update_term_inputs(device, BF16, F32, OFFSETS["shifted"])
        run = lambda flag: OPS.lamb_compute_update_term(flag, **lists, **hyper, moment_mode=1, max_grad_norm=1.0)  # noqa: E731
    else:
        lists, hyper = update_weights_inputs(device, F32, U8, OFFSETS["shifted"])
        run = lambda flag: OPS.lamb_update_weights(flag, **lists, **hyper, use_nvlamb=True)  # noqa: E731
    before = {k: [bits(t.clone()) for t in v] for k, v in lists.items()}
    run(device_flag(device, -3))
    for name, tensors in lists.items():
        for i, t in enumerate(tensors):
            assert torch.equal(bits(t), before[name][i]), f"{name}[{i}] changed under a set noop_flag"


def test_update_term_bad_input(device):
    lists, hyper = update_term_inputs(device, F32, F32, OFFSETS["aligned"], sizes=[7, 5])
    flag = device_flag(device)
    cases = [
        (
            dict(hyper, beta1=per_tensor([0.9], device)),
            lists,
            ValueError,
            r"^lamb_compute_update_term: beta1 must be a 1-D",
        ),
        (dict(hyper, bias_correction=per_tensor([1, 1], device)), lists, ValueError, "bias_correction"),
        (dict(hyper, step=torch.tensor([2.0], device=device)), lists, TypeError, "step"),
        (hyper, dict(lists, m=[t.half() for t in lists["m"]]), TypeError, r"m\[0\] has dtype torch.float16"),
        (hyper, dict(lists, p=[t.bfloat16() for t in lists["p"]]), TypeError, r"p\[0\] has dtype torch.bfloat16"),
        (hyper, dict(lists, u=lists["u"][:1]), ValueError, "same length"),
        (hyper, dict(lists, v=[lists["v"][0], torch.rand(6, device=device)]), ValueError, r"v\[1\] has 6 elements"),
    ]
    for h, L, error, words in cases:
        with pytest.raises(error, match=words):
            OPS.lamb_compute_update_term(flag, **L, **h, moment_mode=1, max_grad_norm=0.0)
    with pytest.raises(ValueError, match="moment_mode"):
        OPS.lamb_compute_update_term(flag, **lists, **hyper, moment_mode=2, max_grad_norm=0.0)
    with pytest.raises(TypeError, match="noop_flag"):
        OPS.lamb_compute_update_term(flag.float(), **lists, **hyper, moment_mode=1, max_grad_norm=0.0)


def test_update_weights_bad_input(device):
    lists, hyper = update_weights_inputs(device, F32, F16, OFFSETS["aligned"], sizes=[7, 5])
    flag = device_flag(device)
    cases = [
        (dict(hyper, update_norm_offset=hyper["update_norm_offset"].int()), lists, ValueError, "update_norm_offset"),
        (dict(hyper, update_norm=hyper["update_norm"].double()), lists, ValueError, "update_norm must be a 1-D"),
        (dict(hyper, learning_rate=torch.ones(2, device=device)), lists, ValueError, "learning_rate"),
        (hyper, dict(lists, u=[t.half() for t in lists["u"]]), TypeError, r"^lamb_update_weights: u\[0\] has dtype"),
        (hyper, dict(lists, p_copy=[t.int() for t in lists["p_copy"]]), TypeError, r"p_copy\[0\] has dtype"),
    ]
    for h, L, error, words in cases:
        with pytest.raises(error, match=words):
            OPS.lamb_update_weights(flag, **L, **h, use_nvlamb=False)


# CUDA only ----------------------------------------------------------------------------------------


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [t.to(device) for t in value]
    return value


@pytest.mark.gpu
@pytest.mark.parametrize("grad,param", [(F32, F32), (BF16, F32), (F16, F16)], ids=str)
def test_update_term_kernel_matches_the_reference(grad, param):
    """Same fp32 arithmetic in another order of roundings: a few ulp (rtol 1e-6)."""
    lists, hyper = update_term_inputs("cpu", grad, param, OFFSETS["mixed"], sizes=[1, 33, 70001])
    cuda_lists, cuda_hyper = ({k: _to(v, "cuda") for k, v in d.items()} for d in (lists, hyper))
    OPS.lamb_compute_update_term(device_flag("cpu"), **lists, **hyper, moment_mode=0, max_grad_norm=1.0)
    OPS.lamb_compute_update_term(device_flag("cuda"), **cuda_lists, **cuda_hyper, moment_mode=0, max_grad_norm=1.0)
    for name in ("m", "v", "u"):
        for a, b in zip(lists[name], cuda_lists[name]):
            torch.testing.assert_close(b.cpu(), a, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("param,copy", [(F32, F32), (F32, BF16), (F16, U8)], ids=str)
def test_update_weights_kernel_matches_the_reference(param, copy):
    """p within an ulp of its dtype; the copy within an ulp of its own (a last-bit difference of the fp32
    value can round the other way; e5m2 codes then differ by one)."""
    lists, hyper = update_weights_inputs("cpu", param, copy, OFFSETS["shifted"], sizes=[1, 33, 70001])
    cuda_lists, cuda_hyper = ({k: _to(v, "cuda") for k, v in d.items()} for d in (lists, hyper))
    OPS.lamb_update_weights(device_flag("cpu"), **lists, **hyper, use_nvlamb=False)
    OPS.lamb_update_weights(device_flag("cuda"), **cuda_lists, **cuda_hyper, use_nvlamb=False)
    p_tol = dict(rtol=1e-6, atol=1e-7) if param == F32 else dict(rtol=2**-10, atol=1e-7)
    for a, b in zip(lists["p"], cuda_lists["p"]):
        torch.testing.assert_close(b.cpu().double(), a.double(), **p_tol)
    for a, b in zip(lists["p_copy"], cuda_lists["p_copy"]):
        if copy == U8:
            assert int((b.cpu().int() - a.int()).abs().max()) <= 1
            assert float((b.cpu() != a).float().mean()) < 0.01
        else:
            torch.testing.assert_close(b.cpu().double(), a.double(), **COPY_TOL[copy])


@pytest.mark.gpu
def test_update_norm_offset_out_of_range_gives_nan_on_cuda():
    """The kernel cannot raise without a host sync: that tensor's p and copy become NaN, the others are
    updated (the CPU reference raises an IndexError instead)."""
    lists, hyper = update_weights_inputs("cuda", F32, F32, OFFSETS["aligned"], sizes=[7, 9])
    hyper["update_norm_offset"] = torch.tensor([1, 99], dtype=torch.int64, device="cuda")
    OPS.lamb_update_weights(device_flag("cuda"), **lists, **hyper, use_nvlamb=True)
    assert bool(lists["p"][1].isnan().all()) and bool(lists["p_copy"][1].isnan().all())
    assert bool(lists["p"][0].isfinite().all())


@pytest.mark.gpu
def test_many_tensors_over_several_launches():
    sizes = torch.randint(0, 3000, (700,), generator=torch.Generator().manual_seed(7)).tolist()
    lists, hyper = update_term_inputs("cuda", BF16, F32, OFFSETS["aligned"], sizes=sizes)
    expected = update_term_float64(lists, hyper, 1, 1.0)
    OPS.lamb_compute_update_term(device_flag("cuda"), **lists, **hyper, moment_mode=1, max_grad_norm=1.0)
    for i, (m, v, u) in enumerate(expected):
        close(lists["m"][i], m)
        close(lists["v"][i], v)
        # u = adam term + decay * p (moment_mode 1) cancels where the two nearly meet: the fp32 error
        # is an ulp of the terms (up to ~10 here), not of u. One of ~1M elements was 1.3e-6 off on an H100.
        close(lists["u"][i], u, atol=1e-5)
    wlists, whyper = update_weights_inputs("cuda", F32, BF16, OFFSETS["aligned"], sizes=sizes)
    expected = update_weights_float64(wlists, whyper, False)
    OPS.lamb_update_weights(device_flag("cuda"), **wlists, **whyper, use_nvlamb=False)
    for i, p in enumerate(expected):
        close(wlists["p"][i], p, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_opcheck_on_cuda():
    lists, hyper = update_term_inputs("cuda", BF16, F32, OFFSETS["aligned"], sizes=[7, 4099])
    torch.library.opcheck(
        OPS.lamb_compute_update_term.default, (device_flag("cuda"),), {**lists, **hyper, "moment_mode": 1,
                                                                       "max_grad_norm": 1.0},
    )  # fmt: skip
    wlists, whyper = update_weights_inputs("cuda", F32, U8, OFFSETS["aligned"], sizes=[7, 4099])
    torch.library.opcheck(
        OPS.lamb_update_weights.default, (device_flag("cuda"),), {**wlists, **whyper, "use_nvlamb": False}
    )


@pytest.mark.gpu
def test_compiles_fullgraph():
    lists, hyper = update_term_inputs("cuda", BF16, F32, OFFSETS["aligned"], sizes=[33, 4099])
    eager = {k: [t.clone() for t in v] for k, v in lists.items()}

    @torch.compile(fullgraph=True)
    def stage(lists, hyper):
        OPS.lamb_compute_update_term(device_flag("cuda"), **lists, **hyper, moment_mode=1, max_grad_norm=1.0)

    stage(lists, hyper)
    OPS.lamb_compute_update_term(device_flag("cuda"), **eager, **hyper, moment_mode=1, max_grad_norm=1.0)
    for name in lists:
        for a, b in zip(lists[name], eager[name]):
            assert torch.equal(bits(a), bits(b)), name
