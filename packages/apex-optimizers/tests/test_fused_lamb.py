"""FusedLAMB and FusedMixedPrecisionLamb against a float64 LAMB written in this file.

The reference follows the LAMB paper (You et al., "Large Batch Optimization for Deep
Learning", Algorithm 2) with the options FusedLAMB documents: global gradient clipping,
L2 or decoupled weight decay, grad averaging, bias correction, NVLAMB's trust ratio for
parameters without weight decay.
"""

from __future__ import annotations

import math

import pytest
import torch

from apex.optimizers import FusedLAMB, FusedMixedPrecisionLamb

from ._helpers import (
    FP32_TOL,
    L2_EPS,
    REDUCED,
    SHAPES,
    STAGGERED,
    STEPS,
    Float64Reference,
    assert_follows_reference,
    assert_tensor_lr_equals_float_lr,
    hypers_of,
    make_params,
    random_grads,
    run_with_reference,
    step_on_some_grads,
)

HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "grad_averaging", "max_grad_norm")
DEFAULTS = dict(
    lr=1e-2,
    betas=(0.9, 0.999),
    eps=1e-6,
    weight_decay=0.01,
    bias_correction=True,
    grad_averaging=True,
    max_grad_norm=1.0,
)


class ReferenceLamb(Float64Reference):
    """LAMB on float64 copies of the parameters.

    ``hypers`` gives each parameter its group's hyper-parameters. With ``round_params`` a
    fp16/bf16 parameter is rounded to its dtype after every step (a fused step without master
    weights); without, the float64 copy is the master trajectory. A parameter whose gradient is
    None skips the step, and its step count stays.
    """

    def __init__(self, params, hypers, adam_w_mode=True, use_nvlamb=False, round_params=False, step=0):
        super().__init__(params, hypers, step)
        self.m = [torch.zeros_like(t) for t in self.theta]
        self.v = [torch.zeros_like(t) for t in self.theta]
        self.adam_w_mode, self.use_nvlamb, self.round_params = adam_w_mode, use_nvlamb, round_params
        self.clip_ratios = []

    def step(self, grads):
        grads = [None if g is None else g.double() for g in grads]
        global_norm = math.sqrt(sum(float(g.square().sum()) for g in grads if g is not None))
        ratios = []
        for i, g, t, h in self._stepping(grads):
            beta1, beta2 = h["betas"]
            wd = h["weight_decay"]
            clip = global_norm / h["max_grad_norm"] if 0 < h["max_grad_norm"] < global_norm else 1.0
            ratios.append(clip)
            g = g / clip
            theta = self.theta[i]
            if not self.adam_w_mode:
                g = g + wd * theta
            beta3 = 1 - beta1 if h["grad_averaging"] else 1.0
            self.m[i] = beta1 * self.m[i] + beta3 * g
            self.v[i] = beta2 * self.v[i] + (1 - beta2) * g * g
            m_hat = self.m[i] / (1 - beta1**t) if h["bias_correction"] else self.m[i]
            v_hat = self.v[i] / (1 - beta2**t) if h["bias_correction"] else self.v[i]
            update = m_hat / (v_hat.sqrt() + h["eps"])
            if self.adam_w_mode:
                update = update + wd * theta
            trust = 1.0
            if wd != 0 or self.use_nvlamb:
                theta_norm, update_norm = float(theta.norm()), float(update.norm())
                if theta_norm > 0 and update_norm > 0:
                    trust = theta_norm / update_norm
            self._store(i, theta - h["lr"] * trust * update, self.round_params)
        self.clip_ratios.append(max(ratios))


def assert_follows_lamb_reference(param, expected, peak):
    """As ``assert_follows_reference``, with an fp32 absolute tolerance relative to the tensor's scale.

    Each step moves every element by lr * ratio * u, computed in fp32 (the kernel with fast
    sqrt/division), so an element that ends near zero still carries the rounding of those
    updates: the absolute tolerance is relative to the tensor's scale, not the element's.
    (Seen on the H200: 1.5e-6 on a tensor of max magnitude ~3.5 after 20 steps.)
    """
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    assert_follows_reference(param, expected, peak, atol=FP32_TOL["rtol"] * scale + FP32_TOL["atol"])


# FusedLAMB, fp32, every option -------------------------------------------------------------

VARIANTS = {
    "defaults_clipping_active": dict(),
    "l2_weight_decay": dict(adam_w_mode=False, weight_decay=0.05, eps=L2_EPS),
    "no_grad_averaging": dict(grad_averaging=False),
    "clipping_inactive": dict(max_grad_norm=1e4),
    "clipping_off": dict(max_grad_norm=0.0),
    "nvlamb_without_weight_decay": dict(use_nvlamb=True, weight_decay=0.0),
    "no_weight_decay_no_trust_ratio": dict(weight_decay=0.0),
    "no_bias_correction": dict(bias_correction=False),
    "l2_nvlamb_other_betas": dict(adam_w_mode=False, use_nvlamb=True, weight_decay=0.02, betas=(0.8, 0.9), eps=L2_EPS),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp32_matches_float64_reference(device, variant):
    options = {**DEFAULTS, **VARIANTS[variant]}
    params = make_params(torch.float32, device)
    optimizer = FusedLAMB(params, **options)
    reference = ReferenceLamb(params, hypers_of(optimizer, HYPER_KEYS), optimizer.adam_w_mode, optimizer.use_nvlamb)
    initial = [p.detach().clone() for p in params]
    run_with_reference(optimizer, params, reference)
    if variant in ("clipping_inactive", "clipping_off"):
        assert max(reference.clip_ratios) == 1.0
    else:
        assert min(reference.clip_ratios) > 1.0, "the gradients are meant to be clipped"
    for p, p0, expected, m, v in zip(params, initial, reference.theta, reference.m, reference.v):
        assert_follows_lamb_reference(p, expected, None)
        if p.numel():
            assert not torch.equal(p.detach(), p0)
        state = optimizer.state[p]
        torch.testing.assert_close(state["exp_avg"].double(), m, **FP32_TOL)
        torch.testing.assert_close(state["exp_avg_sq"].double(), v, **FP32_TOL)
        assert float(state["step"]) == STEPS


def test_param_groups_keep_their_own_hyperparameters_and_share_the_global_norm(device):
    first, second = make_params(torch.float32, device, SHAPES[:4]), make_params(torch.float32, device, SHAPES[4:])
    group_a = dict(
        lr=5e-3,
        betas=(0.8, 0.99),
        eps=1e-5,
        weight_decay=0.1,
        bias_correction=False,
        grad_averaging=False,
        max_grad_norm=2.0,
    )
    group_b = dict(lr=2e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, max_grad_norm=50.0)
    optimizer = FusedLAMB([{"params": first, **group_a}, {"params": second, **group_b}], lr=1.0, weight_decay=0.5)
    params = first + second
    reference = ReferenceLamb(params, hypers_of(optimizer, HYPER_KEYS))
    run_with_reference(optimizer, params, reference)
    assert reference.hypers[0]["lr"] == 5e-3 and reference.hypers[-1]["weight_decay"] == 0.0
    for p, expected in zip(params, reference.theta):
        assert_follows_lamb_reference(p, expected, None)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_mixed_dtypes_in_one_group_follow_rounded_reference(device, adam_w_mode):
    params = [p for dtype in (torch.float32, *REDUCED) for p in make_params(dtype, device)]
    eps = DEFAULTS["eps"] if adam_w_mode else L2_EPS
    optimizer = FusedLAMB(params, adam_w_mode=adam_w_mode, **{**DEFAULTS, "lr": 5e-2, "eps": eps})
    reference = ReferenceLamb(params, hypers_of(optimizer, HYPER_KEYS), adam_w_mode, round_params=True)
    initial = [p.detach().clone() for p in params]
    run_with_reference(optimizer, params, reference)
    for p, p0, expected, peak in zip(params, initial, reference.theta, reference.peaks):
        assert_follows_lamb_reference(p, expected, peak)
        if p.numel():
            assert not torch.equal(p.detach(), p0)
        assert optimizer.state[p]["exp_avg"].dtype == torch.float32
        assert "master_param" not in optimizer.state[p]


@pytest.mark.parametrize("dtype", REDUCED)
def test_master_weights_follow_float64_reference(device, dtype):
    params = make_params(dtype, device) + make_params(torch.float32, device, [(5, 3)])
    optimizer = FusedLAMB(params, master_weights=True, **DEFAULTS)
    reference = ReferenceLamb(params, hypers_of(optimizer, HYPER_KEYS))
    run_with_reference(optimizer, params, reference)
    for p, expected in zip(params, reference.theta):
        if p.dtype == torch.float32:
            assert "master_param" not in optimizer.state[p]
            assert_follows_lamb_reference(p, expected, None)
            continue
        master = optimizer.state[p]["master_param"]
        assert master.dtype == torch.float32
        torch.testing.assert_close(master.double(), expected, **FP32_TOL)
        assert torch.equal(p.detach(), master.to(dtype))


def test_parameters_with_their_own_step_counts(device):
    # One bucket, three step counts: a parameter with a gradient every step, one that joins
    # late, one that skips steps; each parameter's bias corrections follow its own count.
    params = make_params(torch.float32, device, [(7,), (33, 5), (300,)])
    optimizer = FusedLAMB(params, **DEFAULTS)
    reference = ReferenceLamb(params, hypers_of(optimizer, HYPER_KEYS))
    for grads in step_on_some_grads(optimizer, params, STAGGERED):
        reference.step(grads)
    for p, expected, count in zip(params, reference.theta, reference.t):
        assert float(optimizer.state[p]["step"]) == count
        assert_follows_lamb_reference(p, expected, None)


def test_tensor_lr_equals_float_lr(device):
    assert_tensor_lr_equals_float_lr(FusedLAMB, device, **DEFAULTS)


@pytest.mark.parametrize("kwargs", [dict(lr=-1.0), dict(betas=(1.0, 0.9)), dict(betas=(0.9, 1.5))])
def test_invalid_hyperparameters_raise(kwargs):
    with pytest.raises(ValueError, match="FusedLAMB: invalid"):
        FusedLAMB([torch.nn.Parameter(torch.randn(3))], **kwargs)


# FusedMixedPrecisionLamb -------------------------------------------------------------------


@pytest.mark.parametrize("start_step", [0, 10])
def test_mixed_precision_lamb_masters_follow_float64_reference(device, start_step):
    params = make_params(torch.bfloat16, device) + make_params(torch.float32, device, [(5, 3), (300,)])
    options = {**DEFAULTS, "weight_decay": 0.02}
    optimizer = FusedMixedPrecisionLamb(params, step=start_step, reduced_precision_dtype=torch.bfloat16, **options)
    group = optimizer.param_groups[0]
    assert isinstance(group["lr"], torch.Tensor) and group["lr"].dtype == torch.float32
    reference = ReferenceLamb(params, [{**options} for _ in params], step=start_step)
    initial = [p.detach().clone() for p in params]
    run_with_reference(optimizer, params, reference)
    assert min(reference.clip_ratios) > 1.0
    for p, p0, expected in zip(params, initial, reference.theta):
        state = optimizer.state[p]
        assert float(state["step"]) == start_step + STEPS
        if p.dtype == torch.float32:
            assert "master_param" not in state
            assert_follows_lamb_reference(p, expected, None)
            continue
        master = state["master_param"]
        assert master.dtype == torch.float32
        torch.testing.assert_close(master.double(), expected, **FP32_TOL)
        assert torch.equal(p.detach(), master.to(torch.bfloat16))
        if p.numel():
            assert not torch.equal(master, p0.float()), "the master weights did not move"


def test_mixed_precision_lamb_param_groups(device):
    first, second = make_params(torch.bfloat16, device, SHAPES[:4]), make_params(torch.bfloat16, device, SHAPES[4:])
    group_a = dict(lr=5e-3, weight_decay=0.1, max_grad_norm=0.0)
    group_b = dict(lr=2e-2, weight_decay=0.0, betas=(0.8, 0.9))
    optimizer = FusedMixedPrecisionLamb([{"params": first, **group_a}, {"params": second, **group_b}], lr=1.0)
    params = first + second
    assert all(isinstance(g["lr"], torch.Tensor) for g in optimizer.param_groups)
    hypers = [{**DEFAULTS, **group_a} for _ in first] + [{**DEFAULTS, **group_b} for _ in second]
    reference = ReferenceLamb(params, hypers)
    run_with_reference(optimizer, params, reference)
    for p, expected in zip(params, reference.theta):
        torch.testing.assert_close(optimizer.state[p]["master_param"].double(), expected, **FP32_TOL)


def test_mixed_precision_lamb_checks_reduced_precision_dtype():
    params = [torch.nn.Parameter(torch.randn(3, dtype=torch.float16))]
    with pytest.raises(TypeError, match=r"reduced_precision_dtype=torch.bfloat16"):
        FusedMixedPrecisionLamb(params, reduced_precision_dtype=torch.bfloat16)


@pytest.mark.gpu
def test_mixed_precision_lamb_step_replayed_in_cuda_graph_equals_eager():
    shapes = [(1,), (7,), (33, 5), (70001,)]
    params = make_params(torch.bfloat16, "cuda", shapes) + make_params(torch.float32, "cuda", shapes)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    graphed = FusedMixedPrecisionLamb(params, lr=1e-2)
    eager = FusedMixedPrecisionLamb(twins, lr=1e-2)
    for p in params:
        p.grad = torch.zeros_like(p)
    history = [random_grads(params) for _ in range(8)]
    warmup = 3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for grads in history[:warmup]:
            for p, g in zip(params, grads):
                p.grad.copy_(g)
            graphed.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()
    for grads in history[warmup:]:
        for p, g in zip(params, grads):
            p.grad.copy_(g)
        graph.replay()
    for grads in history:
        for t, g in zip(twins, grads):
            t.grad = g.clone()
        eager.step()
    torch.cuda.synchronize()
    for p, t in zip(params, twins):
        for key, value in eager.state[t].items():
            torch.testing.assert_close(graphed.state[p][key], value, **FP32_TOL)
        if p.dtype == torch.bfloat16:
            assert torch.equal(p.detach(), graphed.state[p]["master_param"].to(torch.bfloat16))
        else:
            torch.testing.assert_close(p, t, **FP32_TOL)
    assert float(graphed.state[params[0]]["step"]) == len(history)


def test_mixed_precision_lamb_add_param_group_gets_a_device_lr(device):
    first = [torch.randn(8, device=device).to(torch.bfloat16).requires_grad_()]
    optimizer = FusedMixedPrecisionLamb(first, lr=1e-3, reduced_precision_dtype=torch.bfloat16)
    second = [torch.randn(5, device=device).to(torch.bfloat16).requires_grad_()]
    optimizer.add_param_group({"params": second, "lr": 2e-3})
    lr = optimizer.param_groups[-1]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 and lr.device.type == device
    assert lr.item() == pytest.approx(2e-3)
    with pytest.raises(TypeError, match=r"reduced_precision_dtype=torch\.bfloat16"):
        optimizer.add_param_group({"params": [torch.randn(3, device=device, dtype=torch.float16)]})
