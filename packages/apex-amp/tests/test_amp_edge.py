"""amp's edge semantics: upstream's LossScaler attributes over the device state, a LARC-wrapped
optimizer, and several models/optimizers/losses at O2 with an overflow in one loss, under every
way of clearing gradients and with a param group added after ``amp.initialize``."""

from __future__ import annotations

import copy

import pytest
import torch

from apex import amp
from apex.amp.scaler import LossScaler

BF16 = torch.bfloat16


def batch(step: int, device, n: int = 8):
    gen = torch.Generator().manual_seed(4000 + step)
    return torch.randn(n, 8, generator=gen).to(device), torch.randn(n, 4, generator=gen).to(device)


def mse(out, y):
    return (out.float() - y).square().mean()


# --- upstream's LossScaler attributes ---------------------------------------------------------


@pytest.mark.parametrize("placed", [False, True], ids=["host", "device"])
def test_upstream_scaler_attributes_read_and_write_the_state(placed, device):
    scaler = LossScaler("dynamic", scale_window=4, min_loss_scale=2.0, max_loss_scale=2.0**20)
    if placed:
        scaler.scale_tensor(torch.device(device))
    assert scaler.dynamic is True
    assert scaler._loss_scale == scaler.loss_scale() == 2.0**16
    assert (scaler._min_loss_scale, scaler._max_loss_scale, scaler._scale_seq_len) == (2.0, 2.0**20, 4)
    assert scaler._unskipped == 0 and scaler._has_overflow is False

    scaler._loss_scale = 2.0**10
    scaler._unskipped = 3
    assert scaler.loss_scale() == 2.0**10 and scaler._unskipped == 3
    if placed:  # the device tensors themselves hold the new values
        assert scaler.scale_tensor().item() == 2.0**10 and scaler._scale.device.type == torch.device(device).type
    clean = torch.zeros(1, device=device)
    scaler.update_scale(clean)  # the 4th clean update: growth
    assert scaler._loss_scale == 2.0**11 and scaler._unskipped == 0

    scaler._scale_seq_len = 2
    scaler._max_loss_scale = 2.0**12
    for _ in range(4):
        scaler.update_scale(clean)
    assert scaler._loss_scale == 2.0**12  # grew every 2 updates, clamped by the new maximum
    scaler._min_loss_scale = 2.0**11
    for _ in range(3):
        scaler.update_scale(torch.ones(1, device=device))
    assert scaler._loss_scale == 2.0**11

    with pytest.raises(ValueError, match="_loss_scale"):
        scaler._loss_scale = float("nan")
    with pytest.raises(ValueError, match="_loss_scale"):
        scaler._loss_scale = 0.0
    with pytest.raises(ValueError, match="_min_loss_scale"):
        scaler._min_loss_scale = 2.0**13  # above the maximum
    assert scaler._loss_scale == 2.0**11


def test_upstream_overflow_state(device):
    scaler = LossScaler("dynamic")
    placed = scaler.scale_tensor(torch.device(device)).device  # cuda:0 where "cuda" was asked
    flag = scaler.flag_on(placed)
    assert scaler._overflow_buf is flag and scaler._has_overflow is False
    flag.fill_(1)
    assert scaler._has_overflow is True
    assert scaler.update_scale() is True  # upstream's form: reads the flags, says whether to skip
    assert scaler._loss_scale == 2.0**15 and scaler._unskipped == 0
    scaler.clear_overflow_state()
    assert scaler._has_overflow is False and int(flag.item()) == 0
    scaler._has_overflow = True
    assert int(flag.item()) == 1
    scaler._has_overflow = False
    assert scaler.update_scale() is False and scaler._unskipped == 1


def test_amp_scalers_attributes_follow_training(make_net):
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level="O2", verbosity=0, max_loss_scale=2.0**18)
    scaler = amp._amp_state.loss_scalers[0]
    assert scaler._max_loss_scale == 2.0**18 and scaler._min_loss_scale is None
    x, y = batch(0, "cpu")
    with amp.scale_loss(mse(net(x), y) * float("inf"), opt) as scaled:
        scaled.backward()
    assert scaler._has_overflow is True and scaler._loss_scale == 2.0**15
    opt.step()
    scaler._loss_scale = 2.0**4  # e.g. a user restoring a scale by hand
    with amp.scale_loss(mse(net(x), y), opt) as scaled:
        assert scaled.item() == pytest.approx(mse(net(x), y).item() * 16, rel=1e-3)
        scaled.backward()
    assert scaler._has_overflow is False and scaler._unskipped == 1
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**4


# --- LARC ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("as_list", [False, True])
def test_larc_wrapped_optimizer(as_list, device, make_net):
    LARC = pytest.importorskip("apex.parallel", reason="apex-parallel is not installed").LARC
    net = make_net(device)
    reference = copy.deepcopy(net)
    opt = LARC(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    ref_opt = LARC(torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9))
    # fp32 with a dynamic scale (O0): powers of two unscale exactly, so plain LARC is the reference.
    model, opts = amp.initialize(net, [opt] if as_list else opt, opt_level="O0", loss_scale="dynamic", verbosity=0)
    assert model is net and (opts == [opt] if as_list else opts is opt)
    for step in range(4):
        x, y = batch(step, device)
        opt.zero_grad()
        poison = float("inf") if step == 1 else 1.0
        with amp.scale_loss(mse(net(x), y) * poison, opts) as scaled:
            scaled.backward()
        opt.step()
        if step != 1:
            ref_opt.zero_grad()
            mse(reference(x), y).backward()
            ref_opt.step()
        for p, r in zip(net.parameters(), reference.parameters()):
            assert torch.equal(p, r), step
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**15


def test_larc_at_o2_steps_the_masters(device, make_net):
    LARC = pytest.importorskip("apex.parallel", reason="apex-parallel is not installed").LARC
    net = make_net(device)
    opt = LARC(torch.optim.SGD(net.parameters(), lr=0.1))
    net, opt = amp.initialize(net, opt, opt_level="O2", verbosity=0)
    masters = list(amp.master_params(opt))
    assert all(m.dtype == torch.float32 for m in masters)
    before = [m.detach().clone() for m in masters]
    x, y = batch(0, device)
    with amp.scale_loss(mse(net(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(not torch.equal(m, b) for m, b in zip(masters, before))
    for master, model in opt._amp_stash.model_of.items():
        assert torch.equal(master.half(), model)
    state = opt.state_dict()
    assert "amp_master_params" in state


# --- several models, optimizers and losses at O2 --------------------------------------------------


def clear(mode: str, models, opts):
    if mode == "optimizer":
        for opt in opts:
            opt.zero_grad()
    elif mode == "optimizer_zeros":
        for opt in opts:
            opt.zero_grad(set_to_none=False)
    elif mode == "model":
        for model in models:
            model.zero_grad()
    elif mode == "none":
        for model in models:
            for p in model.parameters():
                p.grad = None


def three_losses(out: dict, y, it: int, poison: float) -> list:
    """Loss 0 on A (and C once it trains), loss 1 on B (times ``poison``), loss 2 on A and B."""
    return [
        mse(out["a"] + (out["c"] if it >= 3 else 0), y),
        mse(out["b"], y) * poison,
        mse(out["a"] * 0.5 + out["b"] * 0.5, y),
    ]


@pytest.mark.parametrize("mode", ["optimizer", "optimizer_zeros", "model", "none"])
def test_several_losses_o2_master_grads_are_exact(mode, device, make_net):
    """Models A and B, optimizers over A and B, three losses (A, B, both); an inf in loss 1 at
    iteration 2 skips only B's step and backs off only scaler 1; a param group (model C) joins
    A's optimizer at iteration 3. Every master gradient equals, bitwise, the sum over the losses
    of an independent fp16 backward of the scaled loss divided by its scale."""
    a, b, c = make_net(device, seed=1), make_net(device, seed=2), make_net(device, seed=3)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9)
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.01)
    [a, b, c], [opt_a, opt_b] = amp.initialize(
        [a, b, c], [opt_a, opt_b], opt_level="O2", num_losses=3, max_loss_scale=2.0**8, verbosity=0
    )  # a scale small enough that only the injected inf overflows fp16
    scalers = amp._amp_state.loss_scalers
    models = {"a": a, "b": b, "c": c}
    for it in range(6):
        if it == 3:
            opt_a.add_param_group({"params": list(c.parameters()), "lr": 0.02})
        x, y = batch(it, device)
        clear(mode, [a, b, c], [opt_a, opt_b])
        twins = {name: copy.deepcopy(m) for name, m in models.items()}  # the fp16 models before this step
        scales = [s.loss_scale() for s in scalers]
        out = {name: m(x) for name, m in models.items()}
        poison = float("inf") if it == 2 else 1.0
        losses = three_losses(out, y, it, poison)
        for loss_id, (loss, opts) in enumerate(zip(losses, [opt_a, opt_b, [opt_a, opt_b]])):
            with amp.scale_loss(loss, opts, loss_id=loss_id) as scaled:
                scaled.backward(retain_graph=loss_id < 2)

        # The reference: each loss's backward through its own copy of the fp16 models.
        expected = {}
        for loss_id in range(3):
            copies = {name: copy.deepcopy(m) for name, m in twins.items()}
            o = {name: m(x) for name, m in copies.items()}
            loss = three_losses(o, y, it, poison)[loss_id]
            (loss.float() * scales[loss_id]).backward()
            for name, m in copies.items():
                for i, p in enumerate(m.parameters()):
                    if p.grad is None:
                        continue
                    g = p.grad.float() * (1.0 / scales[loss_id])
                    key = (name, i)
                    expected[key] = g if key not in expected else expected[key] + g
        for opt, names in ((opt_a, "ac" if it >= 3 else "a"), (opt_b, "b")):
            if opt is opt_b and it == 2:
                continue  # an overflow: the step is skipped, its gradients are not used
            for name in names:
                for i, model_param in enumerate(models[name].parameters()):
                    # fp32 batch norm parameters are stepped themselves; the others through an fp32 master.
                    master = next((m for m, p in opt._amp_stash.model_of.items() if p is model_param), model_param)
                    assert master.dtype == torch.float32
                    assert torch.equal(master.grad, expected[(name, i)]), (it, name, i)
        before_b = [p.detach().clone() for p in b.parameters()]
        opt_a.step()
        opt_b.step()
        assert all(torch.equal(p, q) for p, q in zip(b.parameters(), before_b)) == (it == 2), it
        backed_off = [s.loss_scale() for s in scalers]
        if it == 2:
            assert backed_off == [scales[0], scales[1] / 2, scales[2]]
        else:
            assert backed_off == scales
        for opt in (opt_a, opt_b):
            for master, model in opt._amp_stash.model_of.items():
                assert torch.equal(master.half(), model)
    assert [s.loss_scale() for s in scalers] == [2.0**8, 2.0**7, 2.0**8]


def test_model_zero_grad_between_two_scale_loss_drops_the_masters(make_net):
    """model.zero_grad() (or p.grad = None) before a second scale_loss without a step discards the
    first backward's gradients from the masters too, as it would without amp."""
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level="O2", verbosity=0)
    x0, y0 = batch(0, "cpu")
    x1, y1 = batch(1, "cpu")
    with amp.scale_loss(mse(net(x0), y0), opt) as scaled:
        scaled.backward()
    net.zero_grad()
    with amp.scale_loss(mse(net(x1), y1), opt) as scaled:
        scaled.backward()
    only_second = [p.grad.clone() for p in amp.master_params(opt)]
    opt.zero_grad()
    with amp.scale_loss(mse(net(x1), y1), opt) as scaled:
        scaled.backward()
    for g, p in zip(only_second, amp.master_params(opt)):
        assert torch.equal(g, p.grad)


# --- fp16_utils: which buffers are cast ----------------------------------------------------------


class Buffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.plain_bn = torch.nn.BatchNorm1d(4, affine=False)
        self.register_buffer("shift", torch.full((4,), 0.5))
        self.register_buffer("wide", torch.ones(4, dtype=torch.float64))
        self.register_buffer("index", torch.arange(4))

    def forward(self, x):
        return self.plain_bn(self.bn(self.lin(x))) + self.shift + self.wide.to(x.dtype)


def test_fp16_model_and_network_to_half_cast_buffers_as_upstream(device):
    from apex.fp16_utils import FP16Model, network_to_half

    fp16, fp32 = torch.float16, torch.float32
    model = FP16Model(Buffers().to(device))
    net = model.network
    # convert_network: every floating buffer (float64 too) is cast; affine batch norm keeps fp32;
    # a batch norm without affine weights is cast, running statistics included.
    assert net.shift.dtype == net.wide.dtype == fp16 and net.index.dtype == torch.int64
    assert net.lin.weight.dtype == fp16
    assert net.bn.weight.dtype == net.bn.running_mean.dtype == net.bn.running_var.dtype == fp32
    assert net.plain_bn.running_mean.dtype == net.plain_bn.running_var.dtype == fp16
    assert net.bn.num_batches_tracked.dtype == torch.int64
    assert model(torch.randn(3, 4, device=device)).dtype == fp16

    half = network_to_half(Buffers().to(device))
    net = half[1]
    # network_to_half: .half() on everything, then every batch norm (affine or not) back to fp32.
    assert net.shift.dtype == net.wide.dtype == fp16 and net.index.dtype == torch.int64
    assert net.bn.weight.dtype == net.bn.running_mean.dtype == fp32
    assert net.plain_bn.running_mean.dtype == net.plain_bn.running_var.dtype == fp32
    assert half(torch.randn(3, 4, device=device)).dtype == fp16
