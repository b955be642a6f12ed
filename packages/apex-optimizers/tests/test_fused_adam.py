"""FusedAdam against torch.optim.Adam/AdamW, on the CPU and (marked gpu) on CUDA.

fp32 parameters follow torch.optim step for step. fp16/bf16 parameters without master weights
follow an fp32 emulation (torch.optim on fp32 copies, the copy rounded to the parameter dtype
after every step, moments kept in fp32); with master weights the fp32 masters follow torch's
AdamW on fp32 copies and the parameters are the masters rounded.
"""

from __future__ import annotations

import pytest
import torch

from apex.optimizers import FusedAdam

from ._helpers import (
    FP32_TOL,
    L2_EPS,
    REDUCED,
    STAGGERED,
    STEPS,
    assert_follows_emulation,
    assert_masters_follow_torch,
    assert_param_groups_follow_torch,
    assert_tensor_lr_equals_float_lr,
    fp32_copies,
    make_params,
    random_grads,
    run,
    step_on_fresh_grads,
    step_on_some_grads,
)


def assert_moved(params, initial):
    for p, p0 in zip(params, initial):
        if p.numel():
            assert not torch.equal(p.detach(), p0), "the step left a parameter unchanged"


# against torch.optim, fp32 -----------------------------------------------------------------


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_fp32_matches_torch(device, adam_w_mode, weight_decay):
    params = make_params(torch.float32, device)
    twins = fp32_copies(params)
    eps = L2_EPS if weight_decay and not adam_w_mode else 1e-7
    hyper = dict(lr=2e-3, betas=(0.8, 0.95), eps=eps, weight_decay=weight_decay)
    ours = FusedAdam(params, adam_w_mode=adam_w_mode, **hyper)
    theirs = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(twins, **hyper)
    initial = [p.detach().clone() for p in params]
    run(ours, theirs, params, twins)
    assert_moved(params, initial)
    for p, t in zip(params, twins):
        torch.testing.assert_close(p, t, **FP32_TOL)
        ours_state, their_state = ours.state[p], theirs.state[t]
        torch.testing.assert_close(ours_state["exp_avg"], their_state["exp_avg"], **FP32_TOL)
        torch.testing.assert_close(ours_state["exp_avg_sq"], their_state["exp_avg_sq"], **FP32_TOL)
        assert float(ours_state["step"]) == float(their_state["step"]) == STEPS


def test_param_groups_keep_their_own_hyperparameters(device):
    group_a = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
    group_b = dict(lr=1e-2, betas=(0.5, 0.9), eps=1e-8, weight_decay=0.0)
    assert_param_groups_follow_torch(FusedAdam, torch.optim.AdamW, device, group_a, group_b, lr=1.0, weight_decay=0.5)


def test_parameters_with_their_own_step_counts(device):
    # One bucket, three step counts: a parameter with a gradient every step, one that joins
    # late, one that skips steps. Bias corrections follow each parameter's own count, as in
    # torch.optim.
    params = make_params(torch.float32, device, [(7,), (33, 5), (300,)])
    twins = fp32_copies(params)
    hyper = dict(lr=1e-2, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.01)
    ours, theirs = FusedAdam(params, **hyper), torch.optim.AdamW(twins, **hyper)
    for grads in step_on_some_grads(ours, params, STAGGERED):
        for t, g in zip(twins, grads):
            t.grad = None if g is None else g.clone()
        theirs.step()
    for p, t in zip(params, twins):
        assert float(ours.state[p]["step"]) == float(theirs.state[t]["step"])
        torch.testing.assert_close(p, t, **FP32_TOL)


def adam_reference(params, grads_per_step, lr, betas, eps, weight_decay, adam_w_mode, bias_correction):
    """Adam/AdamW in float64 from the update rule in FusedAdam's docstring."""
    beta1, beta2 = betas
    thetas = [p.detach().double().clone() for p in params]
    ms = [torch.zeros_like(t) for t in thetas]
    vs = [torch.zeros_like(t) for t in thetas]
    for step, grads in enumerate(grads_per_step, start=1):
        bc1 = 1 - beta1**step if bias_correction else 1.0
        bc2 = 1 - beta2**step if bias_correction else 1.0
        for i, g in enumerate(grads):
            g = g.double()
            if adam_w_mode:
                thetas[i] = thetas[i] * (1 - lr * weight_decay)
            else:
                g = g + weight_decay * thetas[i]
            ms[i] = beta1 * ms[i] + (1 - beta1) * g
            vs[i] = beta2 * vs[i] + (1 - beta2) * g * g
            thetas[i] = thetas[i] - lr / bc1 * ms[i] / (vs[i].sqrt() / bc2**0.5 + eps)
    return thetas


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fp32_matches_float64_reference(device, bias_correction, adam_w_mode):
    params = make_params(torch.float32, device)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8 if adam_w_mode else L2_EPS, weight_decay=0.02)
    ours = FusedAdam(params, bias_correction=bias_correction, adam_w_mode=adam_w_mode, **hyper)
    initial = [p.detach().clone() for p in params]
    history = step_on_fresh_grads(ours, params)
    expected = adam_reference(initial, history, adam_w_mode=adam_w_mode, bias_correction=bias_correction, **hyper)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.double(), e, **FP32_TOL)


# fp16 / bf16 -------------------------------------------------------------------------------


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_mixed_dtypes_in_one_group_follow_fp32_emulation(device, adam_w_mode):
    params = [p for dtype in (torch.float32, *REDUCED) for p in make_params(dtype, device)]
    twins = fp32_copies(params)
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8 if adam_w_mode else L2_EPS, weight_decay=0.05)
    ours = FusedAdam(params, adam_w_mode=adam_w_mode, **hyper)
    theirs = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(twins, **hyper)
    initial = [p.detach().clone() for p in params]
    peaks = run(ours, theirs, params, twins, round_twins=True)
    assert_moved(params, initial)
    for p, t, peak in zip(params, twins, peaks):
        assert_follows_emulation(p, t, peak)
        state = ours.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        assert "master_param" not in state
        # moments see the same gradients; parameters a rounding apart only through weight decay
        torch.testing.assert_close(state["exp_avg"], theirs.state[t]["exp_avg"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state["exp_avg_sq"], theirs.state[t]["exp_avg_sq"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", REDUCED)
def test_master_weights_follow_fp32_adamw(device, dtype):
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    ours, reduced = assert_masters_follow_torch(FusedAdam, torch.optim.AdamW, dtype, device, **hyper)
    # the masters hold what rounding to the parameter dtype drops
    big = reduced[-1]
    assert not torch.equal(ours.state[big]["master_param"], big.detach().float())


# learning rate as a tensor, capturable ------------------------------------------------------


def test_tensor_lr_equals_float_lr(device):
    assert_tensor_lr_equals_float_lr(FusedAdam, device, 3e-3, weight_decay=0.01)


@pytest.mark.parametrize("master_weights", [False, True])
def test_capturable_equals_default(device, master_weights):
    params = make_params(torch.float32, device) + make_params(torch.bfloat16, device, [(7,), (300,)])
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    capturable = FusedAdam(params, lr=1e-2, weight_decay=0.01, capturable=True, master_weights=master_weights)
    default = FusedAdam(twins, lr=1e-2, weight_decay=0.01, master_weights=master_weights)
    peaks = run(capturable, default, params, twins, steps=5)
    for p, t, peak in zip(params, twins, peaks):
        assert_follows_emulation(p, t, peak)
        step = capturable.state[p]["step"]
        assert float(step) == 5.0
        if device == "cuda":
            assert step.device == p.device, "a capturable step count lives on the parameter's device"


@pytest.mark.gpu
@pytest.mark.parametrize("master_weights", [False, True])
def test_capturable_step_replayed_in_cuda_graph_equals_eager(master_weights):
    shapes = [(1,), (7,), (33, 5), (70001,)]
    params = make_params(torch.float32, "cuda", shapes) + make_params(torch.bfloat16, "cuda", shapes)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    lr, eager_lr = torch.tensor(1e-2, device="cuda"), torch.tensor(1e-2, device="cuda")
    graphed = FusedAdam(params, lr=lr, weight_decay=0.01, capturable=True, master_weights=master_weights)
    eager = FusedAdam(twins, lr=eager_lr, weight_decay=0.01, capturable=True, master_weights=master_weights)
    for p in params:
        p.grad = torch.zeros_like(p)
    schedule = [1e-2, 1e-2, 1e-2, 5e-3, 5e-3, 2e-3, 2e-3, 1e-3, 1e-3, 1e-3]
    history = [random_grads(params) for _ in schedule]

    def load(step):
        lr.fill_(schedule[step])
        for p, g in zip(params, history[step]):
            p.grad.copy_(g)

    warmup = 3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(warmup):
            load(step)
            graphed.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()  # recorded, not run
    for step in range(warmup, len(schedule)):
        load(step)
        graph.replay()

    for step, grads in enumerate(history):
        eager_lr.fill_(schedule[step])
        for t, g in zip(twins, grads):
            t.grad = g.clone()
        eager.step()
    torch.cuda.synchronize()
    for p, t in zip(params, twins):
        assert_follows_emulation(p, t, t.detach().abs())
        for key, value in eager.state[t].items():
            torch.testing.assert_close(graphed.state[p][key], value, **FP32_TOL)
    assert float(graphed.state[params[0]]["step"]) == len(schedule)


# arguments ---------------------------------------------------------------------------------


def test_amsgrad_raises():
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([torch.nn.Parameter(torch.randn(3))], amsgrad=True)


@pytest.mark.parametrize(
    "kwargs",
    [dict(lr=-1e-3), dict(eps=-1.0), dict(betas=(1.0, 0.999)), dict(betas=(0.9, -0.1)), dict(weight_decay=-0.1)],
)
def test_invalid_hyperparameters_raise(kwargs):
    with pytest.raises(ValueError, match="FusedAdam: invalid"):
        FusedAdam([torch.nn.Parameter(torch.randn(3))], **kwargs)
