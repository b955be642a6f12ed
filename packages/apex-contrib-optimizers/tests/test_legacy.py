"""The ops (torch.ops.apex_contrib_optimizers.*) and upstream's legacy modules fused_adam_cuda and
fused_lamb_cuda: against float64 math and against the public classes; bad input; opcheck."""

from __future__ import annotations

import math

import fused_adam_cuda
import fused_lamb_cuda
import pytest
import torch

from apex.contrib.optimizers import FusedAdam, FusedLAMB, _ops

from ._reference import ContribAdam, assert_close, make_grads, make_params

HYPER = dict(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, decay=0.01)


def legacy_args(step, mode, grad_scale=1.0, bias_correction=1):
    h = HYPER
    return (h["lr"], h["beta1"], h["beta2"], h["eps"], grad_scale, step, mode, bias_correction, h["decay"])


def adam_state(p):
    return torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32)


# e5m2 ---------------------------------------------------------------------------------------------


def test_e5m2_codes_round_trip():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = _ops.from_e5m2(codes)
    finite = torch.isfinite(values)
    # Every finite code decodes to a float16 whose low byte is zero and encodes back to itself
    # (the two zeros aside: -0 and +0 keep their signs too).
    assert torch.equal(_ops.to_e5m2(values[finite]), codes[finite])
    assert torch.equal(values.view(torch.int16) & 0xFF, torch.zeros(256, dtype=torch.int16))


def test_e5m2_rounds_to_nearest():
    x = torch.randn(10_000, dtype=torch.float64) * 100
    got = _ops.from_e5m2(_ops.to_e5m2(x.float())).double()
    # e5m2 keeps two mantissa bits: neighbours 2^(e-2) apart, so within half of that (plus the
    # float16 rounding of the biased value on the way, at most one float16 step of 2^(e-10)).
    spacing = torch.exp2(torch.floor(torch.log2(x.abs())) - 2)
    error = (got - x).abs()
    assert bool((error <= spacing / 2 * (1 + 2**-7)).all())
    assert float((error / spacing).mean()) < 0.3  # round to nearest, not truncation (mean 1/4 vs 1/2)


# fused_adam_cuda ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
def test_adam_matches_float64_and_writes_copy_for_half_grads(device, mode, grad_dtype):
    p = make_params(torch.float32, device, [(4099,)])[0].detach()
    m, v = adam_state(p)
    copy = torch.full_like(p, float("nan"), dtype=torch.float16)
    ref = ContribAdam([p], HYPER["lr"], (HYPER["beta1"], HYPER["beta2"]), HYPER["eps"], HYPER["decay"], mode == 0)
    for step in range(1, 4):
        g = make_grads([p], dtype=grad_dtype, scale=64.0)[0]
        fused_adam_cuda.adam(p, copy, m, v, g, *legacy_args(step, mode, grad_scale=64.0))
        ref.step([g], divisor=64.0)
    assert_close(p, ref.p[0], torch.float32)
    if grad_dtype == torch.float16:
        assert torch.equal(copy, p.half())
    else:  # upstream writes no copy for fp32 gradients
        assert bool(copy.isnan().all())


@pytest.mark.parametrize("mode", [0, 1])
def test_adam_mt_matches_the_class(device, mode):
    masters = make_params(torch.float32, device)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in masters]
    states = [adam_state(p) for p in masters]
    copies = [torch.empty_like(p, dtype=torch.float16) for p in masters]
    opt = FusedAdam(twin, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                    weight_decay=HYPER["decay"], eps_inside_sqrt=mode == 0)  # fmt: skip
    for step in range(1, 4):
        grads = make_grads(masters, dtype=torch.float16)
        lists = [[p.data for p in masters], [s[0] for s in states], [s[1] for s in states], grads, copies]
        fused_adam_cuda.adam_mt(65536, torch.zeros(1, dtype=torch.int32), lists, *legacy_args(step, mode))
        opt.step(grads=grads)
    for p, t, c in zip(masters, twin, copies):
        assert_close(p, t.detach().double(), torch.float32)
        assert torch.equal(c, p.detach().half())


@pytest.mark.parametrize("copy_dtype", [torch.float16, torch.uint8])
def test_reversible_adam_skips_nonfinite_and_marks_the_copy(device, copy_dtype):
    p = torch.randn(257, device=device)
    m, v = adam_state(p)
    m.copy_(torch.rand_like(m))
    v.copy_(torch.rand_like(v))
    g = torch.randn(257, device=device).half()
    g[5] = float("inf")
    g[9] = float("nan")
    before = [t.clone() for t in (p, m, v)]
    copy = torch.zeros_like(p, dtype=copy_dtype)
    fused_adam_cuda.reversible_adam(p, copy, m, v, g, *legacy_args(2, 1))
    bad = torch.zeros(257, dtype=torch.bool, device=device)
    bad[[5, 9]] = True
    for new, old in zip((p, m, v), before):
        assert torch.equal(new[bad], old[bad])
        assert bool((new[~bad] != old[~bad]).all())
    decoded = _ops.from_e5m2(copy).float() if copy_dtype == torch.uint8 else copy.float()
    assert decoded[0].item() == math.inf
    expected = p.half() if copy_dtype == torch.float16 else _ops.from_e5m2(_ops.to_e5m2(p))
    assert torch.equal(decoded[1:], expected[1:].float())


@pytest.mark.parametrize("mode", [0, 1])
def test_maybe_adam_undo_inverts_adam_when_the_flag_is_set(device, mode):
    p = torch.randn(1000, device=device, dtype=torch.float64).float()
    m, v = adam_state(p)
    m.copy_(torch.randn_like(m) * 0.1)
    v.copy_(torch.rand_like(v) * 0.1)
    g = torch.randn_like(p).half()
    before = [t.clone() for t in (p, m, v)]
    fused_adam_cuda.adam(p, torch.empty(0, device=device), m, v, g, *legacy_args(3, mode))
    after = [t.clone() for t in (p, m, v)]
    fused_adam_cuda.maybe_adam_undo(torch.zeros(1, dtype=torch.int32, device=device), p, m, v, g, *legacy_args(3, mode))
    for new, old in zip((p, m, v), after):
        assert torch.equal(new, old)  # flag clear: nothing undone
    fused_adam_cuda.maybe_adam_undo(torch.ones(1, dtype=torch.int32, device=device), p, m, v, g, *legacy_args(3, mode))
    for new, old in zip((p, m, v), before):
        torch.testing.assert_close(new, old, rtol=1e-4, atol=1e-5)


def test_strided_check_finite(device):
    x = torch.randn(100, device=device).half()
    x[3] = float("nan")
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    fused_adam_cuda.strided_check_finite(flag, x, 2, 1)  # index 3 is not sampled
    assert flag.item() == 0
    fused_adam_cuda.strided_check_finite(flag, x, 1, 0)
    assert flag.item() == 1
    x[3] = 1.0
    fused_adam_cuda.strided_check_finite(flag, x, 1, 0)  # not cleared: stays set
    assert flag.item() == 1
    fused_adam_cuda.strided_check_finite(flag, x, 1, 1)
    assert flag.item() == 0
    codes = _ops.to_e5m2(torch.randn(64, device=device))
    codes[10] = _ops.to_e5m2(torch.tensor([math.inf], device=device))[0]
    fused_adam_cuda.strided_check_finite(flag, codes, 1, 1)
    assert flag.item() == 1


@pytest.mark.parametrize(("src", "dst"), [(torch.float32, torch.float16), (torch.float16, torch.float32),
                                          (torch.float32, torch.uint8), (torch.uint8, torch.float32)])  # fmt: skip
def test_maybe_cast(device, src, dst):
    values = torch.randn(77, device=device)
    p_in = _ops.to_e5m2(values) if src == torch.uint8 else values.to(src)
    p_out = torch.zeros(77, device=device, dtype=dst)
    fused_adam_cuda.maybe_cast(torch.ones(1, dtype=torch.int32, device=device), p_in, p_out)
    assert bool((p_out == 0).all())  # flag set: untouched
    fused_adam_cuda.maybe_cast(torch.zeros(1, dtype=torch.int32, device=device), p_in, p_out)
    source = _ops.from_e5m2(p_in).float() if src == torch.uint8 else p_in.float()
    expected = _ops.to_e5m2(source) if dst == torch.uint8 else source.to(dst)
    assert torch.equal(p_out, expected)
    out2 = torch.zeros_like(p_out)
    fused_adam_cuda.maybe_cast_mt(65536, torch.empty(0, dtype=torch.int32, device=device), [[p_in], [out2]])
    assert torch.equal(out2, expected)


# fused_lamb_cuda ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lamb_matches_the_class(device, dtype):
    params = make_params(dtype, device, [(7,), (300,)])
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ms = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    vs = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    opt = FusedLAMB(twin, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    for step in range(1, 3):
        grads = make_grads(params)
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        fused_lamb_cuda.lamb(65536, torch.zeros(1, dtype=torch.int32), [grads, [p.data for p in params], ms, vs],
                             1e-2, 0.9, 0.999, 1e-6, step, 1, 0.01, 1, 1, norm, 1.0)  # fmt: skip
        for t, g in zip(twin, grads):
            t.grad = g.clone()
        opt.step()
    # The same kernel; the global norm here is summed in float64 on the host, the class's on the device.
    for p, t in zip(params, twin):
        assert_close(p, t.detach().double(), dtype)
    for m, t in zip(ms, twin):
        torch.testing.assert_close(m, opt.state[t]["exp_avg"], rtol=1e-5, atol=1e-7)


def test_lamb_with_half_moments_rounds_them_once(device):
    # Upstream's all-fp16 lists: the moments are updated in fp32 and stored rounded.
    params = make_params(torch.float16, device, [(300,)])
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ms, vs = [torch.zeros_like(params[0])], [torch.zeros_like(params[0])]
    grads = make_grads(params)
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    fused_lamb_cuda.lamb(65536, torch.zeros(1, dtype=torch.int32), [grads, [params[0].data], ms, vs],
                         1e-2, 0.9, 0.999, 1e-6, 1, 1, 0.01, 1, 1, norm, 1.0)  # fmt: skip
    opt = FusedLAMB(twin, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    twin[0].grad = grads[0].clone()
    opt.step()
    assert ms[0].dtype == torch.float16
    torch.testing.assert_close(ms[0], opt.state[twin[0]]["exp_avg"].half(), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(vs[0], opt.state[twin[0]]["exp_avg_sq"].half(), rtol=1e-3, atol=1e-6)


# op checks and opcheck ------------------------------------------------------------------------------


def adam_inputs(device="cpu"):
    p = [torch.randn(5, device=device), torch.randn(2, 3, device=device)]
    return (p, [torch.empty_like(t, dtype=torch.float16) for t in p], [torch.zeros_like(t) for t in p],
            [torch.rand_like(t) for t in p], [torch.randn_like(t).half() for t in p])  # fmt: skip


BAD = {
    "int p": (lambda: ([torch.ones(3, dtype=torch.int32)], [], [torch.zeros(3)], [torch.zeros(3)], [torch.ones(3)]),
              {}, TypeError, "p\\[0\\] has dtype torch.int32"),
    "half m": (lambda: ([torch.ones(3)], [], [torch.zeros(3).half()], [torch.zeros(3)], [torch.ones(3)]),
               {}, TypeError, "m\\[0\\] has dtype torch.float16"),
    "lengths": (lambda: ([torch.ones(3)], [], [], [torch.zeros(3)], [torch.ones(3)]),
                {}, ValueError, "tensor lists must have the same length"),
    "sizes": (lambda: ([torch.ones(3)], [], [torch.zeros(4)], [torch.zeros(3)], [torch.ones(3)]),
              {}, ValueError, "m\\[0\\] has 4 elements"),
    "eps_mode": (adam_inputs, {"eps_mode": 2}, ValueError, "eps_mode must be 0"),
    "step": (adam_inputs, {"step": 0}, ValueError, "step must be >= 1"),
    "grad_scale": (adam_inputs, {"grad_scale": 0.0}, ValueError, "grad_scale must be positive"),
    "e5m2 not reversible": (
        lambda: ([torch.ones(3)], [torch.zeros(3, dtype=torch.uint8)], [torch.zeros(3)], [torch.zeros(3)],
                 [torch.ones(3)]),
        {}, TypeError, r"p_copy has dtype torch.uint8 \(e5m2\); only the reversible",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_adam_op_bad_input_names_the_argument(case):
    make, overrides, error, message = BAD[case]
    kwargs = dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, grad_scale=1.0, step=1, eps_mode=1, bias_correction=True,
                  decay=0.0) | overrides  # fmt: skip
    with pytest.raises(error, match=r"^adam: " + message):
        _ops.adam(*make(), **kwargs)


def test_flag_ops_bad_input():
    x = torch.randn(4)
    with pytest.raises(TypeError, match=r"^strided_check_finite: overflow_flag has dtype torch.float32"):
        _ops.strided_check_finite(torch.zeros(1), x, 1, True)
    with pytest.raises(ValueError, match=r"^strided_check_finite: stride must be >= 1"):
        _ops.strided_check_finite(torch.zeros(1, dtype=torch.int32), x, 0, True)
    with pytest.raises(ValueError, match=r"^maybe_cast: p_out\[0\] has 5 elements"):
        _ops.maybe_cast(torch.zeros(1, dtype=torch.int32), [x], [torch.zeros(5)])
    with pytest.raises(ValueError, match=r"^adam_undo: overflow_flag must have exactly one element"):
        _ops.adam_undo(torch.zeros(2, dtype=torch.int32), [x], [x.clone()], [x.abs()], [x], 0.1, 0.9, 0.99, 1e-8,
                       1.0, 1, 1, True, 0.0)  # fmt: skip


def test_opcheck_every_op(device):
    p, copies, m, v, g = adam_inputs(device)
    hyper = (0.1, 0.9, 0.99, 1e-8, 2.0, 3, 0, True, 0.01)
    torch.library.opcheck(_ops.adam, (p, copies, m, v, g, *hyper))
    torch.library.opcheck(_ops.adam, (p, [c.to(torch.uint8) for c in copies], m, v, g, *hyper, True))
    flag = torch.ones(1, dtype=torch.int32, device=device)
    torch.library.opcheck(_ops.adam_undo, (flag, p, m, v, g, *hyper))
    torch.library.opcheck(_ops.strided_check_finite, (flag, copies[0], 2, True))
    torch.library.opcheck(_ops.maybe_cast, (flag * 0, p, copies))
