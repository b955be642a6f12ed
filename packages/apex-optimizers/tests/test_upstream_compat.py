"""Code written against upstream Apex's optimizers, and hostile input (issue 18).

lr from the parameter groups, fp16 FusedSGD against torch's, ``maximize=``, unscaled gradients
after a GradScaler step, channels-last and other dense layouts, float64 Adam/Adagrad, FusedAdam's
upstream attributes (``group["step"]``, ``param_groups_master``, ``step(grad_scaler=)``) and a
subclass written against them, invalid hyperparameters, a state dict of another optimizer class,
meta parameters.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch.optim.optimizer import required

from apex.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

CLASSES = [FusedAdam, FusedLAMB, FusedMixedPrecisionLamb, FusedSGD, FusedNovoGrad, FusedAdagrad]


def _param(device="cpu", shape=(5, 3), dtype=torch.float32):
    return torch.nn.Parameter(torch.randn(shape, dtype=torch.float64).to(dtype=dtype, device=device))


# lr from the parameter groups --------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_lr_comes_from_the_param_groups_without_a_constructor_lr(cls):
    a, b = _param(), _param()
    optimizer = cls([{"params": [a], "lr": 0.25}, {"params": [b], "lr": 0.5}])
    lrs = [float(g["lr"].reshape(()) if isinstance(g["lr"], torch.Tensor) else g["lr"]) for g in optimizer.param_groups]
    assert lrs == [0.25, 0.5]
    for p in (a, b):
        p.grad = torch.randn_like(p)
    optimizer.step()


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_param_group_lr_wins_over_the_constructor_lr(cls):
    a, b = _param(), _param()
    optimizer = cls([{"params": [a], "lr": 0.25}, {"params": [b]}], lr=0.125)
    lrs = [float(g["lr"].reshape(()) if isinstance(g["lr"], torch.Tensor) else g["lr"]) for g in optimizer.param_groups]
    assert lrs == [0.25, 0.125]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_lr_none_takes_each_groups_lr_and_a_group_without_one_raises(cls):
    optimizer = cls([{"params": [_param()], "lr": 0.25}], lr=None)
    lr = optimizer.param_groups[0]["lr"]
    assert float(lr.reshape(()) if isinstance(lr, torch.Tensor) else lr) == 0.25
    with pytest.raises(ValueError, match="lr"):
        cls([_param()], lr=None)


def test_fused_sgd_without_any_lr_raises_as_torch_does():
    assert FusedSGD.__init__.__defaults__[0] is required
    with pytest.raises(ValueError, match="lr"):
        FusedSGD([_param()])
    with pytest.raises(ValueError, match="lr"):
        FusedSGD([{"params": [_param()], "lr": 0.1}, {"params": [_param()]}])


# fp16 FusedSGD against torch.optim.SGD on the same fp16 parameters -------------------------


@pytest.mark.parametrize(
    "hyper",
    [
        dict(momentum=0.9),
        dict(momentum=0.9, nesterov=True, weight_decay=1e-2),
        dict(momentum=0.9, dampening=0.5, weight_decay=1e-3),
    ],
    ids=["momentum", "nesterov-wd", "dampening-wd"],
)
def test_fused_sgd_fp16_many_steps_stays_finite_and_follows_torch(device, hyper):
    torch.manual_seed(0)
    params = [_param(device, s, torch.float16) for s in [(64,), (33, 7), (4099,)]]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = FusedSGD(params, lr=0.01, **hyper)
    theirs = torch.optim.SGD(twins, lr=0.01, foreach=False, **hyper)
    for _ in range(200):
        grads = [torch.randn_like(p) for p in params]
        for p, t, g in zip(params, twins, grads):
            p.grad, t.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for p, t in zip(params, twins):
        assert torch.isfinite(p).all()
        # torch keeps its momentum in fp16, we keep ours in fp32: the two part by a few fp16
        # roundings, measured against the largest magnitude. (An element-wise relative difference
        # is no measure here: elements pass through zero, where it is infinite or huge although
        # both are a unit in the last place apart; that was the "infinite difference" reported.)
        gap = (p.double() - t.double()).abs().max()
        bound = 8 * torch.finfo(torch.float16).eps * t.double().abs().max()
        assert gap <= bound, f"{gap} apart, more than {bound}"


# maximize= ---------------------------------------------------------------------------------

MAXIMIZE = [
    (lambda ps, **kw: FusedAdam(ps, lr=1e-2, adam_w_mode=False, weight_decay=0.01, **kw), torch.optim.Adam),
    (lambda ps, **kw: FusedAdam(ps, lr=1e-2, weight_decay=0.01, **kw), torch.optim.AdamW),
    (lambda ps, **kw: FusedSGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01, **kw), torch.optim.SGD),
    (lambda ps, **kw: FusedAdagrad(ps, lr=1e-2, weight_decay=0.01, **kw), torch.optim.Adagrad),
]


@pytest.mark.parametrize("case", range(len(MAXIMIZE)), ids=["Adam", "AdamW", "SGD", "Adagrad"])
def test_maximize_follows_torch(device, case):
    factory, torch_cls = MAXIMIZE[case]
    params = [_param(device, s) for s in [(7,), (33, 5)]]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = factory(params, maximize=True)
    kw = {"lr": 1e-2, "weight_decay": 0.01, "maximize": True}
    if torch_cls is torch.optim.SGD:
        kw["momentum"] = 0.9
    theirs = torch_cls(twins, **kw)
    assert ours.param_groups[0]["maximize"] is True
    for _ in range(5):
        for p, t in zip(params, twins):
            g = torch.randn_like(p)
            p.grad, t.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for p, t in zip(params, twins):
        torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [FusedLAMB, FusedNovoGrad, FusedMixedPrecisionLamb], ids=lambda c: c.__name__)
def test_maximize_is_not_offered_where_torch_has_no_such_optimizer(cls):
    with pytest.raises(TypeError, match="maximize"):
        cls([_param()], maximize=True)


# GradScaler leaves unscaled gradients ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("capturable", [False, True])
def test_grad_scaler_step_leaves_unscaled_grads(device, dtype, capturable):
    params = [_param(device, s, dtype) for s in [(7,), (33, 5)]]
    optimizer = FusedAdam(params, lr=1e-3, capturable=capturable)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = scaler.scale(g)
    scaler.step(optimizer)
    scaler.update()
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g)


def test_grad_scale_handed_over_as_attributes_also_leaves_unscaled_grads(device):
    """torch's newer protocol (grad_scale / found_inf set on the optimizer) takes the same path."""
    p = _param(device)
    twin = torch.nn.Parameter(p.detach().clone())
    g = torch.randn_like(p)
    ours, theirs = FusedAdam([p], lr=1e-2), FusedAdam([twin], lr=1e-2)
    p.grad, twin.grad = g * 1024.0, g.clone()
    ours.grad_scale = torch.tensor(1024.0, device=device)
    ours.found_inf = torch.tensor(0.0, device=device)
    ours.step()
    theirs.step()
    assert torch.equal(p.grad, g)
    torch.testing.assert_close(p, twin)


# channels-last and other dense layouts -----------------------------------------------------


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3)
        self.conv2 = torch.nn.Conv2d(8, 4, 3)
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(x.mean((2, 3)))


CHANNELS_LAST = {
    "FusedAdam": (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01), lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
    "FusedSGD": (
        lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    ),
    "FusedAdagrad": (lambda ps: FusedAdagrad(ps, lr=1e-2), lambda ps: torch.optim.Adagrad(ps, lr=1e-2)),
    # no torch LAMB or NovoGrad: against ours on a contiguous copy of the model
    "FusedLAMB": (lambda ps: FusedLAMB(ps, lr=1e-2), lambda ps: FusedLAMB(ps, lr=1e-2)),
    "FusedMixedPrecisionLamb": (
        lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2),
        lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2),
    ),
    "FusedNovoGrad": (lambda ps: FusedNovoGrad(ps, lr=1e-2), lambda ps: FusedNovoGrad(ps, lr=1e-2)),
}


@pytest.mark.parametrize("name", list(CHANNELS_LAST))
def test_channels_last_conv_net_follows_a_contiguous_one(device, name):
    ours_factory, theirs_factory = CHANNELS_LAST[name]
    torch.manual_seed(0)
    model = ConvNet().to(device)
    twin = ConvNet().to(device)
    twin.load_state_dict(model.state_dict())
    model = model.to(memory_format=torch.channels_last)
    assert not model.conv1.weight.is_contiguous()
    ours, theirs = ours_factory(list(model.parameters())), theirs_factory(list(twin.parameters()))
    for _ in range(4):
        x = torch.randn(2, 3, 9, 9, device=device)
        for m, opt, inp in ((model, ours, x.to(memory_format=torch.channels_last)), (twin, theirs, x)):
            opt.zero_grad()
            m(inp).square().sum().backward()
        # The optimizers get the same gradients, each in its model's layout (cuDNN's channels-last
        # and contiguous convolutions round differently, and the runs would drift apart).
        for p, t in zip(model.parameters(), twin.parameters()):
            assert p.grad.stride() == p.stride()
            p.grad.copy_(t.grad)
        ours.step()
        theirs.step()
    assert not model.conv1.weight.is_contiguous()
    for p, t in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, t, rtol=1e-4, atol=1e-5)


def test_strided_view_parameters_are_refused_with_the_list_and_index():
    base = torch.randn(6, 8)
    view = torch.nn.Parameter(base[:, ::2])  # gaps: neither contiguous nor dense
    view.grad = torch.randn(6, 8)[:, ::2]
    optimizer = FusedAdam([_param(), view])
    with pytest.raises(ValueError, match=r"FusedAdam: param_groups\[0\]\['params'\]\[1\] is not contiguous"):
        optimizer.step()
    optimizer = FusedAdam([_param(), torch.nn.Parameter(torch.randn(4, 6))])
    optimizer.param_groups[0]["params"][1].grad = torch.randn(6, 4).t()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] has strides"):
        optimizer.step()


# float64 Adam and Adagrad ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01), lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
        (
            lambda ps: FusedAdam(ps, lr=1e-2, adam_w_mode=False, weight_decay=0.01),
            lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01),
        ),
        (lambda ps: FusedAdagrad(ps, lr=1e-2), lambda ps: torch.optim.Adagrad(ps, lr=1e-2)),
    ],
    ids=["AdamW", "Adam", "Adagrad"],
)
def test_float64_adam_and_adagrad_follow_torch(device, ours, theirs):
    params = [_param(device, s, torch.float64) for s in [(7,), (33, 5), (70001,)]]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    a, b = ours(params), theirs(twins)
    for _ in range(5):
        for p, t in zip(params, twins):
            g = torch.randn_like(p)
            p.grad, t.grad = g.clone(), g.clone()
        a.step()
        b.step()
    for p, t in zip(params, twins):
        assert p.dtype == torch.float64
        # the state is fp32 as for every dtype (upstream's too): fp32 rounding of the update
        torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-6)


# FusedAdam as upstream's: group["step"], attributes, step(grad_scaler=), subclasses ---------


def test_fused_adam_exposes_upstreams_attributes():
    p16, p32 = _param(dtype=torch.float16), _param()
    optimizer = FusedAdam([p16, p32], master_weights=True, capturable=True)
    assert optimizer.adam_w_mode and optimizer.capturable and optimizer.master_weights
    assert optimizer._dummy_overflow_buf.dtype == torch.int32 and optimizer._dummy_overflow_buf.numel() == 1
    (masters,) = optimizer.param_groups_master
    assert masters["params"][0].dtype == torch.float32 and torch.equal(masters["params"][0], p16.float())
    assert masters["params"][1] is p32
    assert FusedAdam([_param()]).param_groups_master == [{"params": [None]}]


def test_group_step_counts_steps_and_a_written_step_is_used():
    p = _param()
    optimizer = FusedAdam([p], lr=1e-2)
    twin = torch.nn.Parameter(p.detach().clone())
    reference = torch.optim.AdamW([twin], lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        g = torch.randn_like(p)
        p.grad, twin.grad = g.clone(), g.clone()
        optimizer.step()
        reference.step()
    assert optimizer.param_groups[0]["step"] == 3
    # Megatron's distributed optimizer writes the step (e.g. when it loads a checkpoint)
    optimizer.param_groups[0]["step"] = 10
    reference.state[twin]["step"].fill_(10.0)
    g = torch.randn_like(p)
    p.grad, twin.grad = g.clone(), g.clone()
    optimizer.step()
    reference.step()
    assert optimizer.param_groups[0]["step"] == 11
    assert float(optimizer.state[p]["step"]) == 11.0
    torch.testing.assert_close(p, twin)


def test_state_made_without_a_step_takes_the_group_step():
    """Megatron's init_state_fn creates exp_avg and exp_avg_sq only, and loads the step into the group."""
    p = _param()
    optimizer = FusedAdam([p], lr=1e-2)
    optimizer.state[p]["exp_avg"] = torch.zeros_like(p)
    optimizer.state[p]["exp_avg_sq"] = torch.zeros_like(p)
    optimizer.param_groups[0]["step"] = 4
    p.grad = torch.randn_like(p)
    optimizer.step()
    assert optimizer.param_groups[0]["step"] == 5 and float(optimizer.state[p]["step"]) == 5.0


def test_an_upstream_fused_adam_state_dict_loads_with_its_group_step():
    """Upstream keeps the step in the group only: its state dicts have no per-parameter step."""
    p = _param()
    twin = torch.nn.Parameter(p.detach().clone())
    reference = torch.optim.AdamW([twin], lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        twin.grad = torch.randn_like(twin)
        reference.step()
    saved = reference.state[twin]
    upstream = {
        "state": {0: {"exp_avg": saved["exp_avg"].clone(), "exp_avg_sq": saved["exp_avg_sq"].clone()}},
        "param_groups": [
            dict(lr=1e-2, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, step=3, params=[0])
        ],
    }
    with torch.no_grad():
        p.copy_(twin)
    optimizer = FusedAdam([p], lr=1e-2)
    optimizer.load_state_dict(upstream)
    g = torch.randn_like(p)
    p.grad, twin.grad = g.clone(), g.clone()
    optimizer.step()
    reference.step()
    assert optimizer.param_groups[0]["step"] == 4
    torch.testing.assert_close(p, twin)


class ClippingFusedAdam(FusedAdam):
    """Written against upstream's FusedAdam as NeMo's MegatronFusedAdam is: it overrides step,
    reads upstream's attributes and hands closure and grad_scaler on."""

    def __init__(self, *args, max_norm=0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_norm = max_norm
        self.seen = []

    def step(self, closure=None, grad_scaler=None):
        self.seen.append((self.adam_w_mode, self.capturable, self.master_weights, self._dummy_overflow_buf.item()))
        for group, group_master in zip(self.param_groups, self.param_groups_master):
            assert len(group_master["params"]) == len(group["params"])
            if self.max_norm > 0:
                torch.nn.utils.clip_grad_norm_(group["params"], self.max_norm)
        return super().step(closure=closure, grad_scaler=grad_scaler)


@pytest.mark.parametrize("scaled", [False, True])
def test_a_subclass_written_against_upstream_works(device, scaled):
    params = [_param(device, s) for s in [(7,), (33, 5)]]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = ClippingFusedAdam(params, lr=1e-2, max_norm=0.5, capturable=True)
    reference = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.0)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**8) if scaled else None
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, t, g in zip(params, twins, grads):
            p.grad = scaler.scale(g) if scaled else g.clone()
            t.grad = g.clone()
        if scaled:
            scaler.unscale_(ours)
            scaler.step(ours)
            scaler.update()
        else:
            ours.step()
        torch.nn.utils.clip_grad_norm_(twins, 0.5)
        reference.step()
    assert len(ours.seen) == 3 and ours.seen[0][:3] == (True, True, False)
    for p, t in zip(params, twins):
        torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)
    assert int(ours.param_groups[0]["step"]) == 3


def test_step_takes_grad_scaler_positionally_and_by_name():
    p = _param()
    optimizer = FusedAdam([p])
    p.grad = torch.randn_like(p)
    optimizer.step(None, None)
    optimizer.step(closure=None, grad_scaler=None)
    assert optimizer.param_groups[0]["step"] == 2


def test_isinstance_after_a_bare_import_apex():
    code = (
        "import apex\n"
        "import torch\n"
        "assert hasattr(apex, 'optimizers')\n"
        "opt = apex.optimizers.FusedAdam([torch.nn.Parameter(torch.zeros(2))])\n"
        "from apex.optimizers import FusedAdam\n"
        "assert isinstance(opt, apex.optimizers.FusedAdam) and isinstance(opt, FusedAdam)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# invalid hyperparameters -------------------------------------------------------------------

NAN = math.nan
INVALID = [
    (FusedNovoGrad, dict(lr=-1.0), "lr"),
    (FusedNovoGrad, dict(lr=NAN), "lr"),
    (FusedNovoGrad, dict(eps=-1.0), "eps"),
    (FusedNovoGrad, dict(weight_decay=-1.0), "weight_decay"),
    (FusedNovoGrad, dict(betas=(1.5, 0.999)), "betas"),
    (FusedNovoGrad, dict(betas=(-0.1, 0.999)), "betas"),
    (FusedNovoGrad, dict(betas=(0.9, NAN)), "betas"),
    (FusedLAMB, dict(lr=NAN), "lr"),
    (FusedLAMB, dict(eps=-1.0), "eps"),
    (FusedLAMB, dict(weight_decay=-1.0), "weight_decay"),
    (FusedMixedPrecisionLamb, dict(lr=NAN), "lr"),
    (FusedMixedPrecisionLamb, dict(eps=-1.0), "eps"),
    (FusedMixedPrecisionLamb, dict(weight_decay=-1.0), "weight_decay"),
    (FusedMixedPrecisionLamb, dict(reduced_precision_dtype=torch.int8), "reduced_precision_dtype"),
    (FusedAdagrad, dict(lr=NAN), "lr"),
    (FusedAdagrad, dict(eps=NAN), "eps"),
    (FusedAdam, dict(lr=NAN), "lr"),
    (FusedAdam, dict(eps=NAN), "eps"),
    (FusedSGD, dict(lr=NAN), "lr"),
    (FusedSGD, dict(lr=0.1, momentum=NAN), "momentum"),
    (FusedSGD, dict(lr=0.1, weight_decay=NAN), "weight_decay"),
    (FusedSGD, dict(lr=0.1, dampening=NAN), "dampening"),
]


@pytest.mark.parametrize(
    ("cls", "kwargs", "argument"), INVALID, ids=[f"{c.__name__}-{a}-{list(k.values())[-1]}" for c, k, a in INVALID]
)
def test_invalid_hyperparameters_are_refused(cls, kwargs, argument):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: invalid .*\b{argument}="):
        cls([_param()], **kwargs)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_non_number_lr_is_a_type_error(cls):
    with pytest.raises(TypeError, match=r"lr"):
        cls([_param()], lr="0.1")


# a state dict of another class, meta parameters --------------------------------------------


@pytest.mark.parametrize(
    ("source", "target"),
    [
        (lambda ps: FusedAdam(ps), lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9)),
        (lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9), lambda ps: FusedAdam(ps)),
        (lambda ps: FusedAdagrad(ps), lambda ps: FusedNovoGrad(ps)),
        (lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9), lambda ps: FusedAdagrad(ps)),
    ],
    ids=["Adam-into-SGD", "SGD-into-Adam", "Adagrad-into-NovoGrad", "SGD-into-Adagrad"],
)
def test_a_state_dict_of_another_optimizer_class_is_refused_at_load(source, target):
    p = _param()
    first = source([p])
    p.grad = torch.randn_like(p)
    first.step()
    second = target([p])
    name = type(second).__name__
    with pytest.raises(ValueError, match=rf"{name}.load_state_dict: .*'\w+'"):
        second.load_state_dict(first.state_dict())


def test_a_state_dict_saved_before_maximize_existed_loads():
    p = _param()
    optimizer = FusedAdam([p])
    p.grad = torch.randn_like(p)
    optimizer.step()
    state = optimizer.state_dict()
    del state["param_groups"][0]["maximize"]
    resumed = FusedAdam([p])
    resumed.load_state_dict(state)
    assert resumed.param_groups[0]["maximize"] is False
    resumed.step()


def test_a_state_missing_a_key_names_it_at_load():
    p = _param()
    optimizer = FusedAdagrad([p])
    p.grad = torch.randn_like(p)
    optimizer.step()
    state = optimizer.state_dict()
    del state["state"][0]["sum"]
    with pytest.raises(ValueError, match=r"FusedAdagrad.load_state_dict: .*'sum'"):
        FusedAdagrad([p]).load_state_dict(state)


def test_a_meta_parameter_beside_cpu_ones_is_refused_by_name():
    cpu, meta = _param(), _param("meta")
    cpu.grad, meta.grad = torch.randn_like(cpu), torch.randn_like(meta)
    optimizer = FusedAdam([cpu, meta])
    with pytest.raises(ValueError, match=r"FusedAdam: param_groups\[0\]\['params'\]\[1\] is on the meta device"):
        optimizer.step()
