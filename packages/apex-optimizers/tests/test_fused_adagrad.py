"""FusedAdagrad against torch.optim.Adagrad, on the CPU and (marked gpu) on CUDA.

fp16/bf16 parameters follow an fp32 emulation: torch.optim.Adagrad on fp32 copies, the copy
rounded to the parameter dtype after every step, the accumulator kept in fp32.
"""

from __future__ import annotations

import pytest
import torch

from apex.optimizers import FusedAdagrad

from ._helpers import (
    FP32_TOL,
    L2_EPS,
    REDUCED,
    STEPS,
    assert_follows_emulation,
    assert_param_groups_follow_torch,
    assert_tensor_lr_equals_float_lr,
    fp32_copies,
    make_params,
    run,
    step_on_fresh_grads,
)


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
    group_a = dict(lr=0.1, eps=L2_EPS, weight_decay=0.1)
    group_b = dict(lr=0.01, eps=1e-10, weight_decay=0.0)
    assert_param_groups_follow_torch(FusedAdagrad, torch.optim.Adagrad, device, group_a, group_b, lr=1.0)


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
    history = step_on_fresh_grads(ours, params)
    for p, e in zip(params, adagrad_w_reference(initial, history, **hyper)):
        torch.testing.assert_close(p.double(), e, **FP32_TOL)


def test_tensor_lr_equals_float_lr(device):
    assert_tensor_lr_equals_float_lr(FusedAdagrad, device, 0.05)


@pytest.mark.parametrize("kwargs", [dict(lr=-0.1), dict(eps=-1.0), dict(weight_decay=-1.0)])
def test_invalid_hyperparameters_raise(kwargs):
    with pytest.raises(ValueError, match="FusedAdagrad: invalid"):
        FusedAdagrad([torch.nn.Parameter(torch.randn(3))], **kwargs)
