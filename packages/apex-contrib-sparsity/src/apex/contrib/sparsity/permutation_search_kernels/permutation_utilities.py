"""Shared pieces of the channel-permutation searches.

A search works on a 2-D magnitude matrix ``[rows, C]`` whose columns are the input channels to
permute (the pruned weights of a sibling group, side by side in create_mask's layout); a
permutation ``perm`` reorders them as ``matrix[:, perm]``. "Stripe" ``s`` is columns ``4s..4s+3``,
one 2:4 group of every row. Everything runs as tensor ops on the matrix's device.
"""

from __future__ import annotations

import itertools
import math

import torch

from apex.contrib.sparsity import _ops


def as_magnitude_tensor(matrix) -> torch.Tensor:
    """A float32 (float64 kept) tensor of ``|matrix|``, from a tensor or a NumPy array."""
    t = matrix if isinstance(matrix, torch.Tensor) else torch.as_tensor(matrix)
    if t.dim() != 2:
        raise ValueError(f"permutation search: matrix must be 2-D, got shape {tuple(t.shape)}")
    if t.shape[1] % 4:
        raise ValueError(f"permutation search: matrix has {t.shape[1]} columns, not a multiple of 4")
    dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    return t.detach().abs().to(dtype).contiguous()


def like_input(result: torch.Tensor, original):
    """``result`` as the kind of ``original``: a tensor stays a tensor, a NumPy array comes back one."""
    if isinstance(original, torch.Tensor):
        return result.to(original.dtype)
    return result.cpu().numpy().astype(original.dtype, copy=False)


def sum_after_2_to_4(matrix) -> float:
    """The magnitude 2:4 pruning keeps of ``matrix`` (a tensor or NumPy array, columns a multiple of 4)."""
    t = as_magnitude_tensor(matrix)
    return float(_ops.sum_after_2_to_4(t, 0, t.shape[1]))


def predict_unique_combinations(C: int, M: int) -> int:
    """How many ways split C columns into unordered groups of M, each unordered."""
    if C % M:
        raise ValueError(f"predict_unique_combinations: C={C} is not a multiple of M={M}")
    groups = C // M
    return math.factorial(C) // (math.factorial(M) ** groups * math.factorial(groups))


_unique: dict[int, torch.Tensor] = {}


def unique_permutations(width: int) -> torch.Tensor:
    """The distinct ways to lay ``width`` columns (a multiple of 4) out as stripes of 4, as
    [count, width] int64 (CPU); row 0 is the identity. Column order inside a stripe and the order
    of the stripes do not change what 2:4 keeps, so each partition appears once, in the canonical
    form "each stripe sorted, stripes sorted by their first column"."""
    if width not in _unique:
        found: list[list[int]] = []

        def extend(built: list[int], remaining: list[int]) -> None:
            if not remaining:
                found.append(list(built))
                return
            if len(built) % 4 == 0:  # a new stripe starts with the smallest column left
                first, rest = remaining[0], remaining[1:]
                for chosen in itertools.combinations(rest, 3):
                    left = [c for c in rest if c not in chosen]
                    extend([*built, first, *chosen], left)

        extend([], list(range(width)))
        _unique[width] = torch.tensor(found, dtype=torch.int64)
    return _unique[width]


def stripe_groups(num_stripes: int, width: int) -> torch.Tensor:
    """All sets of ``width`` distinct stripes, as [count, width] int64 (CPU), each sorted."""
    if num_stripes < width:
        return torch.zeros(0, width, dtype=torch.int64)
    return torch.combinations(torch.arange(num_stripes), r=width).reshape(-1, width)


def stripe_columns(stripes: torch.Tensor) -> torch.Tensor:
    """The column indices of stripes ``[..., w]``, side by side: ``[..., 4w]``."""
    columns = stripes.unsqueeze(-1) * 4 + torch.arange(4, device=stripes.device)
    return columns.reshape(*stripes.shape[:-1], 4 * stripes.shape[-1])


class BestSeen:
    """The permutation keeping the most magnitude among those a search went through."""

    def __init__(self, magnitude: torch.Tensor, permutation: torch.Tensor):
        self.magnitude = magnitude
        self.value = _ops.kept_magnitude(magnitude[:, permutation])
        self.permutation = permutation.clone()

    def offer(self, permutation: torch.Tensor) -> float:
        value = _ops.kept_magnitude(self.magnitude[:, permutation])
        if value > self.value:
            self.value, self.permutation = value, permutation.clone()
        return value


def generator(seed: int) -> torch.Generator:
    """A private CPU random generator (the searches never touch torch's global ones)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g
