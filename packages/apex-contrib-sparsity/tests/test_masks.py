"""create_mask and the mask ops against float64 brute force: valid N:M patterns along the input
channels, maximal kept magnitude for the *_best patterns, upstream's greedy rule, shapes, dtypes,
devices, bad input."""

from __future__ import annotations

import itertools

import pytest
import torch

from apex.contrib.sparsity import create_mask, sparse_masklib

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# shape -> the dimension the groups run along (input channels)
SHAPES = {
    (64,): 0,
    (16, 32): 1,
    (8, 16, 3): 1,
    (8, 16, 3, 3): 1,
    (8, 16, 2, 3, 2): 1,
}


def groups_along(mask: torch.Tensor, dim: int, m: int) -> torch.Tensor:
    """[..., m] groups of m consecutive elements along ``dim`` (independent of as_matrix)."""
    moved = mask.movedim(dim, -1)
    return moved.reshape(*moved.shape[:-1], moved.shape[-1] // m, m)


def brute_force_1d(values: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """The largest magnitude any n-of-m choice keeps in each group, float64, trying every choice."""
    groups = values.double().abs().reshape(-1, m)
    best = torch.full((groups.shape[0],), -1.0, dtype=torch.float64)
    for keep in itertools.combinations(range(m), n):
        best = torch.maximum(best, groups[:, list(keep)].sum(1))
    return best


def all_2d_blocks(m: int, n: int) -> torch.Tensor:
    """Every m x m 0/1 block with n ones in each row and column, by filtering all 2^(m*m) blocks."""
    bits = torch.arange(1 << (m * m)).unsqueeze(1).bitwise_right_shift(torch.arange(m * m)).bitwise_and(1)
    blocks = bits.reshape(-1, m, m)
    valid = (blocks.sum(2) == n).all(1) & (blocks.sum(1) == n).all(1)
    return blocks[valid].double()


def blocks_of(matrix: torch.Tensor, m: int) -> torch.Tensor:
    rows, cols = matrix.shape
    return matrix.reshape(rows // m, m, cols // m, m).permute(0, 2, 1, 3).reshape(-1, m, m)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_m4n2_1d_mask_is_2_of_every_4_input_channels(device, dtype, shape):
    tensor = torch.randn(shape, dtype=torch.float64).to(dtype=dtype, device=device)
    mask = create_mask(tensor)
    assert (mask.shape, mask.dtype, mask.device) == (tensor.shape, tensor.dtype, tensor.device)
    assert set(mask.unique().tolist()) <= {0.0, 1.0}
    counts = groups_along(mask.float().cpu(), SHAPES[shape], 4).sum(-1)
    assert (counts == 2).all()
    # the kept magnitude is the best possible in every group
    kept = groups_along((tensor.double().cpu().abs() * mask.double().cpu()), SHAPES[shape], 4).sum(-1)
    best = brute_force_1d(groups_along(tensor.double().cpu(), SHAPES[shape], 4), 4, 2)
    torch.testing.assert_close(kept.reshape(-1), best, rtol=0, atol=0)


@pytest.mark.parametrize(("m", "n"), [(4, 1), (4, 3), (8, 4), (8, 2), (16, 8), (2, 1), (1, 1), (4, 0)])
def test_mn_1d_keeps_n_largest_of_every_m(m, n):
    tensor = torch.randn(6, 4 * m)
    mask = create_mask(tensor, f"m{m}n{n}_1d")
    assert (mask.reshape(-1, m).sum(1) == n).all()
    kept = (tensor.double().abs() * mask.double()).reshape(-1, m).sum(1)
    torch.testing.assert_close(kept, brute_force_1d(tensor, m, n), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_m4n2_2d_best_is_2_of_4_in_rows_and_columns_and_maximal(device, dtype):
    tensor = torch.randn(16, 24, dtype=torch.float64).to(dtype=dtype, device=device)
    mask = create_mask(tensor, "m4n2_2d_best")
    assert (mask.shape, mask.dtype, mask.device) == (tensor.shape, tensor.dtype, tensor.device)
    blocks = blocks_of(mask.double().cpu(), 4)
    assert (blocks.sum(1) == 2).all() and (blocks.sum(2) == 2).all()
    magnitude = blocks_of(tensor.double().cpu().abs(), 4).reshape(-1, 16)
    best = (magnitude @ all_2d_blocks(4, 2).reshape(-1, 16).t()).max(1).values
    kept = (magnitude * blocks.reshape(-1, 16)).sum(1)
    # magnitudes are compared in float32: equal up to its rounding
    torch.testing.assert_close(kept, best, rtol=1e-6, atol=0)


@pytest.mark.parametrize(("m", "n"), [(4, 1), (4, 3), (3, 1), (2, 1)])
def test_mn_2d_best_other_sizes(m, n):
    tensor = torch.randn(3 * m, 2 * m, dtype=torch.float64)
    mask = create_mask(tensor, f"m{m}n{n}_2d_best")
    blocks = blocks_of(mask, m)
    assert (blocks.sum(1) == n).all() and (blocks.sum(2) == n).all()
    magnitude = blocks_of(tensor.abs(), m).reshape(-1, m * m)
    best = (magnitude @ all_2d_blocks(m, n).reshape(-1, m * m).t()).max(1).values
    torch.testing.assert_close((magnitude * blocks.reshape(-1, m * m)).sum(1), best, rtol=1e-12, atol=0)


def greedy_reference(matrix: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Upstream's greedy rule, one block and one element at a time in plain Python."""
    values = matrix.double().abs().tolist()
    rows, cols = matrix.shape
    mask = [[0] * cols for _ in range(rows)]
    for r0 in range(0, rows, m):
        for c0 in range(0, cols, m):
            cells = [(values[r][c], r, c) for r in range(r0, r0 + m) for c in range(c0, c0 + m)]
            # largest first; ties: lower index first
            cells.sort(key=lambda cell: (-cell[0], (cell[1] - r0) * m + cell[2] - c0))
            in_row, in_col = [0] * rows, [0] * cols
            for _, r, c in cells:
                if in_row[r] < n and in_col[c] < n:
                    mask[r][c] = 1
                    in_row[r] += 1
                    in_col[c] += 1
    return torch.tensor(mask, dtype=torch.float64)


@pytest.mark.parametrize(("m", "n"), [(4, 2), (4, 1), (8, 4)])
def test_mn_2d_greedy_follows_the_greedy_rule(device, m, n):
    tensor = torch.randn(2 * m, 3 * m, device=device)
    mask = create_mask(tensor, f"m{m}n{n}_2d_greedy")
    blocks = blocks_of(mask.cpu().double(), m)
    assert (blocks.sum(1) <= n).all() and (blocks.sum(2) <= n).all()
    torch.testing.assert_close(mask.cpu().double(), greedy_reference(tensor.cpu(), m, n), rtol=0, atol=0)


def test_2d_greedy_on_a_conv_weight_runs_along_input_channels():
    weight = torch.randn(8, 16, 3, 3)
    mask = create_mask(weight, "m4n2_2d_greedy")
    matrix = mask.permute(2, 3, 0, 1).reshape(-1, 16)
    expected = greedy_reference(weight.permute(2, 3, 0, 1).reshape(-1, 16), 4, 2)
    torch.testing.assert_close(matrix.double(), expected, rtol=0, atol=0)


def test_float64_and_ties():
    tensor = torch.ones(4, 8, dtype=torch.float64)
    mask = create_mask(tensor)
    assert mask.dtype == torch.float64
    # equal magnitudes: the lower indices are kept
    assert mask[0].tolist() == [1, 1, 0, 0, 1, 1, 0, 0]


def test_empty_and_single_group():
    assert create_mask(torch.randn(0, 16)).shape == (0, 16)
    mask = create_mask(torch.tensor([1.0, -3.0, 2.0, 0.5]))
    assert mask.tolist() == [0.0, 1.0, 1.0, 0.0]


def test_upstream_pattern_functions():
    matrix = torch.randn(8, 16)
    for function in (sparse_masklib.m4n2_1d, sparse_masklib.m4n2_2d_greedy, sparse_masklib.m4n2_2d_best):
        mask = function(matrix, 0.5)
        assert mask.dtype == torch.int32 and mask.shape == matrix.shape
        per_group = mask.reshape(-1, 4).sum(1)
        # the greedy 2-D rule may leave fewer than 2 in a row of a block, never more
        assert (per_group == 2).all() if function is not sparse_masklib.m4n2_2d_greedy else (per_group <= 2).all()
    assert sparse_masklib.compute_valid_1d_patterns(4, 2).shape == (6, 4)
    assert sparse_masklib.compute_valid_2d_patterns(4, 2).shape == (90, 4, 4)
    assert sparse_masklib.fill(sparse_masklib.mn_1d_best(matrix, 4, 2)) == 0.5
    padded, shape = sparse_masklib.reshape_1d(torch.randn(3, 6), 4)
    assert padded.shape == (6, 4) and tuple(shape) == (3, 8)


BAD_INPUT = {  # case: (tensor, pattern, error, message)
    "unknown pattern": (
        torch.randn(8, 16),
        "m4n2_3d",
        ValueError,
        "unknown pattern 'm4n2_3d'; valid patterns: m4n2_1d",
    ),
    "upstream generic function name": (torch.randn(8, 16), "mn_1d_best", ValueError, "unknown pattern"),
    "n larger than m": (torch.randn(8, 16), "m4n5_1d", ValueError, "keeps 5 of every 4"),
    "columns not a multiple of m": (torch.randn(8, 10), "m4n2_1d", ValueError, "10 columns"),
    "conv channels not a multiple of m": (torch.randn(8, 6, 3, 3), "m4n2_1d", ValueError, "6 columns"),
    "2-D pattern on partial blocks": (torch.randn(6, 16), "m4n2_2d_best", ValueError, "multiples of m=4"),
    "integer tensor": (torch.ones(8, 16, dtype=torch.int32), "m4n2_1d", TypeError, "dtype torch.int32"),
    "0-d tensor": (torch.tensor(1.0), "m4n2_1d", ValueError, "1 to 5 dimensions"),
    "6-d tensor": (torch.randn(1, 4, 1, 1, 1, 1), "m4n2_1d", ValueError, "1 to 5 dimensions"),
    "too many 2-D patterns": (torch.randn(8, 8), "m8n4_2d_best", ValueError, "use the greedy 2-D pattern"),
    "not a tensor": ([1.0, 2.0, 3.0, 4.0], "m4n2_1d", TypeError, "must be a torch.Tensor"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_raises_a_clear_error(case):
    tensor, pattern, error, message = BAD_INPUT[case]
    with pytest.raises(error, match=message):
        create_mask(tensor, pattern)
