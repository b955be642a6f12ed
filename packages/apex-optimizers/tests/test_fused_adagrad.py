"""FusedAdagrad against torch.optim.Adagrad, on the CPU and (marked gpu) on CUDA.

fp16/bf16 parameters follow an fp32 emulation: torch.optim.Adagrad on fp32 copies, the copy
rounded to the parameter dtype after every step, the accumulator kept in fp32.
"""

from __future__ import annotations

import pytest
import torch

from apex.optimizers import FusedAdagrad

# empty, one, odd, 2-D, not a multiple of any vector width, more than one 65536-element chunk
SHAPES = [(0,), (1,), (7,), (33, 5), (4099,), (70001,)]
STEPS = 20
REDUCED = [torch.float16, torch.bfloat16]
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
# With L2 weight decay the first step divides g + wd*theta, which can cancel to near zero, by its
# own magnitude plus eps, so one fp32 rounding of that sum (kernels may fuse it differently) moves
# the update by up to rounding/eps. The L2 cases take an eps that keeps this below the tolerance.
L2_EPS = 1e-3


def make_params(dtype, device, shapes=SHAPES):
    return [torch.nn.Parameter(torch.randn(s, dtype=torch.float64).to(dtype=dtype, device=device)) for s in shapes]


def fp32_copies(params):
    return [torch.nn.Parameter(p.detach().float().clone()) for p in params]


def random_grads(params):
    return [torch.randn(p.shape, dtype=torch.float64).to(dtype=p.dtype, device=p.device) for p in params]


def assert_follows_emulation(param, twin, peak):
    """fp32 params as the twin; fp16/bf16 params within two units in the last place of their
    dtype at the largest magnitude the element reached: where the fp32 updates of ours and of
    the emulation straddle a rounding boundary, the rounded parameters part by one unit, and
    the gap stays as the parameter moves on."""
    if param.dtype == torch.float32:
        torch.testing.assert_close(param, twin, **FP32_TOL)
        return
    gap = (param.detach().double() - twin.detach().double()).abs()
    bound = 2 * torch.finfo(param.dtype).eps * peak.double() + 1e-6
    assert bool((gap <= bound).all()), (
        f"{param.dtype} parameter of shape {tuple(param.shape)} strays from the emulation by "
        f"{(gap - bound).max().item():.3g} beyond two units in the last place"
    )


def run(ours, theirs, params, twins, steps=STEPS, round_twins=False):
    """Step both on the same fresh gradients; return each twin's elementwise peak magnitude."""
    peaks = [t.detach().abs() for t in twins]
    for _ in range(steps):
        for p, t, g in zip(params, twins, random_grads(params)):
            p.grad = g
            t.grad = g.to(t.dtype)
        ours.step()
        theirs.step()
        if round_twins:
            with torch.no_grad():
                for p, t in zip(params, twins):
                    t.copy_(t.to(p.dtype))
        peaks = [torch.maximum(peak, t.detach().abs()) for peak, t in zip(peaks, twins)]
    return peaks


@pytest.mark.parametrize(("weight_decay", "eps"), [(0.0, 1e-10), (0.0, 1e-2), (0.05, L2_EPS)])
def test_fp32_matches_torch(device, weight_decay, eps):
    params = make_params(torch.float32, device)
    twins = fp32_copies(params)
    initial = [p.detach().clone() for p in params]
    hyper = dict(lr=0.05, eps=eps, weight_decay=weight_decay)
    ours, theirs = FusedAdagrad(params, **hyper), torch.optim.Adagrad(twins, **hyper)
    run(ours, theirs, params, twins)
    for p, t, p0 in zip(params, twins, initial):
        torch.testing.assert_close(p, t, **FP32_TOL)
        if p.numel():
            assert not torch.equal(p.detach(), p0)
        assert ours.state[p]["sum"].dtype == torch.float32
        torch.testing.assert_close(ours.state[p]["sum"], theirs.state[t]["sum"], **FP32_TOL)
        assert float(ours.state[p]["step"]) == float(theirs.state[t]["step"]) == STEPS


def test_mixed_dtypes_in_one_group_follow_fp32_emulation(device):
    params = [p for dtype in (torch.float32, *REDUCED) for p in make_params(dtype, device)]
    twins = fp32_copies(params)
    initial = [p.detach().clone() for p in params]
    hyper = dict(lr=0.05, eps=L2_EPS, weight_decay=0.05)
    ours, theirs = FusedAdagrad(params, **hyper), torch.optim.Adagrad(twins, **hyper)
    peaks = run(ours, theirs, params, twins, round_twins=True)
    for p, t, p0, peak in zip(params, twins, initial, peaks):
        assert_follows_emulation(p, t, peak)
        if p.numel():
            assert not torch.equal(p.detach(), p0)
        assert ours.state[p]["sum"].dtype == torch.float32
        torch.testing.assert_close(ours.state[p]["sum"], theirs.state[t]["sum"], rtol=1e-4, atol=1e-5)


def test_param_groups_keep_their_own_hyperparameters(device):
    first, second = make_params(torch.float32, device, SHAPES[:3]), make_params(torch.float32, device, SHAPES[3:])
    twins_first, twins_second = fp32_copies(first), fp32_copies(second)
    group_a = dict(lr=0.1, eps=L2_EPS, weight_decay=0.1)
    group_b = dict(lr=0.01, eps=1e-10, weight_decay=0.0)
    ours = FusedAdagrad([{"params": first, **group_a}, {"params": second, **group_b}], lr=1.0)
    theirs = torch.optim.Adagrad([{"params": twins_first, **group_a}, {"params": twins_second, **group_b}], lr=1.0)
    run(ours, theirs, first + second, twins_first + twins_second)
    for p, t in zip(first + second, twins_first + twins_second):
        torch.testing.assert_close(p, t, **FP32_TOL)


def adagrad_w_reference(params, grads_per_step, lr, eps, weight_decay):
    """FusedAdagrad's docstring rule with decoupled weight decay, in float64."""
    thetas = [p.detach().double().clone() for p in params]
    sums = [torch.zeros_like(t) for t in thetas]
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            g = g.double()
            sums[i] = sums[i] + g * g
            thetas[i] = thetas[i] - lr * (g / (sums[i].sqrt() + eps) + weight_decay * thetas[i])
    return thetas


def test_decoupled_weight_decay_matches_float64_reference(device):
    params = make_params(torch.float32, device)
    hyper = dict(lr=0.05, eps=1e-8, weight_decay=0.1)
    ours = FusedAdagrad(params, adagrad_w_mode=True, **hyper)
    initial = [p.detach().clone() for p in params]
    history = []
    for _ in range(STEPS):
        grads = random_grads(params)
        history.append(grads)
        for p, g in zip(params, grads):
            p.grad = g
        ours.step()
    for p, e in zip(params, adagrad_w_reference(initial, history, **hyper)):
        torch.testing.assert_close(p.double(), e, **FP32_TOL)


def test_tensor_lr_equals_float_lr(device):
    params = make_params(torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    with_tensor = FusedAdagrad(params, lr=torch.tensor(0.05, device=device))
    with_float = FusedAdagrad(twins, lr=0.05)
    run(with_tensor, with_float, params, twins, steps=5)
    for p, t in zip(params, twins):
        torch.testing.assert_close(p, t, **FP32_TOL)


@pytest.mark.parametrize("kwargs", [dict(lr=-0.1), dict(eps=-1.0), dict(weight_decay=-1.0)])
def test_invalid_hyperparameters_raise(kwargs):
    with pytest.raises(ValueError, match="FusedAdagrad: invalid"):
        FusedAdagrad([torch.nn.Parameter(torch.randn(3))], **kwargs)
