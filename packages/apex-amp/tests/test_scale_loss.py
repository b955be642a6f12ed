"""amp.scale_loss in training loops: overflow skips, accumulation, several models/optimizers/losses,
add_param_group after initialize, and O2 with apex-optimizers' FusedAdam and torch.optim.AdamW."""

from __future__ import annotations

import copy

import pytest
import torch

from apex import amp

BF16 = torch.bfloat16


def batch(step: int, device, n: int = 16):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 8, generator=gen).to(device), torch.randn(n, 4, generator=gen).to(device)


def mse(out, y):
    return (out.float() - y).square().mean()


def make_optimizer(name: str, params, lr: float = 1e-2):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "adamw_fused":
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if name in ("fused_adam", "fused_sgd"):
        # apex-optimizers is optional for apex-amp (absent when apex-amp is tested alone).
        optimizers = pytest.importorskip("apex.optimizers", reason="apex-optimizers is not installed")
        if name == "fused_sgd":
            return optimizers.FusedSGD(params, lr=lr, momentum=0.9)
        return optimizers.FusedAdam(params, lr=lr)
    raise ValueError(name)


def snapshot(net):
    return [p.detach().clone() for p in net.parameters()]


# --- an overflow skips exactly its step ---------------------------------------------------------


def train(net, opt, steps, device, inject_at=None, leave_out=None):
    """Steps of a training loop; returns parameters and loss scale (a device tensor) after each step."""
    params, scales = [], []
    for step in range(steps):
        x, y = batch(step, device)
        out = net(x)
        if step == leave_out:  # the reference: this batch's forward only (same batch-norm statistics)
            params.append(snapshot(net))
            scales.append(amp._amp_state.loss_scalers[0].scale_tensor().clone())
            continue
        loss = mse(out, y)
        if step == inject_at:
            loss = loss * float("inf")
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        params.append(snapshot(net))
        scales.append(amp._amp_state.loss_scalers[0].scale_tensor().clone())
    return params, scales


@pytest.mark.parametrize("opt_name", ["sgd", "adamw", "adamw_fused", "fused_adam"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_overflow_skips_exactly_that_step(level, opt_name, device, make_net, level_kwargs, monkeypatch):
    steps, k = 7, 3
    runs = {}
    for name, inject, leave_out in (("injected", k, None), ("reference", None, k)):
        net = make_net(device)
        opt = make_optimizer(opt_name, net.parameters())
        net, opt = amp.initialize(
            net, opt, opt_level=level, loss_scale="dynamic", verbosity=0, **level_kwargs(level, BF16)
        )
        assert opt._amp_stash.sync_free == (opt_name in ("adamw_fused", "fused_adam"))
        if opt_name == "fused_adam" and name == "injected":
            # The skip happens on the device: neither amp nor the optimizer reads a value on the host.
            monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("host read"))
        params, scales = train(net, opt, steps, device, inject_at=inject, leave_out=leave_out)
        monkeypatch.undo()
        runs[name] = params, [float(s) for s in scales]
        if opt_name != "sgd":
            state_steps = {float(s["step"]) for s in opt.state.values()}
            assert state_steps == {float(steps - 1)}, state_steps

    params, scales = runs["injected"]
    assert scales[:k] == [2.0**16] * k and scales[k:] == [2.0**15] * (steps - k)
    for step in range(1, steps):
        same = all(torch.equal(a, b) for a, b in zip(params[step - 1], params[step]))
        assert same == (step == k), step
    ref_params, ref_scales = runs["reference"]
    assert ref_scales == [2.0**16] * steps
    # A power-of-two scale change is exact in bf16: the skipped step leaves no trace at all.
    for a, b in zip(params[-1], ref_params[-1]):
        assert torch.equal(a, b)


def test_overflow_message_on_the_host_path(make_net, capsys):
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level="O1", autocast_dtype=BF16, loss_scale="dynamic", verbosity=1)
    capsys.readouterr()
    x, y = batch(0, "cpu")
    with amp.scale_loss(mse(net(x), y) * float("inf"), opt) as scaled:
        scaled.backward()
    assert opt.step() is None
    assert "Gradient overflow.  Skipping step; loss scale now loss scaler 0: 32768.0" in capsys.readouterr().out


def test_closure_is_refused(make_net):
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    amp.initialize(net, opt, opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="does not support closure"):
        opt.step(lambda: 0.0)


# --- gradient accumulation ------------------------------------------------------------------------


def accumulate(net, opt, device, mode: str):
    """Master gradients after three micro-batches, accumulated in one of three ways."""
    opt.zero_grad()
    for micro in range(3):
        x, y = batch(micro, device)
        if mode == "plain":  # fp32 autograd accumulation, no amp in the backward
            mse(net(x), y).backward()
            continue
        delay = mode == "delay_unscale" and micro < 2
        with amp.scale_loss(mse(net(x), y), opt, delay_unscale=delay) as scaled:
            scaled.backward()
    return [None if p.grad is None else p.grad.clone() for p in amp.master_params(opt)]


@pytest.mark.parametrize("opt_name", ["sgd", "fused_adam"])
def test_accumulation_o1_is_exact(opt_name, device, make_net):
    grads = {}
    for mode in ("plain", "delay_unscale", "unscale_each"):
        net = make_net(device)
        opt = make_optimizer(opt_name, net.parameters())
        net, opt = amp.initialize(net, opt, opt_level="O1", autocast_dtype=BF16, loss_scale="dynamic", verbosity=0)
        grads[mode] = accumulate(net, opt, device, mode)
    # Scaling by a power of two commutes with every rounding: all three agree bitwise.
    for a, b, c in zip(grads["plain"], grads["delay_unscale"], grads["unscale_each"]):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_accumulation_o2(half, device, make_net):
    grads = {}
    for mode in ("delay_unscale", "unscale_each"):
        net = make_net(device)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        # A small scale: three scaled fp16 micro-batches must not overflow before the unscale.
        net, opt = amp.initialize(
            net, opt, opt_level="O2", cast_model_type=half, loss_scale="dynamic", max_loss_scale=2.0**8, verbosity=0
        )
        grads[mode] = accumulate(net, opt, device, mode)
    single = make_net(device)
    opt = torch.optim.AdamW(single.parameters(), lr=1e-3)
    single, opt = amp.initialize(
        single, opt, opt_level="O2", cast_model_type=half, loss_scale="dynamic", max_loss_scale=2.0**8, verbosity=0
    )
    x, y = batch(0, device)
    with amp.scale_loss(mse(single(x), y), opt) as scaled:
        scaled.backward()
    one = [p.grad.clone() for p in amp.master_params(opt)]
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}[half]
    for a, b, g1 in zip(grads["delay_unscale"], grads["unscale_each"], one):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())
        assert not torch.allclose(a, g1)  # three micro-batches, not one


def test_zero_grad_clears_model_and_master_grads(make_net):
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level="O2", verbosity=0)
    x, y = batch(0, "cpu")
    with amp.scale_loss(mse(net(x), y), opt) as scaled:
        scaled.backward()
    assert all(p.grad is not None for p in amp.master_params(opt))
    opt.zero_grad()
    assert all(p.grad is None for p in net.parameters())
    assert all(p.grad is None for p in amp.master_params(opt))


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_static_scale_unscales_into_masters(half, device, make_net):
    net = make_net(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level="O2", cast_model_type=half, loss_scale=128.0, verbosity=0)
    x, y = batch(0, device)
    with amp.scale_loss(mse(net(x), y), opt) as scaled:
        assert scaled.dtype == torch.float32
        scaled.backward()
    stash = opt._amp_stash
    for master, model in stash.model_of.items():
        assert torch.equal(master.grad, model.grad.float() / 128.0)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_o3_with_dynamic_scale_unscales_in_place(half, device, make_net):
    net = make_net(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level="O3", cast_model_type=half, loss_scale="dynamic", verbosity=0)
    reference = copy.deepcopy(net)
    x, y = batch(0, device)
    with amp.scale_loss(mse(net(x), y), opt) as scaled:
        scaled.backward()
    mse(reference(x), y).backward()
    for p, r in zip(net.parameters(), reference.parameters()):
        assert p.grad.dtype == half
        torch.testing.assert_close(p.grad, r.grad, rtol=2e-2, atol=1e-3 * r.grad.abs().max().item())


# --- several models, optimizers and losses ----------------------------------------------------


def test_several_models_optimizers_and_losses(device, make_net):
    """Two models, two optimizers, three losses (one shared): bitwise equal to a hand-written
    loop without loss scaling, with an overflow in loss 1 skipping only model B's step at iteration 2."""

    def losses(a, b, x, y):
        out_a, out_b = a(x), b(x)
        return mse(out_a, y), mse(out_b, y), mse(out_a * 0.5 + out_b * 0.5, y)

    a, b = make_net(device, seed=1), make_net(device, seed=2)
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9)
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.01)
    ref_opt_a = torch.optim.SGD(ref_a.parameters(), lr=0.05, momentum=0.9)
    ref_opt_b = torch.optim.AdamW(ref_b.parameters(), lr=0.01)
    [a, b], [opt_a, opt_b] = amp.initialize(
        [a, b], [opt_a, opt_b], opt_level="O1", autocast_dtype=BF16, loss_scale="dynamic", num_losses=3, verbosity=0
    )

    # O1's casts (amp.init) are process-wide: the reference models run under them as well, through
    # the same losses (on CUDA, out_a * 0.5 + out_b * 0.5 is then a bf16 sum in both).
    for it in range(4):
        x, y = batch(it, device)
        opt_a.zero_grad()
        opt_b.zero_grad()
        loss_a, loss_b, loss_ab = losses(a, b, x, y)
        with amp.scale_loss(loss_a, opt_a, loss_id=0) as scaled:
            scaled.backward(retain_graph=True)
        poison = float("inf") if it == 2 else 1.0
        with amp.scale_loss(loss_b * poison, opt_b, loss_id=1) as scaled:
            scaled.backward(retain_graph=True)
        with amp.scale_loss(loss_ab, [opt_a, opt_b], loss_id=2) as scaled:
            scaled.backward()

        ref_opt_a.zero_grad()
        ref_opt_b.zero_grad()
        r_a, r_b, r_ab = losses(ref_a, ref_b, x, y)
        r_a.backward(retain_graph=True)
        r_b.backward(retain_graph=True)
        r_ab.backward()
        for p, r in zip(a.parameters(), ref_a.parameters()):
            assert torch.equal(p.grad, r.grad)
        if it != 2:
            for p, r in zip(b.parameters(), ref_b.parameters()):
                assert torch.equal(p.grad, r.grad)
        opt_a.step()
        opt_b.step()
        ref_opt_a.step()
        if it != 2:
            ref_opt_b.step()
        for p, r in zip([*a.parameters(), *b.parameters()], [*ref_a.parameters(), *ref_b.parameters()]):
            assert torch.equal(p, r)
    scales = [s.loss_scale() for s in amp._amp_state.loss_scalers]
    assert scales == [2.0**16, 2.0**15, 2.0**16]


# --- add_param_group after initialize ------------------------------------------------------------


@pytest.mark.parametrize(
    ("opt_name", "half"),
    [("adamw", torch.float16), ("adamw", BF16), ("fused_adam", torch.float16), ("fused_adam", BF16)],
    ids=["adamw-fp16", "adamw-bf16", "fused_adam-fp16", "fused_adam-bf16"],
)
def test_add_param_group_after_initialize(opt_name, half, device, make_net):
    net = make_net(device)
    opt = make_optimizer(opt_name, list(net.fc1.parameters()) + list(net.bn.parameters()), lr=1e-2)
    net, opt = amp.initialize(net, opt, opt_level="O2", cast_model_type=half, verbosity=0)
    opt.add_param_group({"params": list(net.fc2.parameters()), "lr": 5e-3})
    own = opt._amp_stash.own_masters
    assert own == (opt_name == "fused_adam" and half == BF16)
    group = opt.param_groups[-1]
    if own:
        assert group["params"][0] is net.fc2.weight
    else:
        assert [p.dtype for p in group["params"]] == [torch.float32, torch.float32]
        assert torch.equal(group["params"][0], net.fc2.weight.float())
    before = net.fc2.weight.detach().clone()
    for step in range(3):
        x, y = batch(step, device)
        opt.zero_grad()
        with amp.scale_loss(mse(net(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
    assert not torch.equal(before, net.fc2.weight) and net.fc2.weight.dtype == half
    master = opt.state[net.fc2.weight]["master_param"] if own else group["params"][0]
    assert master.dtype == torch.float32 and torch.equal(master.to(half), net.fc2.weight)


# --- O2 with FusedAdam and with AdamW ------------------------------------------------------------


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("torch_name", "fused_name"), [("adamw", "fused_adam"), ("sgd", "fused_sgd")])
def test_o2_fused_optimizer_matches_torch(half, torch_name, fused_name, device, make_net):
    runs = {}
    for name in (torch_name, fused_name):
        net = make_net(device, width=32)
        opt = make_optimizer(name, net.parameters(), lr=3e-3)
        net, opt = amp.initialize(net, opt, opt_level="O2", cast_model_type=half, verbosity=0)
        stash = opt._amp_stash
        # bf16: the fused optimizer keeps the masters itself; fp16 with loss scaling: amp's fp32 masters.
        assert stash.own_masters == (name == fused_name and half == BF16)
        assert stash.amp_masters == (not stash.own_masters)
        losses = []
        for step in range(20):
            x, y = batch(step % 4, device)
            opt.zero_grad()
            loss = mse(net(x), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            losses.append(loss.item())
        masters = [m for _, m in sorted(((id(p), m) for p, m in stash.master_pairs()), key=lambda t: t[0])]
        runs[name] = (losses, {n: p.detach().float() for n, p in net.named_parameters()}, len(masters))
    (l1, p1, n1), (l2, p2, n2) = runs[torch_name], runs[fused_name]
    assert n1 == n2 == 4  # fc1 and fc2 weights and biases; batch norm is fp32 and its own master
    assert l1[-1] < 0.8 * l1[0] and l2[-1] < 0.8 * l2[0]
    torch.testing.assert_close(torch.tensor(l1), torch.tensor(l2), rtol=2e-2, atol=1e-3)
    # fc1.bias gets next to no gradient (batch norm follows it): Adam turns that noise into full
    # steps in arbitrary directions, in fp32 too, so it is left out.
    for name in ("fc1.weight", "bn.weight", "bn.bias", "fc2.weight", "fc2.bias"):
        torch.testing.assert_close(p1[name], p2[name], rtol=0, atol=8e-3)
