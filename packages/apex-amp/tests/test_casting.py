"""Each opt level's casts: parameters, buffers, activations, outputs, gradients and masters; the
input/output casts; state_dict of a cast model; O1's function registry and disable_casts through
amp.initialize (amp.init itself: test_amp_init.py).

O1 casts CUDA tensors only, as upstream; the O1 tests here widen ``apex.amp.amp.CAST_DEVICE_TYPES``
to the test's device (the ``o1_casts_on`` fixture) so that they check the same casts on the CPU.
"""

from __future__ import annotations

import collections
import types

import pytest
import torch
from torch import nn

from apex import amp

FP32 = torch.float32


@pytest.fixture
def o1_casts_on(monkeypatch):
    """O1 casts tensors of ``device`` too (by default only CUDA tensors, as upstream)."""

    def on(device) -> None:
        monkeypatch.setattr(amp.amp, "CAST_DEVICE_TYPES", ("cuda", torch.device(device).type))

    return on


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
def test_opt_level_dtypes(level, half, device, make_net, level_kwargs, o1_casts_on):
    o1_casts_on(device)
    net = make_net(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level=level, verbosity=0, **level_kwargs(level, half))
    want = expected_dtypes(level, half)

    assert net.fc1.weight.dtype == want["linear"] and net.fc2.bias.dtype == want["linear"]
    assert net.bn.weight.dtype == want["bn"] and net.bn.running_mean.dtype == want["bn"]
    assert net.bn.num_batches_tracked.dtype == torch.int64
    assert net.offset.dtype == want["buffer"]

    # O0/O2/O3 cast the model's floating inputs; O1 casts inside the functions (float64 too).
    x = torch.randn(6, 8, device=device, dtype=torch.float64)
    out = net(x)
    assert net.seen["fc1"] == want["activation"] and net.seen["fc2"] == want["activation"]
    # Outputs come back fp32 where the model is cast; O1 leaves them as computed, as upstream.
    assert out.dtype == (half if level == "O1" else FP32)
    expected_input = {"O0": FP32, "O1": torch.float64, "O2": half, "O3": half}[level]
    assert net.seen["input"] == expected_input

    # The loss in fp32, as from a loss function (O1 keeps losses fp32): a scaled fp16 loss's own
    # gradient (2**16) would overflow fp16 and skip the step.
    with amp.scale_loss(out.float().square().mean(), opt) as scaled:
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
def test_cast_model_outputs(level, device, make_net, level_kwargs, o1_casts_on):
    o1_casts_on(device)
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


# --- O1: functions ---------------------------------------------------------------------------
# Before amp.init existed, O1 cast only inside a model's forward (torch.autocast), and registered
# or decorated functions acted only there: the calls outside any forward below returned fp32.


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


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_registered_functions(half, device, make_net, o1_casts_on):
    o1_casts_on(device)
    ns = _namespace()
    amp.register_half_function(ns, "as_half")
    amp.register_float_function(ns, "as_float")
    amp.register_float_function(ns, "matmul_inside")
    amp.register_promote_function(ns, "promoted")
    amp.initialize(make_net(device), opt_level="O1", autocast_dtype=half, verbosity=0)
    x = torch.randn(2, 4, device=device)
    h = x.to(half)
    # Everywhere, not only inside a model's forward.
    assert ns.as_half(x) == half and ns.as_float(h) == FP32 and ns.untouched(x) == FP32
    assert ns.promoted(h, x) == (FP32, FP32) and ns.promoted(h, h) == (half, half)
    # A float function's inputs are cast; the functions it calls still cast by their lists.
    assert ns.matmul_inside(h) == half
    with amp.disable_casts():
        assert ns.as_half(x) == FP32 and ns.promoted(h, x) == (half, FP32)


def test_register_missing_function_raises():
    with pytest.raises(ValueError, match="No function named nope"):
        amp.register_half_function(types.SimpleNamespace(), "nope")
    with pytest.raises(ValueError, match="No function named nope"):
        amp.register_promote_function(torch, "nope")


def test_registration_before_other_levels_waits_for_o1(device, make_net):
    ns = _namespace()
    amp.register_float_function(ns, "as_float")
    amp.initialize(make_net(device), opt_level="O2", verbosity=0)
    assert ns.as_float is _dtype_of  # not applied at O2 ...
    amp.initialize(make_net(device), opt_level="O1", verbosity=0)
    assert ns.as_float is not _dtype_of  # ... but by the next O1 initialize
    amp._amp_state.handle._deactivate()
    assert ns.as_float is _dtype_of  # and undone with the handle


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decorators(half, device, make_net, o1_casts_on):
    @amp.half_function
    def to_half(x):
        return x.dtype

    @amp.float_function
    def to_float(x):
        return x.dtype

    @amp.promote_function
    def promote(x, y):
        return x.dtype, y.dtype

    x = torch.randn(2, 4, device=device)
    h = x.to(half)
    assert (to_half(x), to_float(h), promote(h, x)) == (FP32, half, (half, FP32))  # no amp.init yet
    o1_casts_on(device)
    amp.initialize(make_net(device), opt_level="O1", autocast_dtype=half, verbosity=0)
    assert (to_half(x), to_float(h), promote(h, x)) == (half, FP32, (FP32, FP32))


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_disable_casts(half, device, make_net, o1_casts_on):
    o1_casts_on(device)
    net = make_net(device)
    amp.initialize(net, opt_level="O1", autocast_dtype=half, verbosity=0)
    x = torch.randn(6, 8, device=device)
    with amp.disable_casts():
        assert net(x).dtype == FP32 and net.seen["fc1"] == FP32
        with amp.disable_casts():  # nests
            pass
        assert net.fc1(x).dtype == FP32
    assert net(x).dtype == half and net.seen["fc1"] == half


def test_o1_steps_without_casts(device, make_net, o1_casts_on):
    o1_casts_on(device)
    net = make_net(device)
    seen = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(amp._amp_state.handle.is_active())
            return super().step(closure)

    opt = Recording(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level="O1", autocast_dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(6, 8, device=device)
    with amp.scale_loss(net(x).float().square().mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert seen == [False] and amp._amp_state.handle.is_active()


def test_reinitialize_replaces_casts(device, make_net, o1_casts_on):
    o1_casts_on(device)
    net = make_net(device)
    amp.initialize(net, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)
    assert len(net._forward_pre_hooks) == 1 and len(net._forward_hooks) == 1
    net.float()
    amp.initialize(net, opt_level="O1", autocast_dtype=torch.bfloat16, verbosity=0)
    first = amp._amp_state.handle
    amp.initialize(net, opt_level="O1", autocast_dtype=torch.float16, verbosity=0)
    assert not first.is_active() and amp._amp_state.handle is not first
    net(torch.randn(4, 8, device=device))
    assert net.seen["input"] == FP32 and net.seen["fc1"] == torch.float16
    # O1 casts inside the functions: the O2 model casts are gone.
    assert len(net._forward_pre_hooks) == 0 and len(net._forward_hooks) == 0
