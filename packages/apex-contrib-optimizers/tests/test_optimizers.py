"""The deprecated contrib FusedAdam, FusedSGD and FusedLAMB against float64 references of their math,
over several steps, with the legacy explicit-grads step (output params, loss scale, norm clipping)."""

from __future__ import annotations

import copy

import pytest
import torch

from apex.contrib.optimizers import FusedAdam, FusedLAMB, FusedSGD

from ._reference import (
    REDUCED,
    ContribAdam,
    ReferenceLAMB,
    ReferenceSGD,
    assert_close,
    make_grads,
    make_params,
)

STEPS = 3
ADAM = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6)


# FusedAdam ----------------------------------------------------------------------------------


@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, *REDUCED, torch.float64])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_fused_adam_matches_float64(device, dtype, eps_inside_sqrt, weight_decay):
    params = make_params(dtype, device)
    ref = ContribAdam(params, weight_decay=weight_decay, eps_inside_sqrt=eps_inside_sqrt, **ADAM)
    opt = FusedAdam(params, weight_decay=weight_decay, eps_inside_sqrt=eps_inside_sqrt, **ADAM)
    for _ in range(STEPS):
        grads = make_grads(params)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        ref.step(grads, round_to=dtype)
    for p, expected in zip(params, ref.p):
        assert p.dtype == dtype
        assert_close(p, expected, dtype)
    state = opt.state[params[0]]
    assert state["step"] == STEPS
    assert state["exp_avg"].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


@pytest.mark.parametrize("bias_correction", [False, True])
def test_fused_adam_without_bias_correction(device, bias_correction):
    params = make_params(torch.float32, device, [(301,)])
    kwargs = dict(ADAM, weight_decay=0.01, bias_correction=bias_correction)
    ref = ContribAdam(params, eps_inside_sqrt=False, **kwargs)
    opt = FusedAdam(params, **kwargs)
    for _ in range(STEPS):
        grads = make_grads(params)
        opt.step(grads=grads)
        ref.step(grads)
    assert_close(params[0], ref.p[0], torch.float32)


@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
def test_explicit_grads_equal_dot_grad(device, eps_inside_sqrt):
    params_a = make_params(torch.float32, device)
    params_b = [torch.nn.Parameter(p.detach().clone()) for p in params_a]
    opt_a = FusedAdam(params_a, eps_inside_sqrt=eps_inside_sqrt, weight_decay=0.01)
    opt_b = FusedAdam(params_b, eps_inside_sqrt=eps_inside_sqrt, weight_decay=0.01)
    for _ in range(STEPS):
        grads = make_grads(params_a)
        for p, g in zip(params_a, grads):
            p.grad = g.clone()
        opt_a.step()
        opt_b.step(grads=[g.clone() for g in grads])  # one list: the only group
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert b.grad is None


@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
@pytest.mark.parametrize("out_dtype", REDUCED)
def test_output_params_are_the_rounded_masters(device, eps_inside_sqrt, out_dtype):
    masters = make_params(torch.float32, device)
    outputs = [torch.full_like(p, float("nan"), dtype=out_dtype) for p in masters]  # poisoned
    ref = ContribAdam(masters, weight_decay=0.01, eps_inside_sqrt=eps_inside_sqrt, **ADAM)
    opt = FusedAdam(masters, weight_decay=0.01, eps_inside_sqrt=eps_inside_sqrt, **ADAM)
    for _ in range(STEPS):
        grads = make_grads(masters, dtype=out_dtype)
        opt.step(grads=[grads], output_params=[outputs])  # a list per group
        ref.step(grads)
    for master, out, expected in zip(masters, outputs, ref.p):
        assert_close(master, expected, torch.float32)
        torch.testing.assert_close(out, master.detach().to(out_dtype), rtol=0, atol=0)


@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
@pytest.mark.parametrize("clipped", [False, True])
def test_scale_and_max_grad_norm_are_folded_in(device, eps_inside_sqrt, clipped):
    masters = make_params(torch.float32, device)
    loss_scale = 1024.0
    max_grad_norm = 0.5 if clipped else 1e6
    ref = ContribAdam(masters, weight_decay=0.01, eps_inside_sqrt=eps_inside_sqrt, **ADAM)
    opt = FusedAdam(masters, weight_decay=0.01, eps_inside_sqrt=eps_inside_sqrt, max_grad_norm=max_grad_norm, **ADAM)
    for _ in range(STEPS):
        grads = make_grads(masters)
        scaled = [g * loss_scale for g in grads]
        scaled_norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1).double() for g in scaled]))
        true_norm = float(scaled_norm) / loss_scale
        divisor = (true_norm + 1e-6) / max_grad_norm if clipped else 1.0
        assert divisor > 1 or not clipped
        opt.step(grads=scaled, scale=loss_scale, grad_norms=[scaled_norm.float()])
        ref.step(grads, divisor=divisor)
    for master, expected in zip(masters, ref.p):
        assert_close(master, expected, torch.float32)


def test_max_grad_norm_without_grad_norms_clips_by_the_groups_own_norm(device):
    params = make_params(torch.float32, device, [(40,), (9, 3)])
    ref = ContribAdam(params, weight_decay=0.0, eps_inside_sqrt=True, **ADAM)
    opt = FusedAdam(params, max_grad_norm=0.1, eps_inside_sqrt=True, **ADAM)
    for _ in range(STEPS):
        grads = make_grads(params)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        norm = float(torch.cat([g.reshape(-1).double() for g in grads]).norm())
        ref.step(grads, divisor=(norm + 1e-6) / 0.1)
    for p, expected in zip(params, ref.p):
        assert_close(p, expected, torch.float32)


def test_amp_stash_hands_the_legacy_arguments_over(device):
    # An amp that stashes the fp16 gradients, outputs and scale: the step takes them, the scale times
    # amp_scale_adjustment.
    from types import SimpleNamespace

    masters = make_params(torch.float32, device, [(33,), (7, 3)])
    outputs = [torch.empty_like(p, dtype=torch.float16) for p in masters]
    ref = ContribAdam(masters, weight_decay=0.0, eps_inside_sqrt=False, **ADAM)
    opt = FusedAdam(masters, amp_scale_adjustment=2.0, **ADAM)
    grads = make_grads(masters, dtype=torch.float16)
    opt._amp_stash = SimpleNamespace(grads=[[g * 16 for g in grads]], output_params=[outputs], scale=8.0,
                                     grad_norms=None)  # fmt: skip
    opt.step()
    ref.step(grads)
    for master, out, expected in zip(masters, outputs, ref.p):
        assert_close(master, expected, torch.float32)
        assert torch.equal(out, master.detach().half())


def test_fused_adam_skips_params_without_grads(device):
    params = make_params(torch.float32, device, [(5,), (6,)])
    before = params[1].detach().clone()
    opt = FusedAdam(params)
    params[0].grad = torch.randn(5, device=device)
    opt.step()
    assert torch.equal(params[1].detach(), before)
    assert params[1] not in opt.state or not opt.state[params[1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_adam_state_dict_round_trip(device, dtype):
    params = make_params(dtype, device, [(17,), (3, 4)])
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.01)
    grads = [make_grads(params) for _ in range(3)]
    for g in grads[:2]:
        opt.step(grads=g)
    saved = copy.deepcopy(opt.state_dict())
    for p, t in zip(params, twin):
        t.data.copy_(p.data)
    resumed = FusedAdam(twin, lr=0.5)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["lr"] == 1e-2
    assert resumed.state[twin[0]]["exp_avg"].dtype == torch.float32
    opt.step(grads=grads[2])
    resumed.step(grads=grads[2])
    for p, t in zip(params, twin):
        torch.testing.assert_close(p, t, rtol=0, atol=0)


BAD_ADAM = {
    "amsgrad": (dict(amsgrad=True), RuntimeError, "does not support the AMSGrad variant"),
    "negative lr": (dict(lr=-1.0), ValueError, "lr=-1.0"),
    "betas": (dict(betas=(0.9, 1.5)), ValueError, "betas"),
    "negative eps": (dict(eps=-1e-8), ValueError, "eps=-1e-08"),
    "negative weight_decay": (dict(weight_decay=-0.1), ValueError, "weight_decay=-0.1"),
    "negative max_grad_norm": (dict(max_grad_norm=-1.0), ValueError, "max_grad_norm=-1.0"),
}


@pytest.mark.parametrize("case", list(BAD_ADAM))
def test_fused_adam_bad_arguments(case):
    kwargs, error, message = BAD_ADAM[case]
    with pytest.raises(error, match=message):
        FusedAdam([torch.nn.Parameter(torch.randn(3))], **kwargs)


def test_fused_adam_bad_step_arguments():
    params = make_params(torch.float32, "cpu", [(3,), (4,)])
    opt = FusedAdam(params)
    with pytest.raises(ValueError, match="grads has 1 tensors but the group has 2"):
        opt.step(grads=[torch.randn(3)])
    with pytest.raises(ValueError, match="scale must be positive"):
        opt.step(grads=make_grads(params), scale=0.0)
    with pytest.raises(ValueError, match="grad_norms has 2 entries"):
        opt.step(grads=make_grads(params), grad_norms=[1.0, 2.0])
    half = make_params(torch.float16, "cpu", [(3,)])
    with pytest.raises(TypeError, match="output_params need fp32 parameters"):
        FusedAdam(half).step(grads=make_grads(half), output_params=[torch.empty(3, dtype=torch.float16)])
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step(grads=[torch.randn(3).to_sparse(), torch.randn(4)])


# FusedSGD -----------------------------------------------------------------------------------

SGD_CASES = {
    "plain": dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, wd_after_momentum=False),
    "momentum+wd": dict(momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=False, wd_after_momentum=False),
    "dampening": dict(momentum=0.9, dampening=0.3, weight_decay=0.0, nesterov=False, wd_after_momentum=False),
    "nesterov": dict(momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True, wd_after_momentum=False),
    "wd_after_momentum": dict(momentum=0.8, dampening=0.0, weight_decay=0.01, nesterov=False, wd_after_momentum=True),
}


@pytest.mark.parametrize("case", list(SGD_CASES))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_sgd_matches_float64(device, case, out_dtype):
    kwargs = SGD_CASES[case]
    masters = make_params(torch.float32, device)
    outputs = [torch.full_like(p, float("nan"), dtype=out_dtype) for p in masters]
    ref = ReferenceSGD(masters, lr=0.05, **kwargs)
    opt = FusedSGD(masters, lr=0.05, **kwargs)
    loss_scale = 8.0
    for _ in range(STEPS):
        grads = make_grads(masters, dtype=out_dtype)
        opt.step(grads=[g * loss_scale for g in grads], output_params=outputs, scale=loss_scale)
        ref.step(grads)
    for master, out, expected in zip(masters, outputs, ref.p):
        assert_close(master, expected, torch.float32)
        torch.testing.assert_close(out, master.detach().to(out_dtype), rtol=0, atol=0)


def test_fused_sgd_needs_grads_and_output_params():
    masters = make_params(torch.float32, "cpu", [(3,)])
    opt = FusedSGD(masters, lr=0.1)
    with pytest.raises(RuntimeError, match="provides grads"):
        opt.step()
    with pytest.raises(RuntimeError, match="provides output_params"):
        opt.step(grads=make_grads(masters))
    with pytest.raises(RuntimeError, match="all parameters require grad"):
        opt.step(grads=[None], output_params=[torch.empty(3)])
    with pytest.raises(ValueError, match="nesterov"):
        FusedSGD(masters, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="momentum=-1"):
        FusedSGD(masters, lr=0.1, momentum=-1)
    opt._amp_stash = object()
    with pytest.raises(RuntimeError, match="should not be used with AMP"):
        opt.step(grads=make_grads(masters), output_params=[torch.empty(3)])


def test_fused_sgd_state_dict_round_trip():
    masters = make_params(torch.float32, "cpu", [(9,), (2, 3)])
    twin = [torch.nn.Parameter(p.detach().clone()) for p in masters]
    outputs = [torch.empty_like(p, dtype=torch.float16) for p in masters]
    opt = FusedSGD(masters, lr=0.1, momentum=0.9)
    grads = [make_grads(masters, dtype=torch.float16) for _ in range(3)]
    opt.step(grads=grads[0], output_params=outputs)
    resumed = FusedSGD(twin, lr=0.1, momentum=0.9)
    for p, t in zip(masters, twin):
        t.data.copy_(p.data)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    twin_outputs = [o.clone() for o in outputs]
    for g in grads[1:]:
        opt.step(grads=g, output_params=outputs)
        resumed.step(grads=g, output_params=twin_outputs)
    for p, t in zip(masters, twin):
        torch.testing.assert_close(p, t, rtol=0, atol=0)


# FusedLAMB ----------------------------------------------------------------------------------


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_lamb_matches_float64(device, adam_w_mode, dtype):
    decayed = make_params(dtype, device, [(7,), (33, 5)])
    plain = make_params(dtype, device, [(4099,)])
    # eps large enough that the global clipping (a constant factor on g) shows in the update
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), eps=0.1, adam_w_mode=adam_w_mode, grad_averaging=True)
    ref = ReferenceLAMB([(decayed, 0.05), (plain, 0.0)], max_grad_norm=1.0, **kwargs)
    opt = FusedLAMB([{"params": decayed, "weight_decay": 0.05}, {"params": plain, "weight_decay": 0.0}], **kwargs)
    for _ in range(STEPS):
        grads = [make_grads(decayed), make_grads(plain)]
        for p, g in zip(decayed + plain, grads[0] + grads[1]):
            p.grad = g
        opt.step()
        ref.step(grads)
        for ps, (ref_ps, _) in zip((decayed, plain), ref.groups):
            for i, p in enumerate(ps):
                assert_close(p, ref_ps[i], dtype)
                ref_ps[i] = p.detach().double().clone()  # the next step reads the stored (rounded) value


def test_fused_lamb_signature_and_errors():
    import inspect

    names = list(inspect.signature(FusedLAMB).parameters)
    assert names == [
        "params", "lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode",
        "grad_averaging", "set_grad_none", "max_grad_norm",
    ]  # fmt: skip
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLAMB([torch.nn.Parameter(torch.randn(2))], amsgrad=True)
    assert FusedLAMB([torch.nn.Parameter(torch.randn(2))]).use_nvlamb is False


@pytest.mark.multigpu
@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
def test_fused_adam_on_the_second_gpu(eps_inside_sqrt):
    # cuda:0 is current; everything lives on cuda:1 (the loss scale tensor the step makes included).
    masters = make_params(torch.float32, "cuda:1")
    outputs = [torch.empty_like(p, dtype=torch.float16) for p in masters]
    ref = ContribAdam(masters, weight_decay=0.01, eps_inside_sqrt=eps_inside_sqrt, **ADAM)
    opt = FusedAdam(masters, weight_decay=0.01, eps_inside_sqrt=eps_inside_sqrt, **ADAM)
    for _ in range(STEPS):
        grads = make_grads(masters, dtype=torch.float16)
        opt.step(grads=[g * 64 for g in grads], output_params=outputs, scale=64.0)
        ref.step(grads)
    for master, out, expected in zip(masters, outputs, ref.p):
        assert master.device == torch.device("cuda:1")
        assert_close(master, expected, torch.float32)
        assert torch.equal(out, master.detach().half())
