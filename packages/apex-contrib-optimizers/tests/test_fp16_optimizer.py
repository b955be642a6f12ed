"""The contrib FP16_Optimizer end to end on a small fp16 model: the masters follow the float64 math on
the unscaled gradients, the model weights are the rounded masters, overflows skip the step and lower
the scale, state_dict round trips."""

from __future__ import annotations

import copy

import pytest
import torch

from apex.contrib.optimizers import FP16_Optimizer, FusedAdam, FusedSGD

from ._reference import ContribAdam, ReferenceSGD, assert_close

ADAM = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)


def half_model(device, dtype=torch.float16):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device, dtype)


def batch(device, dtype=torch.float16):
    return torch.randn(8, 16, device=device).to(dtype), torch.randn(8, 4, device=device).to(dtype)


def loss_of(model, x, y):
    return (model(x).float() - y.float()).square().mean()


@pytest.mark.parametrize("kind", ["adam", "adam_eps_inside_sqrt", "sgd"])
def test_fp16_optimizer_follows_float64_with_a_static_scale(device, kind):
    model = half_model(device)
    params = list(model.parameters())
    if kind == "sgd":
        inner = FusedSGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    else:
        inner = FusedAdam(params, eps_inside_sqrt=kind == "adam_eps_inside_sqrt", **ADAM)
    opt = FP16_Optimizer(inner, static_loss_scale=128.0, verbose=False)
    masters = [m for g in opt.fp32_groups for m in g]
    assert all(m.dtype == torch.float32 for m in masters)
    assert opt.param_groups[0]["params"] == masters
    if kind == "sgd":
        ref = ReferenceSGD(masters, lr=0.1, momentum=0.9, dampening=0, weight_decay=0.01, nesterov=False,
                           wd_after_momentum=False)  # fmt: skip
    else:
        ref = ContribAdam(masters, eps_inside_sqrt=kind == "adam_eps_inside_sqrt", **ADAM)
    for _ in range(4):
        opt.zero_grad()
        opt.backward(loss_of(model, *batch(device)))
        grads = [p.grad.clone() for p in params]
        opt.step()
        ref.step(grads, divisor=128.0)
        for master, p, expected in zip(masters, params, ref.p):
            assert_close(master, expected, torch.float32)
            assert torch.equal(p.detach(), master.half())
    assert opt.cur_iter == 4 and opt.cur_scale == 128.0


class ToFloat(torch.nn.Module):
    def forward(self, x):
        return x.float()


def test_mixed_fp16_and_fp32_model(device):
    # An fp16 layer and an fp32 head: one group's norm over both dtypes; the fp32 weights move too.
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32).to(device, torch.float16), torch.nn.Tanh(), ToFloat(),
                                torch.nn.Linear(32, 4).to(device))  # fmt: skip
    params = list(model.parameters())
    opt = FP16_Optimizer(FusedAdam(params, **ADAM), static_loss_scale=16.0, verbose=False)
    masters = opt.fp32_groups[0]
    ref = ContribAdam(masters, eps_inside_sqrt=False, **ADAM)
    for _ in range(3):
        opt.zero_grad()
        opt.backward(loss_of(model, *batch(device)))
        grads = [p.grad.clone() for p in params]
        opt.step()
        ref.step(grads, divisor=16.0)
    for master, p, expected in zip(masters, params, ref.p):
        assert_close(master, expected, torch.float32)
        assert torch.equal(p.detach(), master.to(p.dtype))
    assert {p.dtype for p in params} == {torch.float16, torch.float32}


def test_dynamic_scale_skips_overflowing_steps_and_lowers_the_scale(device, capsys):
    model = half_model(device)
    params = list(model.parameters())
    opt = FP16_Optimizer(FusedAdam(params, **ADAM), dynamic_loss_scale=True)
    assert opt.cur_scale == 2.0**16
    masters_before = [m.clone() for g in opt.fp32_groups for m in g]
    model_before = [p.detach().clone() for p in params]
    opt.zero_grad()
    opt.backward(loss_of(model, *batch(device)) * 1e6)  # the scaled fp16 gradients overflow
    assert not all(bool(torch.isfinite(p.grad).all()) for p in params)
    opt.step()
    assert "Grad overflow on iteration 0" in capsys.readouterr().out
    assert opt.cur_scale == 2.0**15 and opt.cur_iter == 1
    for before, master in zip(masters_before, [m for g in opt.fp32_groups for m in g]):
        assert torch.equal(before, master)
    for before, p in zip(model_before, params):
        assert torch.equal(before, p.detach())
    assert all(not s for s in opt.state.values())
    assert (opt.last_overflow_iter, opt.scale_factor, opt.scale_window) == (0, 2.0, 1000)  # upstream's attributes
    # A small loss fits: the step is taken, the scale stays until scale_window clean steps.
    opt.scale_window = 2
    opt.zero_grad()
    opt.backward(loss_of(model, *batch(device)) * 1e-3)
    opt.step()
    assert opt.cur_iter == 2 and opt.cur_scale == 2.0**15
    assert not torch.equal(model_before[0], params[0].detach())
    opt.zero_grad()
    opt.backward(loss_of(model, *batch(device)) * 1e-3)
    opt.step()
    assert opt.cur_scale == 2.0**16  # (3 - 1) % 2 == 0: grew


def test_state_dict_round_trip(device):
    model = half_model(device)
    opt = FP16_Optimizer(FusedAdam(model.parameters(), **ADAM), dynamic_loss_scale=True, verbose=False)
    data = [batch(device) for _ in range(4)]
    for x, y in data[:2]:
        opt.zero_grad()
        opt.backward(loss_of(model, x, y))
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert {"dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window",
            "optimizer_state_dict", "fp32_groups"} <= set(saved)  # fmt: skip
    twin = half_model(device)
    twin.load_state_dict(model.state_dict())
    resumed = FP16_Optimizer(FusedAdam(twin.parameters(), lr=0.5), verbose=False)
    resumed.load_state_dict(saved)
    assert resumed.dynamic_loss_scale and resumed.cur_scale == opt.cur_scale and resumed.cur_iter == opt.cur_iter
    for x, y in data[2:]:
        for o, m in ((opt, model), (resumed, twin)):
            o.zero_grad()
            o.backward(loss_of(m, x, y))
            o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt.fp32_groups[0], resumed.fp32_groups[0]):
        assert torch.equal(a, b)


def test_bad_arguments():
    model = half_model("cpu")
    with pytest.raises(SystemError, match="dynamic_loss_args"):
        FP16_Optimizer(FusedAdam(model.parameters()), dynamic_loss_scale=True, dynamic_loss_args={"scale_window": 5})
    with pytest.raises(TypeError, match=r"init_optimizer must be a torch.optim.Optimizer"):
        FP16_Optimizer(model.parameters())
    opt = FP16_Optimizer(FusedAdam(model.parameters()), verbose=False)
    with pytest.raises(AttributeError, match="static loss scale has no attribute 'scale_window'"):
        opt.scale_window  # noqa: B018
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(closure=lambda: 0.0)
