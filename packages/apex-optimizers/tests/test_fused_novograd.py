"""FusedNovoGrad against a float64 NovoGrad written in this file.

The reference follows the NovoGrad paper (Ginsburg et al., "Stochastic Gradient Methods with
Layer-wise Adaptive Moments for Training of Deep Networks", Algorithm 1): a second moment that
is one number per tensor, from the norm of the tensor's gradient, and a first moment of the
gradient normalized by it; plus the options FusedNovoGrad documents (bias correction, grad
averaging, weight decay inside or outside the moment, zero initial second moment, L2 or
infinity norm).
"""

from __future__ import annotations

import pytest
import torch

from apex.optimizers import FusedNovoGrad

from ._helpers import (
    FP32_TOL,
    REDUCED,
    SHAPES,
    STAGGERED,
    STEPS,
    Float64Reference,
    assert_follows_reference,
    assert_tensor_lr_equals_float_lr,
    hypers_of,
    make_params,
    run_with_reference,
    step_on_some_grads,
)

HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "grad_averaging", "norm_type")
DEFAULTS = dict(
    lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01, bias_correction=True, grad_averaging=True, norm_type=2
)


class ReferenceNovoGrad(Float64Reference):
    """NovoGrad on float64 copies; fp16/bf16 parameters rounded to their dtype after every step.
    A parameter whose gradient is None skips the step, and its step count stays."""

    def __init__(self, params, hypers, reg_inside_moment=False, init_zero=False):
        super().__init__(params, hypers)
        self.m = [torch.zeros_like(t) for t in self.theta]
        self.v = [0.0 for _ in self.theta]
        self.reg_inside_moment, self.init_zero = reg_inside_moment, init_zero

    @staticmethod
    def norm(g, norm_type):
        if g.numel() == 0:
            return 0.0
        return float(g.abs().max()) if norm_type == 0 else float(g.square().sum().sqrt())

    def step(self, grads):
        for i, g, t, h in self._stepping(grads):
            beta1, beta2 = h["betas"]
            wd = h["weight_decay"]
            norm_sq = self.norm(g, h["norm_type"]) ** 2
            if t == 1 and not self.init_zero:
                self.v[i] = norm_sq
            else:
                self.v[i] = beta2 * self.v[i] + (1 - beta2) * norm_sq
            bc1 = 1 - beta1**t if h["bias_correction"] else 1.0
            bc2 = 1 - beta2**t if h["bias_correction"] else 1.0
            normalized = g / ((self.v[i] / bc2) ** 0.5 + h["eps"])
            theta = self.theta[i]
            if self.reg_inside_moment:
                normalized = normalized + wd * theta
            beta3 = 1 - beta1 if h["grad_averaging"] else 1.0
            self.m[i] = beta1 * self.m[i] + beta3 * normalized
            update = self.m[i] / bc1
            if not self.reg_inside_moment:
                update = update + wd * theta
            self._store(i, theta - h["lr"] * update, round_param=True)


VARIANTS = {
    "defaults": dict(),
    "reg_inside_moment": dict(reg_inside_moment=True, weight_decay=0.05),
    "no_grad_averaging": dict(grad_averaging=False),
    "init_zero": dict(init_zero=True),
    "infinity_norm": dict(norm_type=0),
    "infinity_norm_init_zero_inside": dict(norm_type=0, init_zero=True, reg_inside_moment=True),
    "no_bias_correction": dict(bias_correction=False),
    "no_weight_decay": dict(weight_decay=0.0, betas=(0.95, 0.5), eps=1e-3),
}
OPTIMIZER_WIDE = ("reg_inside_moment", "init_zero")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp32_matches_float64_reference(device, variant):
    options = {**DEFAULTS, **VARIANTS[variant]}
    params = make_params(torch.float32, device)
    optimizer = FusedNovoGrad(params, **options)
    wide = {k: options[k] for k in OPTIMIZER_WIDE if k in options}
    reference = ReferenceNovoGrad(params, hypers_of(optimizer, HYPER_KEYS), **wide)
    initial = [p.detach().clone() for p in params]
    run_with_reference(optimizer, params, reference)
    for i, (p, p0, expected) in enumerate(zip(params, initial, reference.theta)):
        assert_follows_reference(p, expected, None)
        if p.numel():
            assert not torch.equal(p.detach(), p0)
        state = optimizer.state[p]
        torch.testing.assert_close(state["exp_avg"].double(), reference.m[i], **FP32_TOL)
        second_moment = state["exp_avg_sq"]
        assert second_moment.numel() == 1 and second_moment.dtype == torch.float32
        torch.testing.assert_close(float(second_moment), reference.v[i], rtol=1e-5, atol=0.0)
        assert float(state["step"]) == STEPS


def test_param_groups_keep_their_own_hyperparameters(device):
    first, second = make_params(torch.float32, device, SHAPES[:3]), make_params(torch.float32, device, SHAPES[3:])
    group_a = dict(lr=5e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, bias_correction=False, norm_type=0)
    group_b = dict(lr=1e-2, betas=(0.95, 0.99), weight_decay=0.0, grad_averaging=False)
    optimizer = FusedNovoGrad([{"params": first, **group_a}, {"params": second, **group_b}], lr=1.0)
    params = first + second
    reference = ReferenceNovoGrad(params, hypers_of(optimizer, HYPER_KEYS))
    assert reference.hypers[0]["norm_type"] == 0 and reference.hypers[-1]["norm_type"] == 2
    run_with_reference(optimizer, params, reference)
    for p, expected in zip(params, reference.theta):
        assert_follows_reference(p, expected, None)


@pytest.mark.parametrize("variant", ["defaults", "infinity_norm_init_zero_inside"])
def test_mixed_dtypes_in_one_group_follow_rounded_reference(device, variant):
    options = {**DEFAULTS, **VARIANTS[variant], "lr": 0.2}
    params = [p for dtype in (torch.float32, *REDUCED) for p in make_params(dtype, device)]
    optimizer = FusedNovoGrad(params, **options)
    wide = {k: options[k] for k in OPTIMIZER_WIDE if k in options}
    reference = ReferenceNovoGrad(params, hypers_of(optimizer, HYPER_KEYS), **wide)
    initial = [p.detach().clone() for p in params]
    run_with_reference(optimizer, params, reference)
    for p, p0, expected, peak in zip(params, initial, reference.theta, reference.peaks):
        assert_follows_reference(p, expected, peak)
        if p.numel():
            assert not torch.equal(p.detach(), p0)
        assert optimizer.state[p]["exp_avg"].dtype == torch.float32


def test_parameters_with_their_own_step_counts(device):
    # One bucket, three step counts: a parameter with a gradient every step, one that joins late
    # (its second moment starts from its own first gradient), one that skips steps.
    params = make_params(torch.float32, device, [(7,), (33, 5), (300,)])
    optimizer = FusedNovoGrad(params, **DEFAULTS)
    reference = ReferenceNovoGrad(params, hypers_of(optimizer, HYPER_KEYS))
    for grads in step_on_some_grads(optimizer, params, STAGGERED):
        reference.step(grads)
    for i, p in enumerate(params):
        assert float(optimizer.state[p]["step"]) == reference.t[i]
        torch.testing.assert_close(float(optimizer.state[p]["exp_avg_sq"]), reference.v[i], rtol=1e-5, atol=0.0)
        assert_follows_reference(p, reference.theta[i], None)


def test_tensor_lr_equals_float_lr(device):
    assert_tensor_lr_equals_float_lr(FusedNovoGrad, device, **DEFAULTS)


def test_norm_type_other_than_0_or_2_raises():
    with pytest.raises(ValueError, match="norm_type"):
        FusedNovoGrad([torch.nn.Parameter(torch.randn(3))], norm_type=1)
