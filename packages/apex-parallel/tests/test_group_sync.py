"""apex.parallel.group_sync on one rank: the composition contrib groupbn and cudnn_gbn build on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apex.parallel import group_sync


def _reference(x, z, weight, bias, relu):
    """float64 batch norm of channels-last ``x`` (N, H, W, C) (+ z, ReLU), training statistics."""
    nchw = x.double().permute(0, 3, 1, 2)
    y = F.batch_norm(nchw, None, None, weight.double(), bias.double(), training=True, eps=1e-5)
    y = y.permute(0, 2, 3, 1)
    if z is not None:
        y = y + z.double()
    return y.relu() if relu else y


@pytest.mark.parametrize("relu", [False, True])
def test_forward_and_backward_match_float64_batch_norm(relu):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4, 7) * 2 + 1
    z = torch.randn_like(x) if relu else None
    weight, bias = torch.rand(7) + 0.5, torch.randn(7)
    running_mean, running_var = torch.zeros(7), torch.ones(7)
    y, mean, invstd, counts = group_sync.forward_train(
        x, z, weight, bias, running_mean, running_var, 0.1, 1e-5, relu, None, 1
    )
    expected = _reference(x, z, weight, bias, relu)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    flat = x.double().reshape(-1, 7)
    torch.testing.assert_close(mean.double(), flat.mean(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(running_var.double(), 0.9 + 0.1 * flat.var(0, unbiased=True), rtol=1e-5, atol=1e-6)

    dy = torch.randn_like(x)
    grad_x, grad_z, grad_w, grad_b = group_sync.backward_train(
        dy, x, z, weight, bias, mean, invstd, counts, relu, None, 1, grad_z=relu
    )
    inputs = [t.double().requires_grad_() for t in (x, weight, bias)] + ([z.double().requires_grad_()] if relu else [])
    ref = _reference(inputs[0], inputs[3] if relu else None, inputs[1], inputs[2], relu)
    ref_grads = torch.autograd.grad(ref, inputs, dy.double())
    for ours, theirs in zip([grad_x, grad_w, grad_b] + ([grad_z] if relu else []), ref_grads):
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-5)
    if not relu:
        assert grad_z is None


def test_one_value_per_channel_on_one_rank_raises_as_torch():
    x = torch.randn(1, 1, 1, 4)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        group_sync.forward_train(x, None, None, None, None, None, 0.1, 1e-5, False, None, 1)


def test_an_empty_batch_on_one_rank_leaves_the_running_statistics():
    running_mean, running_var = torch.full((4,), 0.5), torch.full((4,), 2.0)
    group_sync.forward_train(
        torch.empty(0, 2, 2, 4), None, None, None, running_mean, running_var, 0.1, 1e-5, False, None, 1
    )
    assert torch.equal(running_mean, torch.full((4,), 0.5)) and torch.equal(running_var, torch.full((4,), 2.0))


def test_group_size_must_be_a_positive_int():
    with pytest.raises(ValueError, match="group size must be a positive int"):
        group_sync.consecutive_group(0)
    assert group_sync.consecutive_group(1) == (None, 1)
