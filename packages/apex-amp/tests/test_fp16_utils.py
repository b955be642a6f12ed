"""apex.fp16_utils: network casts, master-parameter helpers, the loss scalers and FP16_Optimizer."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from apex.fp16_utils import (
    BN_convert_float,
    DynamicLossScaler,
    FP16_Optimizer,
    FP16Model,
    LossScaler,
    clip_grad_norm,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
)


def conv_net():
    return nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3), nn.BatchNorm1d(3, affine=False)
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_convert_network_keeps_batchnorm(dtype, device):
    net = conv_net().to(device)
    net[0].weight.grad = torch.ones_like(net[0].weight)
    out = convert_network(net, dtype)
    assert out is net
    assert net[0].weight.dtype == dtype and net[0].weight.grad.dtype == dtype and net[3].bias.dtype == dtype
    # As upstream: the affine batch norm stays float32, the one without weights is cast.
    assert net[1].running_mean.dtype == torch.float32 and net[1].running_var.dtype == torch.float32
    assert net[4].running_mean.dtype == dtype and net[4].running_var.dtype == dtype
    assert net[1].weight.dtype == torch.float32
    assert net[1].num_batches_tracked.dtype == net[4].num_batches_tracked.dtype == torch.int64
    y = net(torch.randn(5, 6, device=device, dtype=dtype))
    assert y.dtype == dtype


def test_convert_network_flattens_rnns():
    rnn = nn.LSTM(4, 5)
    convert_network(nn.Sequential(rnn), torch.float16)
    assert all(p.dtype == torch.float16 for p in rnn.parameters())


def test_network_to_half_and_bn_convert_float(device):
    net = conv_net().to(device)
    half = network_to_half(net)
    assert isinstance(half, nn.Sequential) and half[1] is net
    assert net[0].weight.dtype == torch.float16 and net[1].weight.dtype == torch.float32
    assert net[4].running_mean.dtype == torch.float32
    x = torch.randn(4, 6, device=device)  # fp32 in: the first layer casts it
    assert half(x).dtype == torch.float16
    other = conv_net().half()
    assert BN_convert_float(other) is other and other[1].weight.dtype == torch.float32
    assert other[0].weight.dtype == torch.float16


def test_fp16_model(device):
    net = conv_net().to(device)
    model = FP16Model(net)
    assert model.network is net and net[0].weight.dtype == torch.float16 and net[1].weight.dtype == torch.float32
    assert model(torch.randn(4, 6, device=device)).dtype == torch.float16


@pytest.mark.parametrize("flat", [False, True])
def test_master_param_helpers(flat, device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 2)).to(device).half()
    model[1].bias.requires_grad_(False)
    model_params, master_params = prep_param_lists(model, flat_master=flat)
    assert len(model_params) == 3
    if flat:
        assert len(master_params) == 1 and master_params[0].numel() == 5 * 7 + 7 + 7 * 2
        assert master_params[0].grad is not None
    else:
        assert [m.shape for m in master_params] == [p.shape for p in model_params]
    assert all(m.dtype == torch.float32 and m.requires_grad for m in master_params)
    model(torch.randn(3, 5, device=device, dtype=torch.float16)).sum().backward()
    model_grads_to_master_grads(model_params, master_params, flat_master=flat)
    grads = torch.cat([p.grad.float().reshape(-1) for p in model_params])
    masters_grad = torch.cat([m.grad.reshape(-1) for m in master_params])
    assert torch.equal(grads, masters_grad)
    with torch.no_grad():
        for m in master_params:
            m.add_(0.5)
    master_params_to_model_params(model_params, master_params, flat_master=flat)
    values = torch.cat([p.detach().reshape(-1) for p in model_params])
    assert torch.equal(values, torch.cat([m.detach().reshape(-1) for m in master_params]).half())


def test_model_grads_to_master_grads_with_missing_grad():
    model = [nn.Parameter(torch.ones(3, dtype=torch.float16)), nn.Parameter(torch.ones(2, dtype=torch.float16))]
    masters = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    masters[1].grad = torch.ones(2)
    model[0].grad = torch.full((3,), 2.0, dtype=torch.float16)
    model_grads_to_master_grads(model, masters)
    assert torch.equal(masters[0].grad, torch.full((3,), 2.0)) and masters[1].grad is None


def test_to_python_float():
    assert to_python_float(torch.tensor([2.5])) == 2.5
    assert to_python_float(torch.tensor(3.0)) == 3.0
    assert to_python_float([4.0]) == 4.0


def test_clip_grad_norm_clips_in_place_as_torchs():
    # Upstream exported torch's clip_grad_norm_ under its pre-0.4 name; master-weight loops call it.
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(4))]
    for p in params:
        p.grad = torch.randn_like(p) * 10
    expected = [p.grad.clone() for p in params]
    total = torch.linalg.vector_norm(torch.cat([g.flatten() for g in expected]))
    norm = clip_grad_norm(params, max_norm=1.0)
    torch.testing.assert_close(norm, total)
    for p, g in zip(params, expected):
        torch.testing.assert_close(p.grad, g * (1.0 / (float(total) + 1e-6)))
    assert float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))) == pytest.approx(
        1.0, rel=1e-4
    )


def test_static_loss_scaler():
    scaler = LossScaler()
    assert scaler.loss_scale == 1
    scaler = LossScaler(128)
    scaler.update_scale(True)
    assert scaler.loss_scale == 128 and not scaler.has_overflow([nn.Parameter(torch.ones(1))])
    assert scaler.scale_gradient(None, (torch.ones(2),), None)[0].tolist() == [128.0, 128.0]
    p = nn.Parameter(torch.ones(()))
    scaler.backward(p * 3.0)
    assert p.grad.item() == 384.0


def test_dynamic_loss_scaler_defaults_and_rules():
    scaler = DynamicLossScaler()
    assert scaler.loss_scale == 2**32 and scaler.scale_factor == 2.0 and scaler.scale_window == 1000
    scaler = DynamicLossScaler(init_scale=8.0, scale_window=3)
    history = []
    for overflow in [False, False, False, True, True, True, True, False, False, False, False]:
        scaler.update_scale(overflow)
        history.append(scaler.loss_scale)
    # Growth at iterations where (iter - last overflow) is a multiple of the window; halving on
    # overflow, never below 1.
    assert history == [8.0, 8.0, 16.0, 8.0, 4.0, 2.0, 1.0, 1.0, 1.0, 2.0, 2.0]
    good = nn.Parameter(torch.ones(3))
    good.grad = torch.ones(3)
    bad = nn.Parameter(torch.ones(3))
    bad.grad = torch.tensor([1.0, float("nan"), 0.0])
    assert not scaler.has_overflow([good]) and scaler.has_overflow([good, bad])
    assert DynamicLossScaler._has_inf_or_nan(torch.tensor([float("-inf")]))


def _train_fp16_optimizer(device, dtype, dynamic, steps, poison_at=()):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to(device)
    model = convert_network(model, dtype)
    opt = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        static_loss_scale=64.0,
        dynamic_loss_scale=dynamic,
        dynamic_loss_args={"init_scale": 2.0**10} if dynamic else None,
        verbose=False,
    )
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step % 2)  # two batches, so the loss can go down
        x = torch.randn(16, 6, generator=gen).to(device, dtype)
        y = torch.randn(16, 2, generator=gen).to(device)
        opt.zero_grad()
        loss = (model(x).float() - y).square().mean()
        opt.backward(loss * (float("inf") if step in poison_at else 1.0))
        opt.step()
        losses.append(loss.item())
    return model, opt, losses


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dynamic", [False, True])
def test_fp16_optimizer_trains(dynamic, dtype, device):
    _, opt, losses = _train_fp16_optimizer(device, dtype, dynamic, 15)
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    for model_p, master in zip(opt.all_fp16_params, opt.all_fp32_from_fp16_params):
        assert model_p.dtype == dtype and torch.equal(master.to(dtype), model_p)
    assert opt.loss_scale == (2.0**10 if dynamic else 64.0)
    norm = opt.clip_master_grads(1e-3)
    assert float(norm) > 0


def test_fp16_optimizer_skips_overflow(device):
    model, opt, _ = _train_fp16_optimizer(device, torch.float16, True, 3)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 6, device=device, dtype=torch.float16)
    opt.zero_grad()
    opt.backward(model(x).float().sum() * float("inf"))
    assert opt.overflow and opt.clip_master_grads(1.0) == -1 and opt.inspect_master_grad_data() is None
    assert opt.step() is None
    assert opt.loss_scale == 2.0**9
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_fp16_optimizer_state_round_trip(device):
    _, opt, _ = _train_fp16_optimizer(device, torch.float16, True, 4)
    state = copy.deepcopy(opt.state_dict())
    _, opt2, _ = _train_fp16_optimizer(device, torch.float16, True, 1)
    opt2.load_state_dict(state)
    for a, b in zip(opt.all_fp32_from_fp16_params, opt2.all_fp32_from_fp16_params):
        assert torch.equal(a, b)
    assert opt2.loss_scale == opt.loss_scale
    with pytest.raises(RuntimeError, match="serialized using state_dict"):
        copy.deepcopy(opt)


def test_fp16_optimizer_rejects_other_dtypes():
    p = nn.Parameter(torch.ones(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        FP16_Optimizer(torch.optim.SGD([p], lr=0.1), verbose=False)


def test_fp16_optimizer_with_closure(device):
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(device).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    x = torch.randn(8, 3, device=device, dtype=torch.float16)

    def closure():
        opt.zero_grad()
        loss = model(x).float().square().mean()
        opt.backward(loss)
        return loss

    first = opt.step(closure).item()
    for _ in range(5):
        last = opt.step(closure).item()
    assert last < first
