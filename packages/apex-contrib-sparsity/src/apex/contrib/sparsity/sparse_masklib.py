"""N:M structured sparsity masks (upstream's ``apex.contrib.sparsity.sparse_masklib``).

:func:`create_mask` is the entry point; the pattern functions below keep upstream's names and
signatures (``mn_*(matrix, m, n)`` on a 2-D matrix, ``m4n2_*(matrix, density)``) and return int32
masks as upstream's do. The work is done by the ops of :mod:`apex.contrib.sparsity._ops`, on the
tensor's own device.

Differences from upstream, on purpose:

- Pattern names: upstream looks the name up as a function of this module, so only ``m4n2_1d``,
  ``m4n2_2d_greedy`` and ``m4n2_2d_best`` work there. We accept those and the generic
  ``m<M>n<N>_1d``, ``m<M>n<N>_2d_greedy`` and ``m<M>n<N>_2d_best`` (keep N of every M); any other
  name raises ValueError listing them (upstream fails with "'NoneType' object is not callable").
- Upstream's 2-D patterns do not run at HEAD (``mn_2d_best`` calls an undefined ``reshape_2d``,
  ``mn_2d_greedy`` calls ``.cuda()`` on a NumPy array); ours are implemented as their docstrings
  describe, as batched tensor ops.
- 5-D weights (Conv3d, ``[K, C, D, R, S]``) are masked along C like 3-D and 4-D ones (upstream's
  create_mask has no 5-D case and returns None, although ASP's default whitelist has Conv3d).
- A group dimension that is not a multiple of M (or, for 2-D patterns, a matrix not made of whole
  M x M blocks) raises ValueError naming the shape; upstream fails inside with a shape error.
- ``density`` is accepted and ignored, as upstream's: N and M fix the density.
"""

from __future__ import annotations

import itertools
import re

import torch

from apex.contrib.sparsity import _ops

_PATTERN = re.compile(r"^m(\d+)n(\d+)_(1d|2d_greedy|2d_best)$")
VALID_PATTERNS = (
    "m4n2_1d, m4n2_2d_greedy, m4n2_2d_best, or in general m<M>n<N>_1d, m<M>n<N>_2d_greedy, "
    "m<M>n<N>_2d_best (keep N of every M; 1 <= M, 0 <= N <= M)"
)
_KINDS = {"1d": _ops.mn_1d_best, "2d_greedy": _ops.mn_2d_greedy, "2d_best": _ops.mn_2d_best}


def parse_pattern(pattern: str):
    """``(m, n, op)`` for a pattern name; ValueError listing the valid names otherwise."""
    match = _PATTERN.match(pattern) if isinstance(pattern, str) else None
    if match is None:
        raise ValueError(f"create_mask: unknown pattern {pattern!r}; valid patterns: {VALID_PATTERNS}")
    m, n = int(match.group(1)), int(match.group(2))
    if m < 1 or n > m:
        raise ValueError(f"create_mask: pattern {pattern!r} keeps {n} of every {m}; valid patterns: {VALID_PATTERNS}")
    return m, n, _KINDS[match.group(3)]


def fill(x: torch.Tensor) -> float:
    """The fraction of non-zero elements of ``x``."""
    return float(x.count_nonzero()) / x.numel()


def reshape_1d(matrix: torch.Tensor, m: int):
    """``(matrix as [rows*cols/m, m], padded shape)``, zero-padding the columns to a multiple of m."""
    rows, cols = matrix.shape
    if cols % m:
        padded = matrix.new_zeros(rows, cols + m - cols % m)
        padded[:, :cols] = matrix
        return padded.view(-1, m), padded.shape
    return matrix.reshape(-1, m), matrix.shape


def compute_valid_1d_patterns(m: int, n: int) -> torch.Tensor:
    """The C(m, n) rows of m values with n ones, as float32 [count, m]."""
    eye = torch.eye(m)
    return torch.stack([eye[list(c)].sum(0) for c in itertools.combinations(range(m), n)])


def compute_valid_2d_patterns(m: int, n: int) -> torch.Tensor:
    """The m x m 0/1 blocks with n ones in every row and column, as float32 [count, m, m]."""
    return _ops.valid_2d_patterns(m, n).view(-1, m, m)


def mn_1d_best(matrix: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Keep the n largest magnitudes of every m consecutive elements of each row (int32 mask)."""
    return _ops.mn_1d_best(matrix, m, n).to(torch.int32)


def m4n2_1d(mat: torch.Tensor, density: float) -> torch.Tensor:
    return mn_1d_best(mat, 4, 2)


def mn_2d_greedy(matrix: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Per m x m block, keep elements largest first while their row and column have room (int32 mask)."""
    return _ops.mn_2d_greedy(matrix, m, n).to(torch.int32)


def m4n2_2d_greedy(mat: torch.Tensor, density: float) -> torch.Tensor:
    return mn_2d_greedy(mat, 4, 2)


def mn_2d_best(matrix: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Per m x m block, the n-per-row-and-column pattern keeping the most magnitude (int32 mask)."""
    return _ops.mn_2d_best(matrix, m, n).to(torch.int32)


def m4n2_2d_best(mat: torch.Tensor, density: float) -> torch.Tensor:
    return mn_2d_best(mat, 4, 2)


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """The 2-D view create_mask prunes: the groups run along the last dimension, which is the
    input channels C of a weight. 1-D ``[C]`` -> ``[1, C]``; 2-D (Linear ``[K, C]``) as is;
    3-D (Conv1d ``[K, C, R]``) -> ``[K*R, C]``; 4-D (Conv2d ``[K, C, R, S]``) -> ``[R*S*K, C]``;
    5-D (Conv3d ``[K, C, D, R, S]``) -> ``[D*R*S*K, C]``."""
    dims = tensor.dim()
    if dims == 1:
        return tensor.reshape(1, -1)
    if dims == 2:
        return tensor
    if dims == 3:
        return tensor.permute(0, 2, 1).reshape(-1, tensor.shape[1])
    if dims in (4, 5):
        return tensor.permute(*range(2, dims), 0, 1).reshape(-1, tensor.shape[1])
    raise ValueError(f"create_mask: tensor must have 1 to 5 dimensions, got shape {tuple(tensor.shape)}")


def from_matrix(matrix: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The inverse of :func:`as_matrix` for a tensor of ``shape``."""
    dims = len(shape)
    if dims <= 2:
        return matrix.reshape(shape)
    if dims == 3:
        return matrix.reshape(shape[0], shape[2], shape[1]).permute(0, 2, 1)
    spatial = tuple(shape[2:])
    order = (dims - 2, dims - 1, *range(dims - 2))
    return matrix.reshape(*spatial, shape[0], shape[1]).permute(*order)


def create_mask(tensor: torch.Tensor, pattern: str = "m4n2_1d", density: float = 0.5) -> torch.Tensor:
    """A 0/1 mask of ``tensor``'s shape, dtype and device, keeping N of every M elements.

    Args:
        tensor: a float tensor (float32, float16, bfloat16, float64) of 1 to 5 dimensions; the
            groups of M run along the input channels (dimension 1 of a 2-D to 5-D weight, the
            only dimension of a 1-D tensor), see :func:`as_matrix`.
        pattern: ``m4n2_1d`` (default; the 2 largest magnitudes of every 4), ``m4n2_2d_greedy``,
            ``m4n2_2d_best`` (4 x 4 blocks of the 2-D view pruned 2:4 along both rows and
            columns, greedily or by the best of the 90 such blocks), or the same for any M and N:
            ``m<M>n<N>_1d``, ``m<M>n<N>_2d_greedy``, ``m<M>n<N>_2d_best``.
        density: ignored (as upstream's): N/M is the density.

    Magnitudes are compared in float32 (float64 for float64); ties keep the lower index.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"create_mask: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    m, n, compute = parse_pattern(pattern)
    if tensor.dtype not in _ops.MATRIX_DTYPES:
        raise TypeError(
            f"create_mask: tensor has dtype {tensor.dtype}; expected one of float32, float16, bfloat16, float64"
        )
    matrix = as_matrix(tensor.detach()).contiguous()
    mask = compute(matrix, m, n)
    return from_matrix(mask, tensor.shape).to(tensor.dtype).contiguous()


__all__ = [
    "VALID_PATTERNS",
    "compute_valid_1d_patterns",
    "compute_valid_2d_patterns",
    "create_mask",
    "fill",
    "m4n2_1d",
    "m4n2_2d_best",
    "m4n2_2d_greedy",
    "mn_1d_best",
    "mn_2d_best",
    "mn_2d_greedy",
    "reshape_1d",
]
