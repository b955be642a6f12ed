"""ASP end to end on small Linear/Conv models: buffers and eligibility, masks applied, gradients
masked and weights kept sparse through SGD and Adam steps, restoring the dense weights, state_dict
round trips, upstream's errors."""

from __future__ import annotations

import re

import pytest
import torch

from apex.contrib.sparsity import ASP, create_mask
from apex.contrib.sparsity.permutation_lib import Permutation


@pytest.fixture(autouse=True)
def fresh_asp():
    ASP._reset_state()
    yield
    ASP._reset_state()


class Net(torch.nn.Module):
    """Eligible: fc1 [64, 32], conv [16, 32, 3, 3], fc2 [16, 64]. Skipped: head [10, 16] (10 rows),
    narrow [32, 8] (8 columns)."""

    def __init__(self):
        super().__init__()
        self.narrow = torch.nn.Linear(8, 32)
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 16)
        self.head = torch.nn.Linear(16, 10)
        self.conv = torch.nn.Conv2d(32, 16, 3, padding=1)

    def forward(self, x, image):
        y = self.head(torch.relu(self.fc2(torch.relu(self.fc1(torch.relu(self.narrow(x)))))))
        return y, self.conv(image)


ELIGIBLE = ["fc1", "fc2", "conv"]


def inputs(batch=4):
    return torch.randn(batch, 8), torch.randn(batch, 32, 5, 5)


def loss_of(model):
    y, z = model(*inputs())
    return y.square().mean() + z.square().mean()


def is_2_of_4(weight: torch.Tensor) -> bool:
    matrix = weight.detach().movedim(1, -1).reshape(-1, 4)
    return bool(((matrix != 0).sum(1) <= 2).all())


def test_init_registers_mask_buffers_on_eligible_weights_only(capsys):
    model = Net()
    ASP.init_model_for_pruning(model, verbosity=1, allow_permutation=False)
    buffers = {name for name, _ in model.named_buffers()}
    assert buffers == {f"{name}.__weight_mma_mask" for name in ELIGIBLE}
    for name in ELIGIBLE:
        mask = getattr(model, name).get_buffer("__weight_mma_mask")
        assert mask.dtype == torch.bool and mask.all() and mask.shape == getattr(model, name).weight.shape
    printed = capsys.readouterr().out
    assert "Auto skipping pruning head::weight" in printed and "Auto skipping pruning narrow::weight" in printed
    assert ASP.already_init_asp_model() and not ASP.is_sparsity_enabled()


def test_allowed_and_disallowed_layer_names():
    model = Net()
    ASP.init_model_for_pruning(
        model,
        verbosity=0,
        allowed_layer_names=["fc1", "conv"],
        disallowed_layer_names=["conv"],
        allow_permutation=False,
    )
    assert {name for name, _ in model.named_buffers()} == {"fc1.__weight_mma_mask"}


def test_whitelist_custom_layers_and_recompute_buffers():
    class MyLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.kernel = torch.nn.Parameter(torch.randn(16, 32))
            self.other = torch.nn.Parameter(torch.randn(16, 32))

    model = torch.nn.Sequential(MyLinear(), torch.nn.Linear(32, 16), torch.nn.Conv1d(32, 8, 3))
    ASP.init_model_for_pruning(
        model,
        verbosity=0,
        whitelist=[torch.nn.Conv1d],
        custom_layer_dict={MyLinear: ["kernel"]},
        allow_recompute_mask=True,
        allow_permutation=False,
    )
    buffers = dict(model.named_buffers())
    assert set(buffers) == {
        "0.__kernel_mma_mask",
        "0.__kernel_mma_pruned_p",
        "2.__weight_mma_mask",
        "2.__weight_mma_pruned_p",
    }
    assert buffers["0.__kernel_mma_pruned_p"].device.type == "cpu"
    ASP.compute_sparse_masks()
    assert is_2_of_4(model[0].kernel) and is_2_of_4(model[2].weight)
    assert not is_2_of_4(model[0].other) and bool((model[1].weight != 0).all())


def test_multihead_attention_weights():
    model = torch.nn.Sequential(torch.nn.MultiheadAttention(32, 4))
    ASP.init_model_for_pruning(model, verbosity=0, allow_permutation=False)
    assert {name for name, _ in model.named_buffers()} == {
        "0.__in_proj_weight_mma_mask",
        "0.out_proj.__weight_mma_mask",
    }
    ASP.compute_sparse_masks()
    assert is_2_of_4(model[0].in_proj_weight) and is_2_of_4(model[0].out_proj.weight)


@pytest.mark.parametrize("pattern", ["m4n2_1d", "m4n2_2d_best", "m4n2_2d_greedy"])
def test_compute_sparse_masks_prunes_with_the_pattern(pattern):
    model = Net()
    dense = {name: getattr(model, name).weight.detach().clone() for name in ELIGIBLE}
    ASP.init_model_for_pruning(model, pattern, verbosity=0, allow_permutation=False)
    ASP.compute_sparse_masks()
    for name in ELIGIBLE:
        module = getattr(model, name)
        expected_mask = create_mask(dense[name], pattern).bool()
        assert torch.equal(module.get_buffer("__weight_mma_mask"), expected_mask)
        assert torch.equal(module.weight.detach(), dense[name] * expected_mask)
    assert ASP.is_sparsity_enabled()


@pytest.mark.parametrize("optimizer_class", [torch.optim.SGD, torch.optim.Adam])
def test_training_keeps_weights_sparse_and_masks_gradients(optimizer_class):
    model = Net()
    kwargs = {"lr": 0.1, "momentum": 0.9} if optimizer_class is torch.optim.SGD else {"lr": 0.01}
    optimizer = optimizer_class(model.parameters(), **kwargs)
    ASP.init_model_for_pruning(model, verbosity=0, allow_permutation=False)
    ASP.init_optimizer_for_pruning(optimizer)
    ASP.compute_sparse_masks()
    masks = {name: getattr(model, name).get_buffer("__weight_mma_mask").clone() for name in ELIGIBLE}
    dense_before = model.head.weight.detach().clone()
    for _ in range(4):
        optimizer.zero_grad()
        loss_of(model).backward()
        optimizer.step()
        for name in ELIGIBLE:
            module = getattr(model, name)
            assert bool((module.weight.grad[~masks[name]] == 0).all())
            assert bool((module.weight.detach()[~masks[name]] == 0).all())
            assert is_2_of_4(module.weight)
    # the kept weights and the unpruned layers did train
    assert not torch.equal(model.head.weight.detach(), dense_before)
    assert bool((model.fc1.weight.detach()[masks["fc1"]] != 0).all())


def test_restore_pruned_weights_and_recompute():
    model = Net()
    dense = {name: getattr(model, name).weight.detach().clone() for name in ELIGIBLE}
    ASP.init_model_for_pruning(model, verbosity=0, allow_recompute_mask=True, allow_permutation=False)
    ASP.compute_sparse_masks()
    ASP.compute_sparse_masks()  # recomputing restores first: the same masks again
    for name in ELIGIBLE:
        assert torch.equal(getattr(model, name).weight.detach(), dense[name] * create_mask(dense[name]))
    ASP.restore_pruned_weights()
    for name in ELIGIBLE:
        module = getattr(model, name)
        assert torch.equal(module.weight.detach(), dense[name])
        assert module.get_buffer("__weight_mma_mask").all()
    assert not ASP.is_sparsity_enabled()


def test_state_dict_round_trip():
    model = Net()
    ASP.init_model_for_pruning(model, verbosity=0, allow_permutation=False)
    ASP.compute_sparse_masks()
    state = model.state_dict()
    assert "fc1.__weight_mma_mask" in state and state["fc1.__weight_mma_mask"].dtype == torch.bool
    ASP._reset_state()

    restored = Net()
    optimizer = torch.optim.SGD(restored.parameters(), lr=0.1)
    ASP.init_model_for_pruning(restored, verbosity=0, allow_permutation=False)
    assert not ASP.is_sparsity_enabled()
    restored.load_state_dict(state)
    ASP.init_optimizer_for_pruning(optimizer)
    assert ASP.is_sparsity_enabled()
    optimizer.zero_grad()
    loss_of(restored).backward()
    optimizer.step()
    for name in ELIGIBLE:
        mask = state[f"{name}.__weight_mma_mask"]
        assert bool((getattr(restored, name).weight.detach()[~mask] == 0).all())


def test_prune_trained_model():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    Permutation.set_search_options({"strategy": "channel_swap", "escape_attempts": 2})
    dense_fc2 = model.fc2.weight.detach().clone()
    ASP.prune_trained_model(model, optimizer)
    for name in ("fc1", "fc2", "conv"):
        assert is_2_of_4(getattr(model, name).weight)
    assert ASP.is_sparsity_enabled()
    # fc1 -> relu -> fc2 is a closed channel group: fc2's input channels were permuted so that
    # pruning kept more magnitude than without
    kept = float(model.fc2.weight.detach().abs().sum())
    assert kept > float((dense_fc2 * create_mask(dense_fc2)).abs().sum())


def test_module_moved_after_init_keeps_masks_in_sync():
    model = Net()
    ASP.init_model_for_pruning(model, verbosity=0, allow_permutation=False)
    model.to(torch.float64)  # replaces the buffer tensors
    ASP.compute_sparse_masks()
    assert not model.fc1.get_buffer("__weight_mma_mask").all()
    assert is_2_of_4(model.fc1.weight)


def test_callable_mask_calculator_and_its_errors():
    model = Net()
    ASP.init_model_for_pruning(
        model, mask_calculator=lambda p: torch.ones_like(p).tril(), verbosity=0, allow_permutation=False
    )
    ASP.compute_sparse_masks()
    assert torch.equal(model.fc1.get_buffer("__weight_mma_mask"), torch.ones(64, 32, dtype=torch.bool).tril())
    ASP._reset_state()
    ASP.init_model_for_pruning(Net(), mask_calculator=lambda p: torch.ones(3), verbosity=0, allow_permutation=False)
    with pytest.raises(ValueError, match=r"returned \(3,\) for fc1::weight of shape \(64, 32\)"):
        ASP.compute_sparse_masks()


def test_upstream_errors():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        AssertionError, match=re.escape("Called ASP.init_optimizer_for_pruning before ASP.init_model_for_pruning.")
    ):
        ASP.init_optimizer_for_pruning(optimizer)
    with pytest.raises(AssertionError, match="Don't know how to sparsify module"):
        ASP.init_model_for_pruning(model, whitelist=[torch.nn.BatchNorm2d], verbosity=0)
    with pytest.raises(ValueError, match="unknown pattern 'm4n2'"):
        ASP.init_model_for_pruning(model, mask_calculator="m4n2", verbosity=0)
    assert not ASP.already_init_asp_model()
    ASP.init_model_for_pruning(model, verbosity=0, allow_permutation=False)
    with pytest.raises(AssertionError, match=re.escape("ASP has been initialized already.")):
        ASP.init_model_for_pruning(model, verbosity=0)
    ASP.init_optimizer_for_pruning(optimizer)
    with pytest.raises(AssertionError, match=re.escape("ASP has initialized optimizer already.")):
        ASP.init_optimizer_for_pruning(optimizer)
    ASP.compute_sparse_masks()
    with pytest.raises(AssertionError, match="allow_recompute_mask == False"):
        ASP.compute_sparse_masks()
    with pytest.raises(AssertionError, match="allow_recompute_mask == False"):
        ASP.restore_pruned_weights()


def test_inconsistent_sparsity():
    model = Net()
    ASP.init_model_for_pruning(model, verbosity=0, allow_permutation=False)
    ASP.compute_sparse_masks()
    model.fc1.get_buffer("__weight_mma_mask").fill_(True)
    with pytest.raises(AssertionError, match="Inconsistent model sparsity"):
        ASP.is_sparsity_enabled()


def test_permutation_stats():
    model = Net()
    Permutation.set_search_options({"strategy": "channel_swap", "escape_attempts": 2})
    ASP.init_model_for_pruning(model, verbosity=0)
    ASP.compute_sparse_masks()
    permuted_in_c, permuted_in_k, unpermuted = Permutation.get_permutation_stats()
    assert set(permuted_in_c) == {"fc1.weight", "fc2.weight"}
    assert set(permuted_in_k) == {"narrow.weight", "narrow.bias", "fc1.weight", "fc1.bias"}
    assert any("conv" in entry and "model input" in entry for entry in unpermuted)


def test_wrapped_model_is_permuted_inside_the_wrapper():
    model = Net()
    wrapped = torch.nn.DataParallel(model)  # on the CPU it only forwards to the module
    Permutation.set_search_options({"strategy": "channel_swap", "escape_attempts": 2})
    ASP.init_model_for_pruning(wrapped, verbosity=0)
    assert "module.fc1.__weight_mma_mask" in wrapped.state_dict()
    ASP.compute_sparse_masks()
    permuted_in_c, _, _ = Permutation.get_permutation_stats()
    assert set(permuted_in_c) == {"fc1.weight", "fc2.weight"}
    assert is_2_of_4(model.fc1.weight) and ASP.is_sparsity_enabled()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model_on_cuda(dtype):
    model = Net().to(device="cuda", dtype=dtype)
    dense = {name: getattr(model, name).weight.detach().clone() for name in ELIGIBLE}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    Permutation.set_search_options({"strategy": "channel_swap", "escape_attempts": 2})
    ASP.init_model_for_pruning(model, verbosity=0, allow_recompute_mask=True)
    ASP.init_optimizer_for_pruning(optimizer)
    ASP.compute_sparse_masks()
    for name in ELIGIBLE:
        module = getattr(model, name)
        assert module.get_buffer("__weight_mma_mask").device.type == "cuda"
        assert module.get_buffer("__weight_mma_pruned_p").device.type == "cpu"
        assert is_2_of_4(module.weight)
    x, image = inputs()
    y, z = model(x.to("cuda", dtype), image.to("cuda", dtype))
    (y.float().square().mean() + z.float().square().mean()).backward()
    optimizer.step()
    for name in ELIGIBLE:
        assert is_2_of_4(getattr(model, name).weight)
    ASP.restore_pruned_weights()
    # the pruned half comes back (a failed restore would leave half the weights zero)
    for name in ELIGIBLE:
        now = getattr(model, name).weight.detach()
        assert float((now != 0).float().mean()) > 0.99
        assert not torch.equal(now, dense[name])  # trained (and channel-permuted)
