"""What every fused optimizer shares, checked on each of them.

fp32/fp16/bf16 parameters in one group, parameters without gradients, zero_grad, a
state_dict that resumes bitwise, sparse gradients, float64 parameters, torch.amp.GradScaler
(unscaling inside the step, overflow skipping it), parameters on two GPUs.
"""

from __future__ import annotations

import io

import pytest
import torch

from apex.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

from ._helpers import FP32_TOL, random_grads
from ._helpers import make_params as params_of

MIXED = [torch.float32, torch.float16, torch.bfloat16]
# What torch.amp.GradScaler drives: its inf check has no bf16 CUDA kernel (bf16 needs no loss scaling).
SCALED = [torch.float32, torch.float16]
SHAPES = [(0,), (1,), (7,), (33, 5), (1000,)]

OPTIMIZERS = {
    "FusedAdam": lambda params, **kw: FusedAdam(params, lr=1e-2, weight_decay=0.01, **kw),
    "FusedAdam-master_weights": lambda params, **kw: FusedAdam(
        params, lr=1e-2, weight_decay=0.01, master_weights=True, **kw
    ),
    "FusedAdam-capturable": lambda params, **kw: FusedAdam(params, lr=1e-2, weight_decay=0.01, capturable=True, **kw),
    "FusedSGD": lambda params, **kw: FusedSGD(params, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3, **kw),
    "FusedSGD-nesterov": lambda params, **kw: FusedSGD(params, lr=0.05, momentum=0.9, nesterov=True, **kw),
    "FusedSGD-master_weights": lambda params, **kw: FusedSGD(
        params, lr=0.05, momentum=0.9, weight_decay=1e-3, master_weights=True, **kw
    ),
    "FusedAdagrad": lambda params, **kw: FusedAdagrad(params, lr=0.05, weight_decay=1e-3, **kw),
    "FusedLAMB": lambda params, **kw: FusedLAMB(params, lr=1e-2, weight_decay=0.01, **kw),
    "FusedMixedPrecisionLamb": lambda params, **kw: FusedMixedPrecisionLamb(params, lr=1e-2, weight_decay=0.01, **kw),
    "FusedNovoGrad": lambda params, **kw: FusedNovoGrad(params, lr=1e-2, weight_decay=0.01, **kw),
    "FusedNovoGrad-infinity_norm": lambda params, **kw: FusedNovoGrad(
        params, lr=1e-2, norm_type=0, init_zero=True, **kw
    ),
}
NAMES = list(OPTIMIZERS)
# Optimizers that do not count a step that a GradScaler skipped (FusedNovoGrad documents that it does).
SKIPPED_STEP_NOT_COUNTED = [name for name in NAMES if not name.startswith("FusedNovoGrad")]
# LAMB's global gradient-norm clipping couples all tensors; off, each tensor's update is its own.
UNCOUPLED = {"FusedLAMB": dict(max_grad_norm=0.0), "FusedMixedPrecisionLamb": dict(max_grad_norm=0.0)}


def make_params(device, dtypes=MIXED, shapes=SHAPES):
    return [p for dtype in dtypes for p in params_of(dtype, device, shapes)]


def clones(params, device=None):
    return [torch.nn.Parameter(p.detach().clone().to(device or p.device)) for p in params]


def tolerance(dtype):
    # The same math, but a step count on the device (GradScaler, capturable) takes fp32 bias corrections
    # where a host step takes float64 ones: fp32 rounding, and in fp16/bf16 a rounding flip.
    return FP32_TOL if dtype == torch.float32 else dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-5)


def assert_same_run(params, twins, ours, theirs):
    for p, t in zip(params, twins):
        torch.testing.assert_close(p.detach().to(t.device), t.detach(), **tolerance(p.dtype))
        assert ours.state[p].keys() == theirs.state[t].keys()
        for key, value in theirs.state[t].items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(ours.state[p][key].to(value.device), value, **FP32_TOL)


def snapshot(optimizer, params):
    return [p.detach().clone() for p in params], [
        {k: v.clone() for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor)} for p in params
    ]


# dtypes and buckets ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_mixed_dtypes_in_one_group_equal_one_optimizer_per_parameter(device, name):
    factory = OPTIMIZERS[name]
    kw = UNCOUPLED.get(name, {})
    params = make_params(device)
    twins = clones(params)
    together = factory(params, **kw)
    apart = [factory([t], **kw) for t in twins]
    for _ in range(5):
        for p, t, g in zip(params, twins, random_grads(params)):
            p.grad, t.grad = g, g.clone()
        together.step()
        for optimizer in apart:
            optimizer.step()
    for p, t, optimizer in zip(params, twins, apart):
        assert p.dtype == t.dtype
        assert_same_run([p], [t], together, optimizer)
        for key, value in together.state[p].items():
            if key != "step" and isinstance(value, torch.Tensor):
                assert value.dtype == torch.float32, f"{key} of a {p.dtype} parameter must be fp32"
                assert value.device == p.device


@pytest.mark.parametrize("name", NAMES)
def test_parameters_without_gradients_are_left_alone(device, name):
    params = make_params(device, shapes=[(7,), (33, 5)])
    frozen = params[1::2]
    before = [p.detach().clone() for p in frozen]
    optimizer = OPTIMIZERS[name](params)
    for _ in range(2):
        for p, g in zip(params[0::2], random_grads(params[0::2])):
            p.grad = g
        optimizer.step()
    for p, p0 in zip(frozen, before):
        assert torch.equal(p.detach(), p0)
        assert not optimizer.state.get(p), "no state for a parameter that never had a gradient"
    assert all(optimizer.state[p] for p in params[0::2])


@pytest.mark.parametrize("name", NAMES)
def test_closure_is_evaluated_with_grad_enabled(device, name):
    weight = torch.nn.Parameter(torch.randn(4, 3, device=device))
    inputs = torch.randn(8, 3, device=device)
    optimizer = OPTIMIZERS[name]([weight])
    before = weight.detach().clone()

    def closure():
        optimizer.zero_grad()
        loss = (inputs @ weight.t()).square().mean()
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert loss.requires_grad and weight.grad is not None
    assert not torch.equal(weight.detach(), before)


# zero_grad ---------------------------------------------------------------------------------

# upstream Apex's defaults: FusedSGD keeps zeroed gradients, the others drop them
SET_GRAD_NONE_DEFAULT = {
    "FusedAdam": True,
    "FusedSGD": False,
    "FusedAdagrad": True,
    "FusedLAMB": True,
    "FusedMixedPrecisionLamb": True,
    "FusedNovoGrad": True,
}
CLASSES = {
    "FusedAdam": FusedAdam,
    "FusedSGD": FusedSGD,
    "FusedAdagrad": FusedAdagrad,
    "FusedLAMB": FusedLAMB,
    "FusedMixedPrecisionLamb": FusedMixedPrecisionLamb,
    "FusedNovoGrad": FusedNovoGrad,
}


def _with_grads(device):
    params = make_params(device, shapes=[(5,)])
    for p, g in zip(params, random_grads(params)):
        p.grad = g
    return params


@pytest.mark.parametrize("name", list(CLASSES))
def test_zero_grad_default_and_override(device, name):
    def make(params, **kw):
        return CLASSES[name](params, lr=0.1, **kw)

    params = _with_grads(device)
    make(params).zero_grad()
    if SET_GRAD_NONE_DEFAULT[name]:
        assert all(p.grad is None for p in params)
    else:
        assert all(p.grad is not None and p.grad.count_nonzero() == 0 for p in params)

    params = _with_grads(device)
    make(params).zero_grad(set_to_none=False)
    assert all(p.grad is not None and p.grad.count_nonzero() == 0 for p in params)
    params = _with_grads(device)
    make(params).zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)

    if name != "FusedMixedPrecisionLamb":  # no set_grad_none argument: gradients are always dropped
        for set_grad_none in (False, True):
            params = _with_grads(device)
            make(params, set_grad_none=set_grad_none).zero_grad()
            if set_grad_none:
                assert all(p.grad is None for p in params)
            else:
                assert all(p.grad is not None and p.grad.count_nonzero() == 0 for p in params)


# state_dict --------------------------------------------------------------------------------


class Model(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.weights = torch.nn.ParameterList(make_params(device, shapes=[(1,), (7,), (33, 5), (1000,)]))


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_resumes_bitwise(device, name):
    factory = OPTIMIZERS[name]
    steps_before, steps_after = 3, 4
    model = Model(device)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    history = [random_grads(list(model.parameters())) for _ in range(steps_before + steps_after)]

    def step(optimizer, params, grads):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()

    # uninterrupted
    model.load_state_dict(initial)
    optimizer = factory(list(model.parameters()))
    for grads in history:
        step(optimizer, list(model.parameters()), grads)
    expected_params = [p.detach().clone() for p in model.parameters()]
    expected_state = [optimizer.state[p] for p in model.parameters()]

    # interrupted: save after a few steps, load into a fresh model and optimizer
    first = Model(device)
    first.load_state_dict(initial)
    first_optimizer = factory(list(first.parameters()))
    for grads in history[:steps_before]:
        step(first_optimizer, list(first.parameters()), grads)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_optimizer.state_dict()}, buffer)
    saved_state = {id(p): {k: v.clone() for k, v in first_optimizer.state[p].items()} for p in first.parameters()}
    saved_order = list(first.parameters())
    del first, first_optimizer
    buffer.seek(0)
    checkpoint = torch.load(buffer)

    torch.manual_seed(1234)
    resumed = Model(device)  # other initial values, overwritten by the checkpoint
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer = factory(list(resumed.parameters()))
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    for p, old in zip(resumed.parameters(), saved_order):
        loaded, saved = resumed_optimizer.state[p], saved_state[id(old)]
        assert loaded.keys() == saved.keys()
        for key, value in saved.items():
            assert loaded[key].dtype == value.dtype, f"{key} changed dtype on load"
            assert loaded[key].device == value.device, f"{key} changed device on load"
            assert torch.equal(loaded[key], value), key
        if name in ("FusedAdam-master_weights", "FusedSGD-master_weights", "FusedMixedPrecisionLamb") and (
            p.dtype != torch.float32
        ):
            assert loaded["master_param"].dtype == torch.float32
    for grads in history[steps_before:]:
        step(resumed_optimizer, list(resumed.parameters()), grads)

    for p, expected, state in zip(resumed.parameters(), expected_params, expected_state):
        assert torch.equal(p.detach(), expected)
        for key, value in state.items():
            assert torch.equal(resumed_optimizer.state[p][key], value), key
    assert resumed_optimizer.param_groups[0].keys() == optimizer.param_groups[0].keys()


# bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_sparse_gradients_are_refused(device, name):
    embedding = torch.nn.Embedding(10, 4, sparse=True).to(device)
    optimizer = OPTIMIZERS[name](embedding.parameters())
    embedding(torch.tensor([1, 3, 3], device=device)).sum().backward()
    assert embedding.weight.grad.is_sparse
    before = embedding.weight.detach().clone()
    with pytest.raises(RuntimeError, match=f"{name.split('-')[0]} does not support sparse gradients"):
        optimizer.step()
    assert torch.equal(embedding.weight.detach(), before)


# upstream's Adam and Adagrad take float64 (test_upstream_compat.py); the others refuse it
@pytest.mark.parametrize("name", [n for n in NAMES if not n.startswith(("FusedAdam", "FusedAdagrad"))])
def test_float64_parameters_are_refused(device, name):
    weight = torch.nn.Parameter(torch.randn(5, dtype=torch.float64, device=device))
    weight.grad = torch.randn_like(weight)
    optimizer = OPTIMIZERS[name]([weight])
    with pytest.raises(TypeError, match=r"parameter of dtype torch.float64"):
        optimizer.step()


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad])
def test_amsgrad_raises(cls):
    with pytest.raises(RuntimeError, match="AMSGrad"):
        cls([torch.nn.Parameter(torch.randn(3))], amsgrad=True)


# torch.amp.GradScaler ----------------------------------------------------------------------


def _scaler(device):
    return torch.amp.GradScaler(device, init_scale=2.0**12, growth_interval=1000)


def _scaled_twins(device, name, dtypes=SCALED):
    """Parameters, clones of them, an optimizer ``name`` on each, and a GradScaler for the first."""
    params = make_params(device, dtypes=dtypes)
    twins = clones(params)
    return params, twins, OPTIMIZERS[name](params), OPTIMIZERS[name](twins), _scaler(device)


def _scaled_step(scaler, optimizer, params, grads):
    for p, g in zip(params, grads):
        p.grad = scaler.scale(g)  # by a power of two: scaling and unscaling are exact
        assert p.grad.dtype == p.dtype and p.grad.shape == p.shape
    scaler.step(optimizer)
    scaler.update()


def _plain_step(optimizer, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    optimizer.step()


@pytest.mark.parametrize("name", NAMES)
def test_grad_scaler_step_equals_unscaled_step(device, name):
    params, twins, ours, theirs, scaler = _scaled_twins(device, name)
    for _ in range(4):
        grads = random_grads(params)
        _scaled_step(scaler, ours, params, grads)
        _plain_step(theirs, twins, grads)
    assert scaler.get_scale() == 2.0**12
    assert_same_run(params, twins, ours, theirs)


@pytest.mark.parametrize("name", NAMES)
def test_grad_scaler_overflow_skips_the_step(device, name):
    params, twins, ours, theirs, scaler = _scaled_twins(device, name)
    history = [random_grads(params) for _ in range(4)]
    for grads in history[:2]:
        _scaled_step(scaler, ours, params, grads)
        _plain_step(theirs, twins, grads)

    before_params, before_state = snapshot(ours, params)
    bad = random_grads(params)
    fp16_index = SCALED.index(torch.float16) * len(SHAPES) + 2  # a fp16 tensor of 7 elements
    bad[fp16_index][3] = float("inf")
    _scaled_step(scaler, ours, params, bad)
    assert scaler.get_scale() == 2.0**11, "the scale backs off after an overflow"
    for p, p0, state0 in zip(params, before_params, before_state):
        assert torch.equal(p.detach(), p0), "an overflowing step must not touch the parameters"
        for key, value in state0.items():
            if key == "step" and name not in SKIPPED_STEP_NOT_COUNTED:
                continue
            assert torch.equal(ours.state[p][key].cpu(), value.cpu()), f"{key} changed in a skipped step"

    if name in SKIPPED_STEP_NOT_COUNTED:
        # the skipped step left no trace: the run goes on as if the bad step never came
        for grads in history[2:]:
            _scaled_step(scaler, ours, params, grads)
            _plain_step(theirs, twins, grads)
        assert_same_run(params, twins, ours, theirs)


@pytest.mark.parametrize("name", NAMES)
def test_grad_scaler_first_step_overflow_leaves_everything_untouched(device, name):
    params = make_params(device, dtypes=SCALED)
    before = [p.detach().clone() for p in params]
    optimizer = OPTIMIZERS[name](params)
    scaler = _scaler(device)
    grads = random_grads(params)
    grads[-1][0] = float("nan")
    _scaled_step(scaler, optimizer, params, grads)
    assert scaler.get_scale() == 2.0**11
    for p, p0 in zip(params, before):
        assert torch.equal(p.detach(), p0)


@pytest.mark.parametrize("name", NAMES)
def test_grad_scaler_unscale_then_clip_then_step(device, name):
    # GradScaler.unscale_ refuses fp16 gradients, and has no bf16 CUDA kernel: fp32 here
    params, twins, ours, theirs, scaler = _scaled_twins(device, name, dtypes=[torch.float32])
    for _ in range(3):
        grads = random_grads(params)
        for p, g in zip(params, grads):
            p.grad = scaler.scale(g)
        scaler.unscale_(ours)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(ours)
        scaler.update()
        for t, g in zip(twins, grads):
            t.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(twins, 1.0)
        theirs.step()
    assert_same_run(params, twins, ours, theirs)


# several devices ---------------------------------------------------------------------------


@pytest.mark.multigpu
@pytest.mark.parametrize("name", NAMES)
def test_parameters_on_two_gpus_in_one_optimizer(name):
    params = make_params("cuda:0")
    for i in range(1, len(params), 2):
        params[i] = torch.nn.Parameter(params[i].detach().to("cuda:1"))
    twins = clones(params, device="cuda:0")
    ours, theirs = OPTIMIZERS[name](params), OPTIMIZERS[name](twins)
    for _ in range(4):
        grads = random_grads(twins)
        for p, t, g in zip(params, twins, grads):
            p.grad, t.grad = g.to(p.device), g.clone()
        ours.step()
        theirs.step()
    assert_same_run(params, twins, ours, theirs)
    for p in params:
        for key, value in ours.state[p].items():
            if key != "step":
                assert value.device == p.device, f"{key} of a parameter on {p.device} is on {value.device}"

    # an overflow on the second GPU skips the step on both
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12)
    scaled = [p for p in params if p.dtype in SCALED]
    before_params, before_state = snapshot(ours, scaled)
    grads = random_grads(scaled)
    assert grads[1].device == torch.device("cuda:1")
    grads[1][0] = float("inf")
    for p in params:
        p.grad = None
    _scaled_step(scaler, ours, scaled, grads)
    assert scaler.get_scale() == 2.0**11
    for p, p0, state0 in zip(scaled, before_params, before_state):
        assert torch.equal(p.detach(), p0)
        for key, value in state0.items():
            if key != "step":
                assert torch.equal(ours.state[p][key], value)
