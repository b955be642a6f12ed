"""The ops ``distributed_adam`` and ``distributed_adam_with_param_remainders`` on every device: against a
float64 Adam written from the math, on shards of odd sizes, alignments and dtypes; the noop flag, the
device lr/step; bad input. On CUDA they run this package's kernels (``csrc/distributed_adam.cu``), which
are also compared with the PyTorch references (run on the CPU) and opchecked."""

from __future__ import annotations

import pytest
import torch

from apex.contrib.optimizers import _distributed_adam_ops as ops
from apex.contrib.optimizers._plugin import KERNELS
from apex.core import loader

from ._reference import OFFSETS, bits, shard

OPS = torch.ops.apex_contrib_optimizers
# empty, one, odd, not a multiple of any vector width, many 2048-element chunks
SIZES = [0, 1, 7, 33, 4099, 70001]
CHUNK = 2048
HYPER = dict(lr=1e-2, beta1=0.85, beta2=0.99, eps=1e-6, step=3, bias_correction=True, weight_decay=0.05)
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def adam_float64(p, m, v, g, *, scale, lr, beta1, beta2, eps, step, mode, bias_correction, weight_decay):
    """Upstream's distributed Adam in float64: (new p, new m, new v)."""
    p, m, v, g = (t.double() for t in (p, m, v, g))
    g = g * scale
    if mode == 0:
        g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = (1 - beta1**step, 1 - beta2**step) if bias_correction else (1.0, 1.0)
    update = (m / bc1) / ((v / bc2).sqrt() + eps)
    if mode == 1:
        update = update + weight_decay * p
    return p - lr * update, m, v


def random_state(n, device, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen, dtype=torch.float64)
    m = torch.randn(n, generator=gen, dtype=torch.float64) * 0.1
    v = torch.rand(n, generator=gen, dtype=torch.float64) * 0.01 + 1e-4
    g = torch.randn(n, generator=gen, dtype=torch.float64) * 2
    return [t.to(device) for t in (p, m, v, g)]


def adam_inputs(device, state, grad, out, offsets, sizes=SIZES, seed=0):
    offsets = [offsets[i] for i in (0, 2, 3, 4, 5)]
    lists = {"params": [], "exp_avgs": [], "exp_avg_sqs": [], "grads": [], "params_out": []}
    for k, n in enumerate(sizes):
        values = random_state(n, device, seed + k)
        for (name, dtype), value, offset in zip(
            [("params", state), ("exp_avgs", state), ("exp_avg_sqs", state), ("grads", grad)], values, offsets
        ):
            lists[name].append(shard(value, offset, dtype))
        lists["params_out"].append(shard(torch.full((n,), float("nan"), device=device), offsets[4], out))
    return lists


def remainder_inputs(device, grad, offsets, sizes=SIZES, seed=0):
    lists = {k: [] for k in ("params", "param_remainders", "exp_avgs", "exp_avg_sqs", "grads", "params_out")}
    for k, n in enumerate(sizes):
        p, m, v, g = random_state(n, device, seed + k)
        high, low = ops.fp32_to_bf16_and_remainder(p.float())
        for name, value, offset in zip(lists, [high, low, m.float(), v.float(), g.to(grad)], offsets):
            lists[name].append(shard(value, offset))
        lists["params_out"].append(shard(torch.full((n,), float("nan"), device=device), offsets[5], BF16))
    return lists


def scalars(device, scale=0.5, **overrides):
    kw = dict(
        chunk_size=CHUNK,
        noop_flag=torch.zeros(1, dtype=torch.int32, device=device),
        grad_scale=torch.tensor([scale], device=device),
        adam_mode=1,
        **HYPER,
    )
    return {**kw, **overrides}


def f64_kwargs(kw):
    keys = ("lr", "beta1", "beta2", "eps", "step", "bias_correction", "weight_decay")
    return dict(scale=float(kw["grad_scale"]), mode=kw["adam_mode"], **{k: kw[k] for k in keys})


def tolerance(dtype):
    """The kernel computes in fp32 and rounds once to ``dtype``; the float64 result is not rounded."""
    if dtype == F32:
        return dict(rtol=1e-5, atol=1e-6)
    return dict(rtol=torch.finfo(dtype).eps, atol=1e-5)


def close(actual, expected, dtype):
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), **tolerance(dtype))


ADAM_CASES = [  # (state, grad, out)
    (F32, F32, F32),
    (F32, BF16, BF16),
    (BF16, BF16, BF16),
    (F16, F16, F32),
    (BF16, F32, F16),
    (F16, BF16, BF16),
]


@pytest.mark.parametrize("offsets", list(OFFSETS), ids=list(OFFSETS))
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("case", ADAM_CASES, ids=lambda c: "-".join(str(d)[6:] for d in c))
def test_distributed_adam_matches_float64(device, case, mode, offsets):
    state, grad, out = case
    lists = adam_inputs(device, state, grad, out, OFFSETS[offsets])
    kw = scalars(device, adam_mode=mode)
    expected = [
        adam_float64(*t, **f64_kwargs(kw))
        for t in zip(lists["params"], lists["exp_avgs"], lists["exp_avg_sqs"], lists["grads"])
    ]
    OPS.distributed_adam(**lists, **kw)
    for i, (p, m, v) in enumerate(expected):
        close(lists["params"][i], p, state)
        close(lists["exp_avgs"][i], m, state)
        close(lists["exp_avg_sqs"][i], v, state)
        # the output copy is the new state-dtype value converted, every element written
        assert torch.equal(lists["params_out"][i], lists["params"][i].to(out)), f"params_out[{i}]"


@pytest.mark.parametrize("offsets", list(OFFSETS), ids=list(OFFSETS))
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("grad", [F32, BF16, F16], ids=str)
def test_param_remainders_match_float64(device, grad, mode, offsets):
    lists = remainder_inputs(device, grad, OFFSETS[offsets])
    params_in = [p.clone() for p in lists["params"]]
    masters = [ops.bf16_and_remainder_to_fp32(p, r) for p, r in zip(lists["params"], lists["param_remainders"])]
    kw = scalars(device, adam_mode=mode)
    expected = [
        adam_float64(*t, **f64_kwargs(kw))
        for t in zip(masters, lists["exp_avgs"], lists["exp_avg_sqs"], lists["grads"])
    ]
    OPS.distributed_adam_with_param_remainders(**lists, **kw)
    for i, (p, m, v) in enumerate(expected):
        master = ops.bf16_and_remainder_to_fp32(lists["params_out"][i], lists["param_remainders"][i])
        close(master, p, F32)
        close(lists["exp_avgs"][i], m, F32)
        close(lists["exp_avg_sqs"][i], v, F32)
        # the bf16 written is the fp32 master rounded to nearest (ties away from zero in magnitude)
        close(lists["params_out"][i], master, BF16)
        assert torch.equal(bits(lists["params"][i]), bits(params_in[i])), "params are read only"


def test_param_remainders_in_place(device):
    """params_out may be params itself (DistributedFusedAdam's bf16 shard is both)."""
    lists = remainder_inputs(device, BF16, OFFSETS["aligned"], sizes=[4099, 7])
    separate = {k: [t.clone() for t in v] for k, v in lists.items()}
    lists["params_out"] = lists["params"]
    kw = scalars(device)
    OPS.distributed_adam_with_param_remainders(**lists, **kw)
    OPS.distributed_adam_with_param_remainders(**separate, **kw)
    for name in ("param_remainders", "exp_avgs", "exp_avg_sqs"):
        for a, b in zip(lists[name], separate[name]):
            assert torch.equal(bits(a), bits(b)), name
    for a, b in zip(lists["params"], separate["params_out"]):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("remainders", [False, True], ids=["adam", "remainders"])
def test_noop_flag_leaves_every_bit(device, remainders):
    if remainders:
        lists = remainder_inputs(device, BF16, OFFSETS["shifted"])
        op = OPS.distributed_adam_with_param_remainders
    else:
        lists = adam_inputs(device, BF16, BF16, F32, OFFSETS["shifted"])
        op = OPS.distributed_adam
    before = {k: [bits(t.clone()) for t in v] for k, v in lists.items()}
    kw = scalars(device, noop_flag=torch.full((1,), 7, dtype=torch.int32, device=device))
    kw["lr_tensor"] = torch.tensor([1.0], device=device)
    op(**lists, **kw)
    for name, tensors in lists.items():
        for i, t in enumerate(tensors):
            assert torch.equal(bits(t), before[name][i]), f"{name}[{i}] changed under a set noop_flag"


@pytest.mark.parametrize("remainders", [False, True], ids=["adam", "remainders"])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_device_lr_and_step_win_over_the_host_values(device, remainders, bias_correction):
    make = (
        (lambda: remainder_inputs(device, F32, OFFSETS["aligned"]))
        if remainders
        else (lambda: adam_inputs(device, F32, F32, F32, OFFSETS["aligned"]))
    )
    op = OPS.distributed_adam_with_param_remainders if remainders else OPS.distributed_adam
    host, tensors = make(), make()
    op(**host, **scalars(device, lr=3e-3, step=5, bias_correction=bias_correction))
    op(
        **tensors,
        **scalars(device, lr=0.5, step=1, bias_correction=bias_correction),
        lr_tensor=torch.tensor([3e-3], device=device),
        step_tensor=torch.tensor([5.0], device=device),
    )
    for name in ("exp_avgs", "exp_avg_sqs", "params_out"):
        for a, b in zip(host[name], tensors[name]):
            torch.testing.assert_close(b.double(), a.double(), rtol=2e-6, atol=1e-7)
    # and the device values are read: another lr changes the parameters
    other = make()
    op(
        **other,
        **scalars(device, lr=3e-3, step=5, bias_correction=bias_correction),
        lr_tensor=torch.tensor([6e-3], device=device),
    )
    assert not torch.equal(other["params_out"][-1], host["params_out"][-1])


def _bad_inputs(device):
    lists = adam_inputs(device, F32, F32, F32, OFFSETS["aligned"], sizes=[7, 5])
    return lists, scalars(device)


def _with(lists, name, index, tensor):
    return {**lists, name: [tensor if i == index else t for i, t in enumerate(lists[name])]}


BAD = {
    "noop_flag_dtype": (lambda L, K, d: (L, {**K, "noop_flag": torch.zeros(1, device=d)}), TypeError, "noop_flag"),
    "state_dtypes": (
        lambda L, K, d: ({**L, "exp_avgs": [t.half() for t in L["exp_avgs"]]}, K),
        TypeError,
        r"params\[0\], exp_avgs\[0\] and exp_avg_sqs\[0\] must share the state dtype",
    ),
    "grads_dtype": (lambda L, K, d: (_with(L, "grads", 0, L["grads"][0].double()), K), TypeError, r"grads\[0\]"),
    "not_contiguous": (
        lambda L, K, d: (_with(L, "grads", 0, torch.randn(14, device=d)[::2]), K),
        ValueError,
        r"grads\[0\] is not contiguous",
    ),
    "numel": (
        lambda L, K, d: (_with(L, "exp_avg_sqs", 1, torch.rand(6, device=d)), K),
        ValueError,
        r"exp_avg_sqs\[1\] has 6 elements but params\[1\] has 5",
    ),
    "lengths": (lambda L, K, d: ({**L, "grads": L["grads"][:1]}, K), ValueError, "same length"),
    "adam_mode": (lambda L, K, d: (L, {**K, "adam_mode": 2}), ValueError, "adam_mode"),
    "step": (lambda L, K, d: (L, {**K, "step": 0}), ValueError, "step must be >= 1"),
    "grad_scale": (lambda L, K, d: (L, {**K, "grad_scale": torch.ones(2, device=d)}), ValueError, "grad_scale"),
    "chunk_size": (lambda L, K, d: (L, {**K, "chunk_size": 0}), ValueError, "chunk_size"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_naming_the_argument(device, case):
    build, error, words = BAD[case]
    lists, kw = build(*_bad_inputs(device), device)
    with pytest.raises(error, match=words):
        OPS.distributed_adam(**lists, **kw)


def test_remainders_must_be_int16_and_params_bf16(device):
    lists = remainder_inputs(device, F32, OFFSETS["aligned"], sizes=[7])
    with pytest.raises(TypeError, match="param_remainders"):
        OPS.distributed_adam_with_param_remainders(
            **{**lists, "param_remainders": [lists["param_remainders"][0].int()]}, **scalars(device)
        )
    with pytest.raises(TypeError, match="params"):
        OPS.distributed_adam_with_param_remainders(
            **{**lists, "params": [lists["params"][0].half()]}, **scalars(device)
        )


# CUDA only ----------------------------------------------------------------------------------------


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [t.to(device) for t in value]
    return value


@pytest.mark.gpu
def test_cuda_kernel_is_loaded():
    status = loader.load(KERNELS)
    assert status.has_kernels, f"{KERNELS.name}: tier {status.tier} ({status.reason})"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ADAM_CASES, ids=lambda c: "-".join(str(d)[6:] for d in c))
def test_adam_kernel_matches_the_reference(case):
    """The kernel and the PyTorch reference (on the CPU) do the same fp32 arithmetic in a different
    order of roundings: fp32 results agree within a few ulp (rtol 1e-6), 16-bit ones within one ulp of
    their dtype (a last-bit difference of the fp32 value can round the other way)."""
    lists = adam_inputs("cpu", *case, OFFSETS["shifted"], sizes=[1, 33, 70001])
    kw = scalars("cpu", adam_mode=0, step_tensor=torch.tensor([4.0]))
    cuda = {k: _to(v, "cuda") for k, v in {**lists, **kw}.items()}
    OPS.distributed_adam(**lists, **kw)
    OPS.distributed_adam(**cuda)
    tol = dict(rtol=1e-6, atol=1e-7) if case[0] == F32 else dict(rtol=torch.finfo(case[0]).eps, atol=1e-6)
    for name in ("params", "exp_avgs", "exp_avg_sqs", "params_out"):
        for a, b in zip(lists[name], cuda[name]):
            torch.testing.assert_close(b.cpu().double(), a.double(), **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [0, 1])
def test_remainder_kernel_matches_the_reference(mode):
    """The fp32 masters (bf16 + remainder) of kernel and reference agree within a few fp32 ulp, the
    moments too; the bf16/int16 split of a master is exact on both sides (tested bit for bit below)."""
    lists = remainder_inputs("cpu", BF16, OFFSETS["mixed"], sizes=[1, 33, 70001])
    kw = scalars("cpu", adam_mode=mode)
    cuda = {k: _to(v, "cuda") for k, v in {**lists, **kw}.items()}
    OPS.distributed_adam_with_param_remainders(**lists, **kw)
    OPS.distributed_adam_with_param_remainders(**cuda)
    for i in range(len(lists["params"])):
        want = ops.bf16_and_remainder_to_fp32(lists["params_out"][i], lists["param_remainders"][i])
        got = ops.bf16_and_remainder_to_fp32(cuda["params_out"][i], cuda["param_remainders"][i]).cpu()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        # atol as for the masters: exp_avg = beta1 m + (1 - beta1) g cancels where m and g differ in
        # sign, and one fp32 ulp of the terms (~1e-8 here) is then many ulp of the result (H100: 1.8e-8).
        for name in ("exp_avgs", "exp_avg_sqs"):
            torch.testing.assert_close(cuda[name][i].cpu(), lists[name][i], rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_remainder_kernel_splits_every_bit_as_the_reference():
    """With lr 0 and no decay the master does not move: the kernel's join and split of random bit
    patterns (finite fp32 values, every sign and exponent) give back exactly the bf16 and remainder bits
    the reference's do. Subnormal masters are left out: the kernels are built with --use_fast_math,
    which flushes fp32 subnormals (below 1.2e-38) to zero in arithmetic."""
    raw = torch.randint(-(2**31), 2**31 - 1, (200_003,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    normal = (raw.abs() >= torch.finfo(torch.float32).tiny) & (raw.abs() < 1e30)
    raw = raw[normal]
    high, low = ops.fp32_to_bf16_and_remainder(raw)
    n = raw.numel()
    lists = dict(
        params=[high.cuda()], param_remainders=[low.cuda()], exp_avgs=[torch.zeros(n, device="cuda")],
        exp_avg_sqs=[torch.ones(n, device="cuda")], grads=[torch.zeros(n, device="cuda")],
        params_out=[torch.empty(n, dtype=BF16, device="cuda")],
    )  # fmt: skip
    OPS.distributed_adam_with_param_remainders(**lists, **scalars("cuda", lr=0.0, weight_decay=0.0))
    assert torch.equal(bits(lists["params_out"][0]), bits(high))
    assert torch.equal(bits(lists["param_remainders"][0]), bits(low))


@pytest.mark.gpu
@pytest.mark.parametrize("remainders", [False, True], ids=["adam", "remainders"])
def test_many_tensors_over_several_launches(remainders):
    """700 shards of 0-3000 elements, chunk_size 512: more tensors and blocks than one launch holds."""
    sizes = torch.randint(0, 3000, (700,), generator=torch.Generator().manual_seed(5)).tolist()
    if remainders:
        lists = remainder_inputs("cuda", BF16, OFFSETS["aligned"], sizes=sizes)
        masters = [ops.bf16_and_remainder_to_fp32(p, r) for p, r in zip(lists["params"], lists["param_remainders"])]
        state = zip(masters, lists["exp_avgs"], lists["exp_avg_sqs"], lists["grads"])
    else:
        lists = adam_inputs("cuda", F32, BF16, BF16, OFFSETS["aligned"], sizes=sizes)
        state = zip(lists["params"], lists["exp_avgs"], lists["exp_avg_sqs"], lists["grads"])
    kw = scalars("cuda", chunk_size=512)
    expected = [adam_float64(*t, **f64_kwargs(kw)) for t in state]
    getattr(OPS, "distributed_adam_with_param_remainders" if remainders else "distributed_adam")(**lists, **kw)
    for i, (p, m, v) in enumerate(expected):
        if remainders:
            close(ops.bf16_and_remainder_to_fp32(lists["params_out"][i], lists["param_remainders"][i]), p, F32)
        else:
            close(lists["params"][i], p, F32)
            close(lists["params_out"][i], p, BF16)
        close(lists["exp_avgs"][i], m, F32)
        close(lists["exp_avg_sqs"][i], v, F32)


@pytest.mark.gpu
@pytest.mark.parametrize("remainders", [False, True], ids=["adam", "remainders"])
def test_opcheck_on_cuda(remainders):
    if remainders:
        lists, name = (
            remainder_inputs("cuda", BF16, OFFSETS["aligned"], sizes=[7, 4099]),
            "distributed_adam_with_param_remainders",
        )
    else:
        lists, name = adam_inputs("cuda", BF16, BF16, F32, OFFSETS["aligned"], sizes=[7, 4099]), "distributed_adam"
    kw = scalars("cuda", lr_tensor=torch.tensor([1e-3], device="cuda"), step_tensor=torch.tensor([2.0], device="cuda"))
    torch.library.opcheck(getattr(OPS, name).default, (), {**lists, **kw})


@pytest.mark.gpu
def test_compiles_fullgraph():
    lists = adam_inputs("cuda", BF16, BF16, BF16, OFFSETS["aligned"], sizes=[33, 4099])
    eager = {k: [t.clone() for t in v] for k, v in lists.items()}
    kw = scalars("cuda", step_tensor=torch.tensor([3.0], device="cuda"))

    @torch.compile(fullgraph=True)
    def step(lists, kw):
        OPS.distributed_adam(**lists, **kw)

    step(lists, kw)
    OPS.distributed_adam(**eager, **kw)
    for name in lists:
        for a, b in zip(lists[name], eager[name]):
            assert torch.equal(bits(a), bits(b)), name


@pytest.mark.gpu
@pytest.mark.multigpu
def test_runs_on_the_tensors_device_not_cuda0():
    lists = adam_inputs("cuda:1", BF16, F32, BF16, OFFSETS["aligned"], sizes=[7, 70001])
    kw = scalars("cuda:1")
    expected = [
        adam_float64(*t, **f64_kwargs(kw))
        for t in zip(lists["params"], lists["exp_avgs"], lists["exp_avg_sqs"], lists["grads"])
    ]
    with torch.cuda.device(0):
        OPS.distributed_adam(**lists, **kw)
    for i, (p, m, v) in enumerate(expected):
        close(lists["params"][i], p, BF16)
        close(lists["exp_avgs"][i], m, BF16)
        close(lists["exp_avg_sqs"][i], v, BF16)
