"""Channel permutation: the channel groups torch.fx finds, the permuted (unpruned) model computing
the same function, the kept magnitude after 2:4 pruning never lower, the searches against brute
force, untraceable models warned about, optimizer state permuted along."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from apex.contrib.sparsity import ASP
from apex.contrib.sparsity.permutation_lib import Permutation, PermutationWarning, find_channel_groups
from apex.contrib.sparsity.permutation_search_kernels import (
    Channel_Swap,
    Exhaustive_Search,
    accelerated_search_for_good_permutation,
    sum_after_2_to_4,
)
from apex.contrib.sparsity.sparse_masklib import as_matrix

FAST_SEARCH = {"strategy": "exhaustive", "stripe_group_size": 8, "escape_attempts": 3}


@pytest.fixture(autouse=True)
def fresh_state():
    ASP._reset_state()
    Permutation.set_search_options(FAST_SEARCH)
    yield
    ASP._reset_state()


def kept_reference(matrix: torch.Tensor) -> float:
    stripes = matrix.double().abs().reshape(matrix.shape[0], matrix.shape[1] // 4, 4)
    pairs = [stripes[..., i] + stripes[..., j] for i, j in itertools.combinations(range(4), 2)]
    return float(torch.stack(pairs).max(0).values.sum())


def kept_after_pruning(*weights) -> float:
    return sum(kept_reference(as_matrix(w.detach())) for w in weights)


class ConvNet(torch.nn.Module):
    """conv1 -> bn1 -> relu -> (conv2 -> bn2 -> relu) + residual -> conv3 -> pool -> flatten -> fc."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(8, 32, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(32)
        self.conv2 = torch.nn.Conv2d(32, 32, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(32)
        self.conv3 = torch.nn.Conv2d(32, 16, 1)
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.nn.functional.relu(self.bn2(self.conv2(y))) + y
        return self.fc(torch.flatten(self.pool(self.conv3(y)), 1))


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 48)
        self.norm = torch.nn.LayerNorm(48)
        self.fc2 = torch.nn.Linear(48, 32)
        self.fc3 = torch.nn.Linear(48, 32)
        self.out = torch.nn.Linear(32, 8)

    def forward(self, x):
        h = self.norm(torch.nn.functional.gelu(self.fc1(x)))
        return self.out(self.fc2(h).relu() * torch.sigmoid(self.fc3(h)))


def randomize_norms(model):
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.BatchNorm2d, torch.nn.LayerNorm)):
                module.weight.uniform_(0.5, 2.0)
                module.bias.uniform_(-1.0, 1.0)
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-1.0, 1.0)
                module.running_var.uniform_(0.5, 2.0)
    return model.eval()


def group_names(model):
    found = []
    for group in find_channel_groups(torch.fx.symbolic_trace(model)):
        names = lambda d: sorted(n for n, _ in d.values())  # noqa: E731
        found.append((names(group.producers), names(group.consumers), names(group.per_channel), bool(group.blocked)))
    return found


def test_channel_groups_of_the_conv_net():
    groups = group_names(ConvNet())
    assert (["conv1", "conv2"], ["conv2", "conv3"], ["bn1", "bn2"], False) in groups
    assert ([], ["conv1"], [], True) in groups  # reads the model input
    # pooled to 1x1 and flattened: the channels reach fc in the same order
    assert (["conv3"], ["fc"], [], False) in groups
    assert (["fc"], [], [], True) in groups  # the model's output


def test_channel_groups_of_the_mlp():
    groups = group_names(MLP())
    assert (["fc1"], ["fc2", "fc3"], ["norm"], False) in groups
    assert (["fc2", "fc3"], ["out"], [], False) in groups


@pytest.mark.parametrize(
    ("make", "x_shape", "pruned"),
    [(ConvNet, (2, 8, 6, 6), ["conv2", "conv3", "fc"]), (MLP, (5, 16), ["fc2", "fc3", "out"])],
)
def test_permuted_model_computes_the_same_and_keeps_more(device, make, x_shape, pruned):
    # TF32 rounds the products to 10 bits: reordered sums would then differ by far more than fp32's
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            check_permuted_model(device, make, x_shape, pruned)
    finally:
        torch.set_float32_matmul_precision(precision)


def check_permuted_model(device, make, x_shape, pruned):
    torch.manual_seed(1)
    model = randomize_norms(make()).to(device)
    x = torch.randn(x_shape, device=device)
    expected = model(x)
    before = kept_after_pruning(*(getattr(model, n).weight for n in pruned))
    weights_before = {n: getattr(model, n).weight.detach().clone() for n in pruned}
    assert Permutation.permute_model(model)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    after = kept_after_pruning(*(getattr(model, n).weight for n in pruned))
    assert after > before
    # the weights were reordered, not changed
    for name, weight in weights_before.items():
        now = getattr(model, name).weight.detach()
        assert torch.equal(now.flatten().sort().values, weight.flatten().sort().values)


class Flattening(torch.nn.Module):
    """Three ways to flatten: a 1x1 map (permutable), a 2x2 map (not: 4 features per channel)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.conv = torch.nn.Conv2d(4, 16, 3, padding=1)
        self.flatten = torch.nn.Flatten()
        self.pool = torch.nn.AdaptiveAvgPool2d(1 if how != "2x2" else 2)
        self.fc = torch.nn.Linear(16 if how != "2x2" else 64, 8)

    def forward(self, x):
        y = self.pool(torch.relu(self.conv(x)))
        if self.how == "view":
            y = y.view(y.size(0), -1)
        elif self.how == "module":
            y = self.flatten(y)
        else:
            y = torch.flatten(y, 1)
        return self.fc(y)


@pytest.mark.parametrize("how", ["view", "module", "function", "2x2"])
def test_flatten_between_conv_and_linear(how):
    torch.manual_seed(9)
    model = Flattening(how).eval()
    x = torch.randn(2, 4, 6, 6)
    expected = model(x)
    weight = model.fc.weight.detach().clone()
    assert Permutation.permute_model(model)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    permuted_in_c, _, unpermuted = Permutation.get_permutation_stats()
    if how == "2x2":
        assert torch.equal(model.fc.weight.detach(), weight)
        assert any("disagree on the channel count ([16, 64])" in entry for entry in unpermuted)
    else:
        assert permuted_in_c == ["fc.weight"]
        assert not torch.equal(model.fc.weight.detach(), weight)


class Bottleneck(torch.nn.Module):
    def __init__(self, channels: int, width: int, downsample: bool):
        super().__init__()
        inputs = channels // 2 if downsample else channels
        self.conv1 = torch.nn.Conv2d(inputs, width, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(width)
        self.conv2 = torch.nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(width)
        self.conv3 = torch.nn.Conv2d(width, channels, 1, bias=False)
        self.bn3 = torch.nn.BatchNorm2d(channels)
        self.downsample = (
            torch.nn.Sequential(torch.nn.Conv2d(inputs, channels, 1, bias=False), torch.nn.BatchNorm2d(channels))
            if downsample
            else None
        )

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        identity = self.downsample(x) if self.downsample is not None else x
        return torch.relu(y + identity)


class TinyResNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.layer = torch.nn.Sequential(Bottleneck(32, 16, True), Bottleneck(32, 16, False))
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.fc = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layer(torch.relu(self.stem(x)))), 1))


def test_residual_stream_of_a_resnet_stage(device):
    torch.manual_seed(10)
    model = randomize_norms(TinyResNet()).to(device)
    groups = group_names(model)
    # the residual stream: both blocks' conv3, the downsample, read by block 2's conv1 and the fc
    stream = (
        ["layer.0.conv3", "layer.0.downsample.0", "layer.1.conv3"],
        ["fc", "layer.1.conv1"],
        ["layer.0.bn3", "layer.0.downsample.1", "layer.1.bn3"],
        False,
    )
    assert stream in groups
    x = torch.randn(2, 3, 8, 8, device=device)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            expected = model(x)
            assert Permutation.permute_model(model)
            torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_float32_matmul_precision(precision)
    permuted_in_c, _, _ = Permutation.get_permutation_stats()
    assert {"fc.weight", "layer.1.conv1.weight", "layer.0.conv2.weight"} <= set(permuted_in_c)


def test_asp_with_permutation_keeps_at_least_the_unpermuted_magnitude():
    torch.manual_seed(2)
    model = randomize_norms(ConvNet())
    reference = ConvNet()
    reference.load_state_dict(model.state_dict())
    ASP.init_model_for_pruning(reference, verbosity=0, allow_permutation=False)
    ASP.compute_sparse_masks()
    unpermuted = sum(float(reference.get_submodule(n).weight.detach().abs().sum()) for n in ("conv2", "conv3"))
    ASP._reset_state()
    Permutation.set_search_options(FAST_SEARCH)
    ASP.init_model_for_pruning(model, verbosity=0, allow_permutation=True)
    ASP.compute_sparse_masks()
    permuted = sum(float(model.get_submodule(n).weight.detach().abs().sum()) for n in ("conv2", "conv3"))
    assert permuted > unpermuted
    for name in ("conv2", "conv3"):
        mask = model.get_submodule(name).get_buffer("__weight_mma_mask")
        assert bool((mask.permute(2, 3, 0, 1).reshape(-1, 4).sum(1) == 2).all())


def test_optimizer_state_is_permuted_with_the_parameters():
    torch.manual_seed(3)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).square().sum().backward()
    optimizer.step()
    weight = model.fc1.weight.detach().clone()
    moment = optimizer.state[model.fc1.weight]["exp_avg"].clone()
    bias_moment = optimizer.state[model.fc1.bias]["exp_avg_sq"].clone()
    bias = model.fc1.bias.detach().clone()
    norm_weight = model.norm.weight.detach().clone()
    assert Permutation.permute_model(model, optimizer=optimizer)
    # fc1 only produces the permuted channels: recover the permutation from its (distinct) rows
    permutation = [int((weight - row).abs().sum(1).argmin()) for row in model.fc1.weight.detach()]
    assert sorted(permutation) == list(range(48)) and permutation != list(range(48))
    assert torch.equal(model.fc1.weight.detach(), weight[permutation])
    assert torch.equal(optimizer.state[model.fc1.weight]["exp_avg"], moment[permutation])
    assert torch.equal(model.fc1.bias.detach(), bias[permutation])
    assert torch.equal(optimizer.state[model.fc1.bias]["exp_avg_sq"], bias_moment[permutation])
    assert torch.equal(model.norm.weight.detach(), norm_weight[permutation])


def test_untraceable_model_warns_and_is_left_alone():
    class DataDependent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(16, 32)
            self.fc2 = torch.nn.Linear(32, 16)

        def forward(self, x):
            h = self.fc1(x)
            if h.sum() > 0:  # control flow on a value: torch.fx cannot trace it
                h = h.relu()
            return self.fc2(h)

    model = DataDependent()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(PermutationWarning, match="torch.fx cannot trace DataDependent"):
        assert not Permutation.permute_model(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    ASP.init_model_for_pruning(model, verbosity=0)
    with pytest.warns(PermutationWarning, match="masks are computed on the unpermuted weights"):
        ASP.compute_sparse_masks()
    assert ASP.is_sparsity_enabled()


def test_dump_graph(tmp_path):
    model = MLP()
    path = tmp_path / "out" / "graph.json"
    Permutation.permute_model(model, dump_fx_graph=True, save_dumped_fx_graph=str(path))
    record = json.loads(path.read_text())
    consumers = [g["consumers"] for g in record["channel_groups"]]
    assert ["fc2", "fc3"] in consumers and "graph" in record


# searches ------------------------------------------------------------------------------------


def test_whole_matrix_search_is_the_best_permutation():
    torch.manual_seed(4)
    matrix = torch.randn(6, 8, dtype=torch.float64)
    _, _, permutation = Exhaustive_Search(matrix, stripe_group_size=-1)
    # every one of the 8! orders, at once
    orders = torch.tensor(list(itertools.permutations(range(8))))
    stripes = matrix.abs()[:, orders].reshape(6, -1, 2, 4)
    pairs = [stripes[..., i] + stripes[..., j] for i, j in itertools.combinations(range(4), 2)]
    best = float(torch.stack(pairs).max(0).values.sum(dim=(0, 2)).max())
    assert kept_reference(matrix[:, permutation]) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("search", ["exhaustive8", "exhaustive12", "channel_swap"])
def test_searches_return_a_better_permutation(device, search):
    torch.manual_seed(5)
    matrix = torch.randn(24, 48 if search != "exhaustive12" else 24, device=device)
    if search == "channel_swap":
        result, seconds, permutation = Channel_Swap(matrix, escape_attempts=5)
    else:
        result, seconds, permutation = Exhaustive_Search(matrix, stripe_group_size=int(search[10:]), escape_attempts=5)
    assert sorted(permutation) == list(range(matrix.shape[1])) and seconds >= 0
    assert torch.equal(result, matrix[:, permutation])
    assert kept_reference(result.cpu()) > kept_reference(matrix.cpu())


def test_search_on_numpy_and_with_a_start_permutation():
    np = pytest.importorskip("numpy")
    matrix = np.random.default_rng(6).standard_normal((8, 16)).astype(np.float32)
    start = list(reversed(range(16)))
    result, _, permutation = Exhaustive_Search(matrix, stripe_group_size=8, escape_attempts=2, permutation=start)
    assert isinstance(result, np.ndarray) and (result == matrix[:, permutation]).all()
    assert sum_after_2_to_4(result) >= sum_after_2_to_4(matrix[:, start]) - 1e-4
    assert math.isclose(sum_after_2_to_4(matrix), kept_reference(torch.from_numpy(matrix)), rel_tol=1e-6)


def test_accelerated_search_strategies():
    torch.manual_seed(7)
    matrix = torch.randn(16, 32)
    base = kept_reference(matrix)
    options = {}
    permutation = accelerated_search_for_good_permutation(matrix, options)
    assert options == {"strategy": "exhaustive", "stripe_group_size": 8, "escape_attempts": 100}
    assert kept_reference(matrix[:, permutation]) > base
    permutation = accelerated_search_for_good_permutation(
        matrix, {"strategy": "progressive channel swap", "progressive_search_time_limit": 0.2}
    )
    assert sorted(permutation) == list(range(32)) and kept_reference(matrix[:, permutation]) > base
    with pytest.warns(UserWarning, match="'user defined' returns the identity"):
        assert accelerated_search_for_good_permutation(matrix, {"strategy": "user defined"}) == list(range(32))
    with pytest.raises(ValueError, match="unknown strategy 'annealing'"):
        accelerated_search_for_good_permutation(matrix, {"strategy": "annealing"})


def test_search_bad_input():
    with pytest.raises(ValueError, match="not a multiple of 4"):
        Exhaustive_Search(torch.randn(4, 10), stripe_group_size=8)
    with pytest.raises(ValueError, match="stripe_group_size must be -1 or a multiple of 4"):
        Exhaustive_Search(torch.randn(4, 16), stripe_group_size=6)
    with pytest.raises(ValueError, match="permutation must be a permutation of range\\(16\\)"):
        Channel_Swap(torch.randn(4, 16), permutation=[0] * 16)
    with pytest.raises(ValueError, match=r"would try \d+ layouts"):
        Exhaustive_Search(torch.randn(4, 32), stripe_group_size=-1)


def distributed_worker(rank: int, world_size: int):
    """Same model on every rank, a different search seed on each: rank 0's permutation must win."""
    torch.manual_seed(8)
    model = MLP()
    x = torch.randn(3, 16)
    expected = model(x).detach()
    Permutation._reset_state()
    Permutation.set_search_options({"strategy": "channel_swap", "escape_attempts": 20})
    Permutation.set_identical_seed(100 + rank)
    assert Permutation.permute_model(model)
    return (
        model.fc1.weight.detach().clone(),
        model.out.weight.detach().clone(),
        (model(x) - expected).abs().max().item(),
    )


def test_ranks_apply_rank_0_permutation():
    from pathlib import Path

    from apex.core.testing import run_ranks

    results = run_ranks(Path(__file__), "distributed_worker", 2, backend="gloo", timeout=180)
    (fc1_0, out_0, error_0), (fc1_1, out_1, error_1) = results
    assert torch.equal(fc1_0, fc1_1) and torch.equal(out_0, out_1)
    assert error_0 < 1e-5 and error_1 < 1e-5
    torch.manual_seed(8)
    assert not torch.equal(fc1_0, MLP().fc1.weight.detach())  # permuted
