"""Hostile inputs to amp: degenerate loss scales, bad arguments and checkpoints, a second
initialize, sparse and meta gradients. Each gets a clear error naming the argument, or a
correct result, never silent garbage."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from apex import amp
from apex.amp.scaler import DEFAULT_MIN_LOSS_SCALE, LossScaler

BF16 = torch.bfloat16


def batch(step: int, device, n: int = 8):
    gen = torch.Generator().manual_seed(2000 + step)
    return torch.randn(n, 8, generator=gen).to(device), torch.randn(n, 4, generator=gen).to(device)


def mse(out, y):
    return (out.float() - y).square().mean()


def sgd_net(make_net, device, **kwargs):
    """fp32 (O0) with a dynamic loss scale: scaling by powers of two is exact, so a plain fp32 loop is the reference."""
    net = make_net(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    return amp.initialize(net, opt, opt_level="O0", loss_scale="dynamic", verbosity=0, **kwargs)


def step_with(net, opt, x, y, poison=1.0):
    opt.zero_grad()
    with amp.scale_loss(mse(net(x), y) * poison, opt) as scaled:
        scaled.backward()
    opt.step()


# --- the dynamic scale never reaches zero ------------------------------------------------------


def test_scale_floor_without_min_loss_scale(device):
    scaler = LossScaler("dynamic")
    scaler.scale_tensor(torch.device(device))
    overflow = torch.ones(1, device=device)
    for _ in range(300):  # 2**16 halved 300 times would be 0.0 in fp32
        scaler.update_scale(overflow)
    assert scaler.loss_scale() == DEFAULT_MIN_LOSS_SCALE > 0.0
    assert math.isfinite(1.0 / scaler.loss_scale())
    # An explicit min_loss_scale is the floor instead.
    scaler = LossScaler("dynamic", min_loss_scale=0.25)
    for _ in range(40):
        scaler.update_scale(overflow.cpu())
    assert scaler.loss_scale() == 0.25


def test_many_overflows_then_a_finite_step_updates_correctly(device, make_net):
    net, opt = sgd_net(make_net, device)
    reference = copy.deepcopy(net)
    x, y = batch(0, device)
    for _ in range(200):
        step_with(net, opt, x, y, poison=float("inf"))
    for p, r in zip(net.parameters(), reference.parameters()):
        assert torch.equal(p, r)  # every poisoned step was skipped
    assert amp._amp_state.loss_scalers[0].loss_scale() == DEFAULT_MIN_LOSS_SCALE
    step_with(net, opt, x, y)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    mse(reference(x), y).backward()
    ref_opt.step()
    for p, r in zip(net.parameters(), reference.parameters()):
        assert torch.isfinite(p).all()
        assert torch.equal(p, r)


def test_non_finite_unscale_is_flagged(device, make_net):
    """A scale whose reciprocal is inf in fp32 (a denormal, from a checkpoint) must not write NaN."""
    net, opt = sgd_net(make_net, device)
    before = [p.detach().clone() for p in net.parameters()]
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1e-44, "unskipped": 0}})
    x, y = batch(0, device)
    step_with(net, opt, x, y)
    for p, b in zip(net.parameters(), before):
        assert torch.equal(p, b)  # skipped: the unscale was not finite
    assert amp._amp_state.loss_scalers[0].loss_scale() == DEFAULT_MIN_LOSS_SCALE
    step_with(net, opt, x, y)
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert not all(torch.equal(p, b) for p, b in zip(net.parameters(), before))


# --- bad arguments name themselves --------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        (dict(min_loss_scale=1024, max_loss_scale=2), ("min_loss_scale=1024", "max_loss_scale=2")),
        (dict(min_loss_scale=0.0), ("min_loss_scale",)),
        (dict(min_loss_scale=-1.0), ("min_loss_scale",)),
        (dict(min_loss_scale=float("nan")), ("min_loss_scale",)),
        (dict(min_loss_scale="small"), ("min_loss_scale",)),
        (dict(max_loss_scale=float("nan")), ("max_loss_scale",)),
        (dict(max_loss_scale=0.0), ("max_loss_scale",)),
        (dict(max_loss_scale=None), ("max_loss_scale",)),
        (dict(loss_scale="big"), ("loss_scale", "'big'")),
        (dict(loss_scale=float("inf")), ("loss_scale",)),
        (dict(loss_scale=float("nan")), ("loss_scale",)),
        (dict(loss_scale=1e-44), ("loss_scale=1e-44", "unscaled")),
    ],
)
def test_bad_loss_scale_arguments(kwargs, names, make_net):
    with pytest.raises((ValueError, TypeError)) as info:
        amp.initialize(make_net(), opt_level="O2", verbosity=0, **kwargs)
    for name in names:
        assert name in str(info.value)


def test_loss_scaler_checks_its_limits():
    with pytest.raises(ValueError, match=r"min_loss_scale.*max_loss_scale"):
        LossScaler("dynamic", min_loss_scale=1024.0, max_loss_scale=2.0)
    with pytest.raises(ValueError, match="min_loss_scale"):
        LossScaler("dynamic", min_loss_scale=float("nan"))


def test_load_state_dict_rejects_bad_values(make_net):
    amp.initialize(make_net(), opt_level="O1", num_losses=2, verbosity=0)
    state = amp.state_dict()
    for bad in (float("nan"), float("inf"), 0.0, -4.0, "big"):
        broken = {"loss_scaler0": dict(state["loss_scaler0"]), "loss_scaler1": {**state["loss_scaler1"]}}
        broken["loss_scaler1"]["loss_scale"] = bad
        with pytest.raises((ValueError, TypeError), match=r"loss_scaler1.*loss_scale"):
            amp.load_state_dict(broken)
    broken = {"loss_scaler0": {**state["loss_scaler0"], "unskipped": -1}}
    with pytest.raises(ValueError, match=r"loss_scaler0.*unskipped"):
        amp.load_state_dict(broken)
    # Nothing was loaded by the refused calls: loss_scaler0 was valid but is untouched too.
    assert amp.state_dict() == state


def test_load_state_dict_with_a_missing_field(make_net):
    amp.initialize(make_net(), opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match=r'state_dict\["loss_scaler0"\] has no "loss_scale"'):
        amp.load_state_dict({"loss_scaler0": {"unskipped": 3}})
    with pytest.raises(RuntimeError, match=r'state_dict\["loss_scaler0"\] must be a dict'):
        amp.load_state_dict({"loss_scaler0": 65536.0})


def test_load_state_dict_before_initialize(monkeypatch):
    monkeypatch.setattr(amp._amp_state, "opt_properties", None)
    monkeypatch.setattr(amp._amp_state, "loss_scalers", [])
    with pytest.raises(RuntimeError, match=r"before amp.initialize"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}})


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_initialize_twice_says_so(level, make_net):
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level=level, verbosity=0)
    properties, scalers = amp._amp_state.opt_properties, amp._amp_state.loss_scalers
    with pytest.raises(RuntimeError, match=r"amp.initialize was already called on models\[0\]") as info:
        amp.initialize(net, opt, opt_level=level, verbosity=0)
    assert "dtype" not in str(info.value)
    # The refused call changed nothing: the first initialize is still in force.
    assert amp._amp_state.opt_properties is properties and amp._amp_state.loss_scalers is scalers
    x, y = batch(0, "cpu")
    step_with(net, opt, x, y)
    with pytest.raises(RuntimeError, match=r"amp.initialize was already called on models\[1\]"):
        amp.initialize([make_net(), net], opt_level=level, verbosity=0)


# --- sparse gradients ---------------------------------------------------------------------------


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(20, 8, sparse=True)
        self.head = nn.Linear(8, 4)

    def forward(self, idx):
        return self.head(self.emb(idx).sum(1))


def bag_batch(step, device):
    gen = torch.Generator().manual_seed(3000 + step)
    # Repeated indices: the sparse gradient has duplicates to sum.
    return torch.randint(0, 20, (6, 5), generator=gen).to(device), torch.randn(6, 4, generator=gen).to(device)


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_sparse_gradients(level, device):
    """An nn.Embedding(sparse=True) trained with SGD: the sparse gradient is unscaled (in place, or
    into a sparse fp32 master at O2) exactly, checked for overflow, and its step skipped on one."""
    runs = {}
    for name, loss_scale in (("amp", "dynamic"), ("unscaled", 1.0)):
        net = Bag().to(device)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        # O1 in bf16: fp32's exponent range, so scaling the casted backward by 2**8 is exact too.
        kwargs = {"O1": dict(autocast_dtype=BF16), "O2": dict(cast_model_type=torch.float16)}.get(level, {})
        # A small scale: only the injected inf overflows fp16.
        net, opt = amp.initialize(
            net, opt, opt_level=level, loss_scale=loss_scale, max_loss_scale=2.0**8, verbosity=0, **kwargs
        )
        scaler = amp._amp_state.loss_scalers[0]
        grads, params = [], []
        for step in range(4):
            idx, y = bag_batch(step, device)
            poison = float("inf") if step == 2 and name == "amp" else 1.0
            before = [p.detach().clone() for p in net.parameters()]
            opt.zero_grad()
            scale = scaler.loss_scale()
            with amp.scale_loss(mse(net(idx), y) * poison, opt) as scaled:
                scaled.backward()
            emb = next(iter(amp.master_params(opt)))
            assert emb.grad.is_sparse and emb.grad.dtype == torch.float32
            grads.append(emb.grad.coalesce().to_dense())  # duplicates summed in one order in both runs
            if level == "O2" and step != 2:
                # The fp32 master gradient is the model's scaled fp16 gradient divided by the scale, exactly.
                expected = net.emb.weight.grad.float().coalesce().values() / scale
                torch.testing.assert_close(emb.grad.coalesce().values(), expected, rtol=0, atol=0)
            opt.step()
            skipped = all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
            assert skipped == (step == 2 and name == "amp"), step
            params.append([p.detach().clone() for p in net.parameters()])
        runs[name] = grads, params
        if name == "amp":
            assert scaler.loss_scale() == 2.0**7
    if level != "O2":
        # fp32 gradients: scaling by a power of two and back is exact; the skipped step aside,
        # training matches the unscaled run (SGD adds a coalesced gradient where the unscaled run
        # adds its duplicates one by one: parameters agree to rounding).
        grads, params = runs["amp"]
        ref_grads, ref_params = runs["unscaled"]
        assert torch.equal(grads[0], ref_grads[0])
        torch.testing.assert_close(grads[1], ref_grads[1], rtol=1e-5, atol=1e-7)
        for step in (0, 1):
            for p, r in zip(params[step], ref_params[step]):
                torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


# --- meta tensors -------------------------------------------------------------------------------


def test_meta_parameter_is_refused_by_initialize(make_net):
    net = make_net()
    net.fc2.register_parameter("extra", nn.Parameter(torch.zeros(3, device="meta")))
    with pytest.raises(ValueError, match=r"models\[0\].*fc2.extra.*meta"):
        amp.initialize(net, opt_level="O2", verbosity=0)
    net = make_net()
    net.register_buffer("lazy", torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match=r"models\[0\].*buffer lazy.*meta"):
        amp.initialize(net, opt_level="O1", verbosity=0)


def test_meta_gradient_beside_cpu_ones(make_net):
    net = make_net()
    extra = nn.Parameter(torch.zeros(3, device="meta"))  # beside the model's CPU parameters
    opt = torch.optim.SGD([*net.parameters(), extra], lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level="O0", loss_scale="dynamic", verbosity=0)
    x, y = batch(0, "cpu")
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[6\].*meta device"):
        with amp.scale_loss(mse(net(x), y), opt) as scaled:
            scaled.backward()
            extra.grad = torch.ones(3, device="meta")
