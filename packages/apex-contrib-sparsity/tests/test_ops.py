"""The permutation-search ops and the legacy ``permutation_search_cuda`` module against float64
brute force; opcheck of every op; bad input."""

from __future__ import annotations

import itertools

import numpy as np
import permutation_search_cuda
import pytest
import torch

from apex.contrib.sparsity import _ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def kept_reference(matrix: torch.Tensor) -> float:
    """Float64: per row and stripe of 4, the best sum of 2 magnitudes, trying all 6 pairs."""
    stripes = matrix.double().abs().reshape(matrix.shape[0], matrix.shape[1] // 4, 4)
    pairs = [stripes[..., i] + stripes[..., j] for i, j in itertools.combinations(range(4), 2)]
    return float(torch.stack(pairs).max(0).values.sum())


def permute_map_reference(matrix, groups, permutations):
    gains, best = [], []
    for group in groups.tolist():
        columns = [4 * s + j for s in group for j in range(4)]
        sub = matrix[:, columns]
        sums = [kept_reference(sub[:, p]) for p in permutations.tolist()]
        top = max(range(len(sums)), key=lambda i: (sums[i], -i))
        gains.append(sums[top] - sums[0])
        best.append(top)
    return torch.tensor(gains, dtype=torch.float64), best


def swap_map_reference(matrix, pairs):
    out = []
    for s0, s1 in pairs.tolist():
        columns = [4 * s0 + j for j in range(4)] + [4 * s1 + j for j in range(4)]
        sub = matrix[:, columns]
        base = kept_reference(sub)
        row = []
        for c0 in range(4):
            for c1 in range(4):
                order = list(range(8))
                order[c0], order[4 + c1] = 4 + c1, c0
                row.append(kept_reference(sub[:, order]) - base)
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4), (7, 12), (33, 64), (0, 8)])
def test_sum_after_2_to_4(device, dtype, shape):
    matrix = torch.randn(shape, dtype=torch.float64).to(dtype=dtype, device=device)
    got = _ops.sum_after_2_to_4(matrix, 0, shape[1])
    assert got.dtype == torch.float32 and got.shape == ()
    torch.testing.assert_close(float(got), kept_reference(matrix.cpu()), rtol=1e-5, atol=1e-5)
    if shape[1] >= 8:
        torch.testing.assert_close(
            float(_ops.sum_after_2_to_4(matrix, 4, 8)), kept_reference(matrix[:, 4:8].cpu()), rtol=1e-5, atol=1e-5
        )


def test_build_permute_map(device):
    matrix = torch.randn(9, 24, device=device)
    groups = torch.tensor([[0, 1], [2, 5], [1, 4]], device=device)
    from apex.contrib.sparsity.permutation_search_kernels.permutation_utilities import unique_permutations

    permutations = unique_permutations(8).to(device)
    assert permutations.shape == (35, 8)
    gains, best = _ops.build_permute_map(matrix, groups, permutations)
    expected_gains, expected_best = permute_map_reference(matrix.cpu(), groups.cpu(), permutations.cpu())
    torch.testing.assert_close(gains.cpu().double(), expected_gains, rtol=1e-5, atol=1e-5)
    assert best.tolist() == expected_best
    assert (gains >= 0).all()


def test_build_swap_map(device):
    matrix = torch.randn(5, 16, device=device)
    pairs = torch.tensor([[0, 1], [1, 3], [2, 0]], device=device)
    got = _ops.build_swap_map(matrix, pairs)
    torch.testing.assert_close(got.cpu().double(), swap_map_reference(matrix.cpu(), pairs.cpu()), rtol=1e-5, atol=1e-5)


def test_unique_permutations_are_the_distinct_layouts():
    from apex.contrib.sparsity.permutation_search_kernels.permutation_utilities import (
        predict_unique_combinations,
        unique_permutations,
    )

    for width, count in ((4, 1), (8, 35), (12, 5775)):
        layouts = unique_permutations(width)
        assert layouts.shape == (count, width) == (predict_unique_combinations(width, 4), width)
        assert layouts[0].tolist() == list(range(width))
        canonical = {
            tuple(sorted(tuple(sorted(row[i : i + 4])) for i in range(0, width, 4))) for row in layouts.tolist()
        }
        assert len(canonical) == count


OPCHECK_CASES = {
    "mn_1d_best": lambda d: (_ops.mn_1d_best, (torch.randn(8, 16, device=d), 4, 2)),
    "mn_2d_best": lambda d: (_ops.mn_2d_best, (torch.randn(8, 16, device=d, dtype=torch.float16), 4, 2)),
    "mn_2d_greedy": lambda d: (_ops.mn_2d_greedy, (torch.randn(8, 16, device=d, dtype=torch.bfloat16), 4, 2)),
    "sum_after_2_to_4": lambda d: (_ops.sum_after_2_to_4, (torch.randn(8, 16, device=d), 0, 16)),
    "build_permute_map": lambda d: (
        _ops.build_permute_map,
        (
            torch.randn(8, 16, device=d),
            torch.tensor([[0, 1], [2, 3]], device=d),
            torch.arange(8, device=d).repeat(3, 1),
        ),
    ),
    "build_swap_map": lambda d: (_ops.build_swap_map, (torch.randn(8, 16, device=d), torch.tensor([[0, 3]], device=d))),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_opcheck(device, case):
    function, args = OPCHECK_CASES[case](device)
    torch.library.opcheck(function, args)


BAD_INPUT = {  # case: (call, error, message)
    "1-D matrix": (lambda: _ops.mn_1d_best(torch.randn(16), 4, 2), ValueError, "^mn_1d_best: matrix must be 2-D"),
    "int matrix": (lambda: _ops.mn_1d_best(torch.ones(4, 4, dtype=torch.int64), 4, 2), TypeError, "matrix has dtype"),
    "m zero": (lambda: _ops.mn_1d_best(torch.randn(4, 4), 0, 0), ValueError, "m must be at least 1"),
    "n > m": (lambda: _ops.mn_2d_greedy(torch.randn(4, 4), 4, 5), ValueError, r"n must be in \[0, m\]"),
    "odd stripes": (lambda: _ops.sum_after_2_to_4(torch.randn(4, 6), 0, 4), ValueError, "not a multiple of 4"),
    "bad columns": (lambda: _ops.sum_after_2_to_4(torch.randn(4, 8), 4, 12), ValueError, "start_col=4 and end_col=12"),
    "int32 groups": (
        lambda: _ops.build_permute_map(
            torch.randn(4, 8), torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, 8, dtype=torch.int64)
        ),
        TypeError,
        "stripe_groups has dtype torch.int32",
    ),
    "wrong permutation width": (
        lambda: _ops.build_permute_map(
            torch.randn(4, 8), torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int64)
        ),
        ValueError,
        r"permutations must have shape \[\*, 8\]",
    ),
    "stripe out of range": (
        lambda: _ops.build_swap_map(torch.randn(4, 8), torch.tensor([[0, 2]])),
        IndexError,
        r"stripe_pairs has a value outside \[0, 2\)",
    ),
    "no permutations": (
        lambda: _ops.build_permute_map(
            torch.randn(4, 8), torch.zeros(1, 2, dtype=torch.int64), torch.zeros(0, 8, dtype=torch.int64)
        ),
        ValueError,
        "permutations is empty",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input(case):
    call, error, message = BAD_INPUT[case]
    with pytest.raises(error, match=message):
        call()


# the legacy module ---------------------------------------------------------------------------


def test_legacy_sum_after_2_to_4_on_numpy():
    matrix = np.random.default_rng(0).standard_normal((6, 16)).astype(np.float32)
    output = np.zeros(1, dtype=np.float32)
    assert permutation_search_cuda.sum_after_2_to_4(matrix.ravel(), 6, 16, 4, 12, 2, 32, output) == 0
    np.testing.assert_allclose(output[0], kept_reference(torch.from_numpy(matrix[:, 4:12])), rtol=1e-5)


def test_legacy_build_permute_map_and_check_permutations_on_numpy():
    rng = np.random.default_rng(1)
    matrix = rng.standard_normal((7, 24)).astype(np.float32)
    stripes = np.array([0, 2, 1, 5], dtype=np.uint32)
    permutations = np.array([list(range(8)), [0, 4, 2, 3, 1, 5, 6, 7], [4, 5, 6, 7, 0, 1, 2, 3]], dtype=np.uint32)
    improvements = np.zeros(2, dtype=np.float32)
    best = np.zeros(2, dtype=np.uint32)
    permutation_search_cuda.build_permute_map(
        matrix.ravel(), 7, 24, stripes, 2, 2, permutations.ravel(), 8, improvements, best
    )
    expected_gains, expected_best = permute_map_reference(
        torch.from_numpy(matrix), torch.tensor([[0, 2], [1, 5]]), torch.from_numpy(permutations.astype(np.int64))
    )
    np.testing.assert_allclose(improvements, expected_gains.numpy(), rtol=1e-5, atol=1e-5)
    assert best.tolist() == expected_best

    improvement = np.zeros(1, dtype=np.float32)
    chosen = np.zeros(1, dtype=np.uint32)
    permutation_search_cuda.check_permutations(matrix, 7, 24, stripes, 2, 2, permutations, 3, improvement, chosen)
    np.testing.assert_allclose(improvement[0], expected_gains[0].item(), rtol=1e-5, atol=1e-5)
    assert chosen[0] == expected_best[0]


def test_legacy_build_swap_map(device):
    matrix = torch.randn(5, 16, device=device)
    pairs = torch.tensor([0, 1, 3, 2], dtype=torch.int32, device=device)
    output = torch.zeros(32, device=device)
    permutation_search_cuda.build_swap_map(matrix.reshape(-1), 5, 16, pairs, output)
    expected = swap_map_reference(matrix.cpu(), torch.tensor([[0, 1], [3, 2]]))
    torch.testing.assert_close(output.cpu().double(), expected.reshape(-1), rtol=1e-5, atol=1e-5)


def test_legacy_bad_input():
    with pytest.raises(ValueError, match="matrix has 10 elements, expected rows\\*cols"):
        permutation_search_cuda.sum_after_2_to_4(np.zeros(10, np.float32), 2, 8, 0, 8, 1, 32, np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="output has room for 0 values"):
        permutation_search_cuda.sum_after_2_to_4(np.zeros(16, np.float32), 2, 8, 0, 8, 1, 32, np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="perm_length=4 must be 4\\*group_width"):
        permutation_search_cuda.build_permute_map(
            np.zeros(16, np.float32),
            2,
            8,
            np.zeros(2, np.uint32),
            1,
            2,
            np.zeros(8, np.uint32),
            4,
            np.zeros(1, np.float32),
            np.zeros(1, np.uint32),
        )


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    from apex.contrib.sparsity import create_mask

    def masked(weight):
        return weight * create_mask(weight, "m4n2_1d") + weight * create_mask(weight, "m4n2_2d_greedy")

    # Inductor on the GPU; on the CPU, AOT autograd without code generation (fast, same tracing).
    compiled = torch.compile(masked, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    weight = torch.randn(16, 32, 3, 3, device=device)
    torch.testing.assert_close(compiled(weight), masked(weight), rtol=0, atol=0)
