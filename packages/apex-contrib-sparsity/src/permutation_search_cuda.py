"""Upstream Apex's ``permutation_search_cuda`` extension module, on apex-contrib-sparsity's ops.

Upstream's pybind11 functions, with their argument orders: NumPy inputs (the matrix flattened
float32 ``rows*cols``, index arrays uint32), results written into the output arrays passed in,
and 0 returned. The work is the ops ``torch.ops.apex_contrib_sparsity.sum_after_2_to_4``,
``build_permute_map`` and ``build_swap_map`` (PyTorch references). They take torch tensors too,
on any device: a CUDA tensor is computed on its GPU by those references (there is no CUDA kernel
of ours for them; upstream copied NumPy arrays to the GPU on every call). Unlike upstream, a
matrix whose size is not ``rows*cols`` or an index out of range raises instead of reading out of
bounds.

- ``sum_after_2_to_4(matrix, rows, cols, start_col, end_col, blocks, threads, output)``:
  ``output[0]`` = magnitude kept by 2:4 pruning of columns ``[start_col, end_col)``. ``blocks`` and
  ``threads`` were upstream's launch shape and are ignored: all the columns are summed (upstream's
  kernel drops the last stripes when the stripe count is not a multiple of ``blocks``).
- ``build_permute_map(matrix, rows, cols, stripes, num_groups, group_width, permutations,
  perm_length, improvements, best_indices)``: per group of ``group_width`` stripes, the best of
  the permutations (``perm_length = 4 * group_width`` values each) and its gain over the first.
- ``check_permutations(matrix, rows, cols, stripe_groups, group_width, num_groups, permutations,
  num_permutations, improvement, permutation)``: the same for the first group of stripes only
  (as upstream's kernel), into ``improvement[0]`` and ``permutation[0]``.
- ``build_swap_map(matrix, rows, cols, stripe_pairs, output)``: per pair of stripes, the gains of
  the 16 single-column swaps, ``output[16*pair + 4*c0 + c1]``.
"""

from __future__ import annotations

import torch

import apex.contrib.sparsity._ops  # noqa: F401  (registers the ops)

_ops = torch.ops.apex_contrib_sparsity


def _tensor(x, name: str, function: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.as_tensor(x)
    except (TypeError, RuntimeError) as error:
        raise TypeError(
            f"permutation_search_cuda.{function}: {name} must be a NumPy array or a tensor ({error})"
        ) from None


def _matrix(matrix, rows: int, cols: int, function: str) -> torch.Tensor:
    t = _tensor(matrix, "matrix", function)
    if t.numel() != rows * cols:
        raise ValueError(
            f"permutation_search_cuda.{function}: matrix has {t.numel()} elements, expected rows*cols = {rows}*{cols}"
        )
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        t = t.float()
    return t.reshape(rows, cols)


def _indices(x, name: str, count: int, device: torch.device, function: str) -> torch.Tensor:
    t = _tensor(x, name, function).reshape(-1)
    if t.numel() < count:
        raise ValueError(f"permutation_search_cuda.{function}: {name} has {t.numel()} values, expected {count}")
    return t[:count].to(device=device, dtype=torch.int64)


def _write(out, values: torch.Tensor, name: str, function: str) -> None:
    target = _tensor(out, name, function).reshape(-1)
    if target.numel() < values.numel():
        raise ValueError(
            f"permutation_search_cuda.{function}: {name} has room for {target.numel()} values, "
            f"{values.numel()} are written"
        )
    target[: values.numel()].copy_(values.reshape(-1).to(target.dtype))


def sum_after_2_to_4(matrix, rows, cols, start_col, end_col, blocks, threads, output) -> int:
    m = _matrix(matrix, rows, cols, "sum_after_2_to_4")
    _write(output, _ops.sum_after_2_to_4(m, start_col, end_col), "output", "sum_after_2_to_4")
    return 0


def build_permute_map(
    matrix, rows, cols, stripes, num_groups, group_width, permutations, perm_length, improvements, best_indices
) -> int:
    function = "build_permute_map"
    m = _matrix(matrix, rows, cols, function)
    groups = _indices(stripes, "stripes", num_groups * group_width, m.device, function).reshape(num_groups, group_width)
    perms = _tensor(permutations, "permutations", function).reshape(-1)
    if perm_length != 4 * group_width or perms.numel() % perm_length:
        raise ValueError(
            f"permutation_search_cuda.{function}: perm_length={perm_length} must be 4*group_width = {4 * group_width} "
            f"and divide the {perms.numel()} values of permutations"
        )
    perms = perms.to(device=m.device, dtype=torch.int64).reshape(-1, perm_length)
    gains, best = _ops.build_permute_map(m, groups, perms)
    _write(improvements, gains, "improvements", function)
    _write(best_indices, best, "best_indices", function)
    return 0


def check_permutations(
    matrix, rows, cols, stripe_groups, group_width, num_groups, permutations, num_permutations, improvement, permutation
) -> int:
    function = "check_permutations"
    m = _matrix(matrix, rows, cols, function)
    group = _indices(stripe_groups, "stripe_groups", group_width, m.device, function).reshape(1, group_width)
    perms = _indices(permutations, "permutations", num_permutations * 4 * group_width, m.device, function)
    gains, best = _ops.build_permute_map(m, group, perms.reshape(num_permutations, 4 * group_width))
    _write(improvement, gains[:1], "improvement", function)
    _write(permutation, best[:1], "permutation", function)
    return 0


def build_swap_map(matrix, rows, cols, stripe_pairs, output) -> int:
    function = "build_swap_map"
    m = _matrix(matrix, rows, cols, function)
    flat = _tensor(stripe_pairs, "stripe_pairs", function).reshape(-1)
    pairs = _indices(flat, "stripe_pairs", flat.numel() // 2 * 2, m.device, function).reshape(-1, 2)
    _write(output, _ops.build_swap_map(m, pairs), "output", function)
    return 0


__all__ = ["build_permute_map", "build_swap_map", "check_permutations", "sum_after_2_to_4"]
