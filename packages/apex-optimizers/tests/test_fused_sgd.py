"""FusedSGD against torch.optim.SGD, on the CPU and (marked gpu) on CUDA.

fp16/bf16 parameters follow an fp32 emulation: torch.optim.SGD on fp32 copies, the copy rounded
to the parameter dtype after every step, momentum buffers kept in fp32.
"""

from __future__ import annotations

import pytest
import torch

from apex.optimizers import FusedSGD

from ._helpers import (
    FP32_TOL,
    REDUCED,
    assert_follows_emulation,
    assert_masters_follow_torch,
    assert_param_groups_follow_torch,
    assert_tensor_lr_equals_float_lr,
    fp32_copies,
    make_params,
    run,
    step_on_fresh_grads,
    step_on_some_grads,
)

CONFIGS = {
    "plain": dict(lr=0.05),
    "weight_decay": dict(lr=0.05, weight_decay=0.01),
    "momentum": dict(lr=0.05, momentum=0.9),
    "momentum_dampening_weight_decay": dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.02),
    "nesterov": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fp32_matches_torch(device, config):
    params = make_params(torch.float32, device)
    twins = fp32_copies(params)
    initial = [p.detach().clone() for p in params]
    ours, theirs = FusedSGD(params, **CONFIGS[config]), torch.optim.SGD(twins, **CONFIGS[config])
    run(ours, theirs, params, twins)
    for p, t, p0 in zip(params, twins, initial):
        torch.testing.assert_close(p, t, **FP32_TOL)
        if p.numel():
            assert not torch.equal(p.detach(), p0)
        if CONFIGS[config].get("momentum", 0) != 0:
            buffer = ours.state[p]["momentum_buffer"]
            assert buffer.dtype == torch.float32
            torch.testing.assert_close(buffer, theirs.state[t]["momentum_buffer"], **FP32_TOL)
        else:
            assert "momentum_buffer" not in ours.state[p]


@pytest.mark.parametrize("config", ["momentum_dampening_weight_decay", "nesterov"])
def test_mixed_dtypes_in_one_group_follow_fp32_emulation(device, config):
    params = [p for dtype in (torch.float32, *REDUCED) for p in make_params(dtype, device)]
    twins = fp32_copies(params)
    initial = [p.detach().clone() for p in params]
    ours, theirs = FusedSGD(params, **CONFIGS[config]), torch.optim.SGD(twins, **CONFIGS[config])
    peaks = run(ours, theirs, params, twins, round_twins=True)
    for p, t, p0, peak in zip(params, twins, initial, peaks):
        assert_follows_emulation(p, t, peak)
        if p.numel():
            assert not torch.equal(p.detach(), p0)
        buffer = ours.state[p]["momentum_buffer"]
        assert buffer.dtype == torch.float32
        # The buffers see the same gradients plus weight decay times parameters that may differ by
        # the rounding gap above; the buffer sums that over 1 / (1 - momentum) steps.
        hyper = CONFIGS[config]
        gap = 0.0 if p.dtype == torch.float32 else 2 * torch.finfo(p.dtype).eps * peak
        bound = hyper.get("weight_decay", 0.0) / (1 - hyper["momentum"]) * gap + 1e-5
        expected = theirs.state[t]["momentum_buffer"]
        assert bool(((buffer - expected).abs() <= bound + 1e-5 * expected.abs()).all())


@pytest.mark.parametrize("dtype", REDUCED)
@pytest.mark.parametrize("config", ["momentum_dampening_weight_decay", "nesterov", "plain"])
def test_master_weights_follow_fp32_sgd(device, dtype, config):
    # fp16/bf16 parameters with fp32 masters in the state follow torch's fp32 SGD on the same
    # (16-bit) gradients; fp32 parameters are their own masters.
    ours, _ = assert_masters_follow_torch(FusedSGD, torch.optim.SGD, dtype, device, **CONFIGS[config])
    params = ours.param_groups[0]["params"]
    assert ours.param_groups_master[0]["params"][-1] is params[-1]  # an fp32 parameter is its own master


def test_param_groups_keep_their_own_hyperparameters(device):
    group_a = dict(lr=0.1, momentum=0.5, dampening=0.5, weight_decay=0.1)
    group_b = dict(lr=0.01, momentum=0.95, nesterov=True)
    assert_param_groups_follow_torch(FusedSGD, torch.optim.SGD, device, group_a, group_b, lr=1.0)


def sgd_wd_after_momentum_reference(params, grads_per_step, lr, momentum, dampening, weight_decay, nesterov):
    """FusedSGD's docstring rule with weight decay after the momentum, in float64."""
    thetas = [p.detach().double().clone() for p in params]
    buffers = [None] * len(thetas)
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            g = g.double()
            buffers[i] = g.clone() if buffers[i] is None else momentum * buffers[i] + (1 - dampening) * g
            direction = g + momentum * buffers[i] if nesterov else buffers[i]
            direction = direction + weight_decay * thetas[i]
            thetas[i] = thetas[i] - lr * direction
    return thetas


@pytest.mark.parametrize("nesterov", [False, True])
def test_weight_decay_after_momentum_matches_float64_reference(device, nesterov):
    params = make_params(torch.float32, device)
    hyper = dict(lr=0.05, momentum=0.9, dampening=0.0 if nesterov else 0.2, weight_decay=0.05, nesterov=nesterov)
    ours = FusedSGD(params, wd_after_momentum=True, **hyper)
    initial = [p.detach().clone() for p in params]
    history = step_on_fresh_grads(ours, params)
    expected = sgd_wd_after_momentum_reference(initial, history, **hyper)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.double(), e, **FP32_TOL)


def test_tensor_lr_equals_float_lr(device):
    assert_tensor_lr_equals_float_lr(FusedSGD, device, 0.05, momentum=0.9)


def test_parameter_joining_later_starts_its_own_momentum(device):
    # a parameter whose first gradient arrives late takes the gradient itself as its buffer,
    # while the others keep accumulating: as torch.optim.SGD
    params = make_params(torch.float32, device, [(7,), (300,)])
    twins = fp32_copies(params)
    hyper = dict(lr=0.05, momentum=0.9, dampening=0.25)
    ours, theirs = FusedSGD(params, **hyper), torch.optim.SGD(twins, **hyper)
    for grads in step_on_some_grads(ours, params, [[0] if step < 3 else [0, 1] for step in range(6)]):
        for t, g in zip(twins, grads):
            t.grad = None if g is None else g.clone()
        theirs.step()
    for p, t in zip(params, twins):
        torch.testing.assert_close(p, t, **FP32_TOL)


def test_materialize_master_grads_is_accepted_and_changes_nothing():
    # upstream Apex's amp O2 switch; master weights live in the optimizer state here
    weights = make_params(torch.float16, "cpu", [(7,)])
    twins = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    flagged = FusedSGD(weights, lr=0.1, momentum=0.9, materialize_master_grads=False)
    plain = FusedSGD(twins, lr=0.1, momentum=0.9)
    assert flagged.materialize_master_grads is False
    run(flagged, plain, weights, twins, steps=3)
    assert torch.equal(weights[0], twins[0])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=-0.1),
        dict(lr=0.1, momentum=-0.5),
        dict(lr=0.1, weight_decay=-1.0),
        dict(lr=0.1, nesterov=True),
        dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
    ],
)
def test_invalid_hyperparameters_raise(kwargs):
    with pytest.raises(ValueError, match="FusedSGD:"):
        FusedSGD([torch.nn.Parameter(torch.randn(3))], **kwargs)
