"""Each opt level's casts: parameters, buffers, activations, outputs, gradients and masters; the
input/output casts; state_dict of a cast model; O1's function registry and disable_casts."""

from __future__ import annotations

import collections
import types

import pytest
import torch
from torch import nn

from apex import amp

FP32 = torch.float32


def expected_dtypes(level: str, half: torch.dtype) -> dict:
    """What each opt level's documentation says the tensors are."""
    if level == "O0":
        return dict(linear=FP32, bn=FP32, buffer=FP32, activation=FP32, model_grad=FP32, masters=FP32, separate=False)
    if level == "O1":
        return dict(linear=FP32, bn=FP32, buffer=FP32, activation=half, model_grad=FP32, masters=FP32, separate=False)
    if level == "O2":
        return dict(linear=half, bn=FP32, buffer=half, activation=half, model_grad=half, masters=FP32, separate=True)
    return dict(linear=half, bn=half, buffer=half, activation=half, model_grad=half, masters=half, separate=False)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_opt_level_dtypes(level, half, device, make_net, level_kwargs):
    net = make_net(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level=level, verbosity=0, **level_kwargs(level, half))
    want = expected_dtypes(level, half)

    assert net.fc1.weight.dtype == want["linear"] and net.fc2.bias.dtype == want["linear"]
    assert net.bn.weight.dtype == want["bn"] and net.bn.running_mean.dtype == want["bn"]
    assert net.bn.num_batches_tracked.dtype == torch.int64
    assert net.offset.dtype == want["buffer"]

    # Autocast (O1) leaves float64 alone; the other levels cast every floating input.
    x = torch.randn(6, 8, device=device, dtype=FP32 if level == "O1" else torch.float64)
    out = net(x)
    assert net.seen["fc1"] == want["activation"] and net.seen["fc2"] == want["activation"]
    assert out.dtype == FP32  # floating outputs come back fp32 wherever amp casts
    expected_input = {"O0": FP32, "O1": FP32, "O2": half, "O3": half}[level]
    assert net.seen["input"] == expected_input
    assert not torch.is_autocast_enabled(x.device.type)  # O1's autocast ends with the forward

    with amp.scale_loss(out.square().mean(), opt) as scaled:
        scaled.backward()
    for p in net.parameters():
        expected = want["bn"] if p is net.bn.weight or p is net.bn.bias else want["model_grad"]
        assert p.grad is not None and p.grad.dtype == expected
    masters = list(amp.master_params(opt))
    assert len(masters) == len(list(net.parameters()))
    model_ids = {id(p) for p in net.parameters()}
    for m in masters:
        assert m.grad is not None and torch.isfinite(m.grad).all()
        if m.dtype != FP32:
            assert m.dtype == want["masters"]
    if want["separate"]:
        assert all(m.dtype == FP32 for m in masters)
        assert {id(m) for m in masters if id(m) in model_ids} == {id(net.bn.weight), id(net.bn.bias)}
    else:
        assert {id(m) for m in masters} == model_ids
    before = [p.detach().clone() for p in net.parameters()]
    opt.step()
    changed = [not torch.equal(b, p) for b, p in zip(before, net.parameters())]
    # fc1.bias gets (next to) no gradient: batch norm follows it.
    assert changed[0] and all(changed[2:])
    assert [p.dtype for p in net.parameters()] == [b.dtype for b in before]


def test_o2_keeps_batchnorm_only_when_asked(device, make_net):
    net = make_net(device)
    amp.initialize(net, opt_level="O2", keep_batchnorm_fp32=False, cast_model_type=torch.bfloat16, verbosity=0)
    assert net.bn.weight.dtype == torch.bfloat16 and net.bn.running_var.dtype == torch.bfloat16


class Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = None

    def forward(self, pair, mapping, named, index, scale=None):
        self.seen = dict(
            pair=[t.dtype for t in pair],
            mapping={k: v.dtype for k, v in mapping.items()},
            named=(named.a.dtype, named.b),
            index=index.dtype,
            scale=scale.dtype,
        )
        return {"y": self.lin(pair[0]), "count": index, "nested": [self.lin(pair[1])]}


Named = collections.namedtuple("Named", "a b")


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_inputs_and_outputs_are_cast_through_containers(half, device):
    net = Recorder().to(device)
    amp.initialize(net, opt_level="O2", cast_model_type=half, verbosity=0)
    t = torch.randn(3, 4, device=device)
    index = torch.arange(3, device=device)
    out = net((t, t.double()), {"k": t}, Named(t, "text"), index, scale=t)
    assert net.seen == dict(pair=[half, half], mapping={"k": half}, named=(half, "text"), index=torch.int64, scale=half)
    assert out["y"].dtype == FP32 and out["nested"][0].dtype == FP32 and out["count"].dtype == torch.int64


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_cast_model_outputs(level, device, make_net, level_kwargs):
    net = make_net(device)
    amp.initialize(
        net, opt_level=level, cast_model_outputs=torch.bfloat16, verbosity=0, **level_kwargs(level, torch.bfloat16)
    )
    assert net(torch.randn(4, 8, device=device)).dtype == torch.bfloat16


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_state_dict_of_a_cast_model(level, half, device, make_net):
    net = make_net(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    amp.initialize(net, opt, opt_level=level, cast_model_type=half, verbosity=0)
    net(torch.randn(4, 8, device=device))  # update the batch-norm statistics
    state = net.state_dict()
    floating = {k: v for k, v in state.items() if v.is_floating_point()}
    assert floating and all(v.dtype == FP32 for v in floating.values())
    assert state["bn.num_batches_tracked"].dtype == torch.int64
    # The live parameters keep their dtype; the state dict holds copies.
    assert net.fc1.weight.dtype == half

    plain = type(net)().to(device)  # an fp32 model takes it as it is
    plain.load_state_dict(state)
    assert torch.equal(plain.fc1.weight, net.fc1.weight.float())

    fresh = type(net)().to(device)
    opt2 = torch.optim.SGD(fresh.parameters(), lr=0.1)
    amp.initialize(fresh, opt2, opt_level=level, cast_model_type=half, verbosity=0)
    fresh.load_state_dict(state)
    for (name, a), b in zip(net.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(net.parameters(), fresh.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # The masters follow the loaded model.
    for master, model in zip(amp.master_params(opt2), fresh.parameters()):
        assert torch.equal(master.to(model.dtype), model)


# --- O1: functions -------------------------------------------------------------------------


def _dtype_of(x, y=None):
    return x.dtype if y is None else (x.dtype, y.dtype)


def _namespace():
    ns = types.SimpleNamespace()
    ns.as_half = _dtype_of
    ns.as_float = _dtype_of
    ns.promoted = lambda x, y: (x.dtype, y.dtype)
    ns.untouched = _dtype_of
    ns.matmul_inside = lambda x: (x @ x.t()).dtype
    return ns


class Caller(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fn = fn

    def forward(self, x):
        h = self.lin(x)
        return h, self.fn(h, x)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_registered_functions(half, device):
    ns = _namespace()
    amp.register_half_function(ns, "as_half")
    amp.register_float_function(ns, "as_float")
    amp.register_float_function(ns, "matmul_inside")
    amp.register_promote_function(ns, "promoted")

    def body(h, x):
        return dict(
            half=ns.as_half(x),
            float=ns.as_float(h),
            promote=ns.promoted(h, x),
            untouched=ns.untouched(x),
            matmul_in_float=ns.matmul_inside(x),
        )

    net = Caller(body).to(device)
    amp.initialize(net, opt_level="O1", autocast_dtype=half, verbosity=0)
    _, seen = net(torch.randn(2, 4, device=device))
    assert seen == dict(half=half, float=FP32, promote=(FP32, FP32), untouched=FP32, matmul_in_float=FP32)
    # Outside a forward (no autocast) the wrappers do nothing.
    x = torch.randn(2, 4, device=device, dtype=half)
    assert ns.as_float(x) == half and ns.promoted(x, x.float()) == (half, FP32)


def test_register_missing_function_raises():
    with pytest.raises(ValueError, match="No function named nope"):
        amp.register_half_function(types.SimpleNamespace(), "nope")
    with pytest.raises(ValueError, match="No function named nope"):
        amp.register_promote_function(torch, "nope")


def test_registration_before_other_levels_waits_for_o1(device):
    ns = _namespace()
    amp.register_float_function(ns, "as_float")
    amp.initialize(Caller(lambda h, x: None).to(device), opt_level="O2", verbosity=0)
    assert ns.as_float is _dtype_of  # not applied at O2 ...
    amp.initialize(Caller(lambda h, x: None).to(device), opt_level="O1", verbosity=0)
    assert ns.as_float is not _dtype_of  # ... but by the next O1 initialize


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decorators(half, device):
    @amp.half_function
    def to_half(x):
        return x.dtype

    @amp.float_function
    def to_float(x):
        return (x @ x.t()).dtype

    @amp.promote_function
    def promote(x, y):
        return x.dtype, y.dtype

    net = Caller(lambda h, x: (to_half(x), to_float(h), promote(h, x))).to(device)
    amp.initialize(net, opt_level="O1", autocast_dtype=half, verbosity=0)
    _, seen = net(torch.randn(2, 4, device=device))
    assert seen == (half, FP32, (FP32, FP32))
    assert to_half(torch.randn(2, device=device)) == FP32  # no casts outside O1's forward


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_disable_casts(half, device):
    def body(h, x):
        with amp.disable_casts():
            inside = (x @ x.t()).dtype
        return inside, (x @ x.t()).dtype

    net = Caller(body).to(device)
    amp.initialize(net, opt_level="O1", autocast_dtype=half, verbosity=0)
    h, (inside, after) = net(torch.randn(2, 4, device=device))
    assert (h.dtype, inside, after) == (FP32, FP32, half)  # h is an output: cast back to fp32
    with amp.disable_casts():
        h, _ = net(torch.randn(2, 4, device=device))
    assert net.lin(torch.randn(2, 4, device=device)).dtype == FP32


def test_o1_autocast_ends_when_forward_raises(device):
    def body(h, x):
        raise ValueError("boom")

    net = Caller(body).to(device)
    amp.initialize(net, opt_level="O1", autocast_dtype=torch.bfloat16, verbosity=0)
    with pytest.raises(ValueError, match="boom"):
        net(torch.randn(2, 4, device=device))
    assert not torch.is_autocast_enabled(torch.device(device).type)


def test_reinitialize_replaces_casts(device, make_net):
    net = make_net(device)
    amp.initialize(net, opt_level="O1", autocast_dtype=torch.bfloat16, verbosity=0)
    amp.initialize(net, opt_level="O1", autocast_dtype=torch.float16, verbosity=0)
    net(torch.randn(4, 8, device=device))
    assert net.seen["fc1"] == torch.float16
    assert len(net._forward_pre_hooks) == 1 and len(net._forward_hooks) == 1
