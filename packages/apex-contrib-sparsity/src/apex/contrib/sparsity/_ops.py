"""apex_contrib_sparsity's dispatcher ops: schemas, checks, references, fakes.

Pure PyTorch (no compiled library): the references run on every device, on the weights' own
device, as batched tensor ops (upstream computes the 2-D masks with NumPy loops on the host and
the permutation search with a pybind11 CUDA extension fed from NumPy arrays).

Masks (``matrix`` is 2-D ``[rows, cols]``, float32/float16/bfloat16/float64; the groups run along
``cols``; every op returns a bool mask of ``matrix``'s shape):

- ``mn_1d_best(matrix, m, n)``: in every group of ``m`` consecutive elements of a row, the ``n``
  of largest magnitude are kept (the best of the ``C(m, n)`` 1-D patterns).
- ``mn_2d_best(matrix, m, n)``: every ``m x m`` block gets the pattern, among all 0/1 blocks
  with exactly ``n`` ones in every row and every column, that keeps the most magnitude.
- ``mn_2d_greedy(matrix, m, n)``: every ``m x m`` block is filled greedily, largest magnitude
  first, skipping an element whose row or column already holds ``n`` kept ones (upstream's
  greedy rule; a block may end with fewer than ``n`` in some rows and columns).

Magnitudes are compared in float32 (float64 for float64 input). Ties go to the lower index.

Permutation search (``matrix`` 2-D with ``cols`` a multiple of 4; "stripe" ``s`` is columns
``4s .. 4s+3``; "kept magnitude" is, summed over rows and stripes, the sum of the two largest
magnitudes of the stripe's four values, i.e. what 2:4 pruning keeps):

- ``sum_after_2_to_4(matrix, start_col, end_col) -> float32 scalar``: the kept magnitude of
  columns ``[start_col, end_col)`` (multiples of 4).
- ``build_permute_map(matrix, stripe_groups [G, w] int64, permutations [P, 4w] int64)
  -> (improvements [G] float32, best [G] int64)``: for each group of ``w`` stripes, gathered side
  by side into ``4w`` columns, the kept magnitude under each permutation of those columns
  (``permuted[:, j] = gathered[:, permutation[j]]``); ``best`` is the first permutation with the
  largest kept magnitude, ``improvements`` its gain over permutation 0.
- ``build_swap_map(matrix, stripe_pairs [N, 2] int64) -> [N, 16] float32``: for each pair of
  stripes and each ``(c0, c1)``, entry ``4*c0 + c1`` is the change in the pair's kept magnitude
  when column ``c0`` of the first stripe and column ``c1`` of the second are swapped.
"""

from __future__ import annotations

import functools
import itertools

import torch

from apex.contrib.sparsity._plugin import KERNELS
from apex.core.library import op

MATRIX_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_DTYPE_NAMES = "float32, float16, bfloat16, float64"
# Elements of the largest temporary one chunk of a batched computation may allocate.
_CHUNK_ELEMENTS = 1 << 24
# The most candidate blocks mn_2d_best compares (90 for 4x4 with 2 per row and column).
MAX_2D_PATTERNS = 100_000


# checks ----------------------------------------------------------------------------------------


def _check_matrix(op_name: str, matrix: torch.Tensor) -> None:
    if matrix.dtype not in MATRIX_DTYPES:
        raise TypeError(f"{op_name}: matrix has dtype {matrix.dtype}; expected one of {_DTYPE_NAMES}")
    if matrix.dim() != 2:
        raise ValueError(f"{op_name}: matrix must be 2-D, got shape {tuple(matrix.shape)}")
    if matrix.layout != torch.strided:
        raise ValueError(f"{op_name}: matrix has layout {matrix.layout}; only dense (strided) tensors are supported")


def _check_m_n(op_name: str, m: int, n: int) -> None:
    if m < 1:
        raise ValueError(f"{op_name}: m must be at least 1, got {m}")
    if not 0 <= n <= m:
        raise ValueError(f"{op_name}: n must be in [0, m] = [0, {m}], got {n}")


def _check_1d(a) -> None:
    _check_matrix(a.op, a.matrix)
    _check_m_n(a.op, a.m, a.n)
    if a.matrix.shape[1] % a.m:
        raise ValueError(
            f"{a.op}: matrix has {a.matrix.shape[1]} columns (shape {tuple(a.matrix.shape)}), not a multiple of m={a.m}"
        )


def _check_2d(a) -> None:
    _check_matrix(a.op, a.matrix)
    _check_m_n(a.op, a.m, a.n)
    rows, cols = a.matrix.shape
    if rows % a.m or cols % a.m:
        raise ValueError(
            f"{a.op}: matrix has shape {tuple(a.matrix.shape)}; both dimensions must be multiples of m={a.m} "
            f"(the {a.m}x{a.m} blocks)"
        )


def _check_index(op_name: str, name: str, t: torch.Tensor, device: torch.device, width: int | None) -> None:
    if t.dtype != torch.int64:
        raise TypeError(f"{op_name}: {name} has dtype {t.dtype}; expected int64")
    if t.dim() != 2 or (width is not None and t.shape[1] != width):
        expected = f"[*, {width}]" if width is not None else "2-D"
        raise ValueError(f"{op_name}: {name} must have shape {expected}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{op_name}: {name} is on {t.device}, expected {device} (matrix's device)")


def _check_stripes(op_name: str, matrix: torch.Tensor) -> None:
    _check_matrix(op_name, matrix)
    if matrix.shape[1] % 4:
        raise ValueError(f"{op_name}: matrix has {matrix.shape[1]} columns, not a multiple of 4 (the stripes)")


def _check_sum(a) -> None:
    _check_stripes(a.op, a.matrix)
    cols = a.matrix.shape[1]
    if not (0 <= a.start_col <= a.end_col <= cols) or a.start_col % 4 or a.end_col % 4:
        raise ValueError(
            f"{a.op}: start_col={a.start_col} and end_col={a.end_col} must be multiples of 4 with "
            f"0 <= start_col <= end_col <= {cols} (matrix's columns)"
        )


def _check_permute_map(a) -> None:
    _check_stripes(a.op, a.matrix)
    _check_index(a.op, "stripe_groups", a.stripe_groups, a.matrix.device, None)
    width = a.stripe_groups.shape[1]
    _check_index(a.op, "permutations", a.permutations, a.matrix.device, 4 * width)
    if a.permutations.shape[0] == 0:
        raise ValueError(f"{a.op}: permutations is empty; pass at least one (the first is the baseline)")


def _check_swap_map(a) -> None:
    _check_stripes(a.op, a.matrix)
    _check_index(a.op, "stripe_pairs", a.stripe_pairs, a.matrix.device, 2)


# helpers ---------------------------------------------------------------------------------------


def _magnitudes(matrix: torch.Tensor) -> torch.Tensor:
    return matrix.abs().to(torch.float64 if matrix.dtype == torch.float64 else torch.float32)


def _chunks(total: int, per_item: int):
    """Slices of range(total) whose items each cost ``per_item`` elements of temporaries."""
    step = max(1, _CHUNK_ELEMENTS // max(per_item, 1))
    for start in range(0, total, step):
        yield slice(start, min(total, start + step))


def kept_2_of_4(x: torch.Tensor) -> torch.Tensor:
    """The sum of the two largest of the four values along the last dimension (non-negative input).

    The two largest are one of each pair (a, b), (c, d), or both of one pair; each candidate sums
    two distinct values, so the largest candidate is the answer.
    """
    a, b, c, d = x.unbind(-1)
    return torch.maximum(torch.maximum(a, b) + torch.maximum(c, d), torch.maximum(a + b, c + d))


def _blocks(magnitude: torch.Tensor, m: int) -> torch.Tensor:
    """[rows, cols] -> [rows/m * cols/m, m*m]: each m x m block as one row, row-major inside."""
    rows, cols = magnitude.shape
    return magnitude.reshape(rows // m, m, cols // m, m).permute(0, 2, 1, 3).reshape(-1, m * m)


def _unblocks(blocks: torch.Tensor, rows: int, cols: int, m: int) -> torch.Tensor:
    return blocks.reshape(rows // m, cols // m, m, m).permute(0, 2, 1, 3).reshape(rows, cols)


_patterns_2d: dict[tuple[int, int], torch.Tensor] = {}


def valid_2d_patterns(m: int, n: int) -> torch.Tensor:
    """All m x m 0/1 blocks with exactly n ones in every row and column, as [count, m*m] float32 (CPU).

    Raises ValueError when there are more than MAX_2D_PATTERNS of them (8x8 with 4 per row has
    about 1.2e11): use the greedy 2-D pattern there.
    """
    key = (m, n)
    if key not in _patterns_2d:
        count = _count_2d_patterns(tuple([n] * m), m, n)
        if count > MAX_2D_PATTERNS:
            raise ValueError(
                f"mn_2d_best: {m}x{m} blocks with {n} per row and column have {count} valid patterns to compare "
                f"(more than {MAX_2D_PATTERNS}); use the greedy 2-D pattern for this m"
            )
        rows = list(_row_patterns(m, n))
        found: list[list[tuple[int, ...]]] = []

        def extend(chosen: list, column_counts: list) -> None:
            if len(chosen) == m:
                if all(c == n for c in column_counts):
                    found.append(list(chosen))
                return
            left = m - len(chosen) - 1
            for row in rows:
                counts = [c + v for c, v in zip(column_counts, row)]
                # each column still needs n - count ones from the rows left
                if all(c <= n and n - c <= left for c in counts):
                    chosen.append(row)
                    extend(chosen, counts)
                    chosen.pop()

        extend([], [0] * m)
        _patterns_2d[key] = torch.tensor(found, dtype=torch.float32).reshape(len(found), m * m)
    return _patterns_2d[key]


@functools.cache
def _count_2d_patterns(room: tuple, rows_left: int, n: int) -> int:
    """How many ways fill ``rows_left`` rows with n ones each, column c taking at most room[c] more
    (room sorted, so equal states share the cache)."""
    if rows_left == 0:
        return int(all(r == 0 for r in room))
    total = 0
    for columns in itertools.combinations(range(len(room)), n):
        if all(room[c] > 0 for c in columns):
            after = tuple(sorted(r - (c in columns) for c, r in enumerate(room)))
            total += _count_2d_patterns(after, rows_left - 1, n)
    return total


def _row_patterns(m: int, n: int):
    for combination in itertools.combinations(range(m), n):
        yield tuple(1 if i in combination else 0 for i in range(m))


# mask ops --------------------------------------------------------------------------------------


def _mask_fake(a):
    return torch.empty(a.matrix.shape, dtype=torch.bool, device=a.matrix.device)


@op(KERNELS, "mn_1d_best(Tensor matrix, int m, int n) -> Tensor", check=_check_1d, fake=_mask_fake)
def mn_1d_best(a):
    matrix, m, n = a.matrix, a.m, a.n
    groups = _magnitudes(matrix).reshape(-1, m)
    if m <= 4:
        # the rank of each element by m*(m-1)/2 comparisons (faster than a sort for m <= 4, 1.6x
        # on the CPU for 4096x4096): an element is beaten by a larger one, or an equal one of
        # lower index, and kept when fewer than n beat it
        columns = groups.unbind(1)
        ranks = [torch.zeros(groups.shape[0], dtype=torch.uint8, device=matrix.device) for _ in range(m)]
        for i in range(m):
            for j in range(i + 1, m):
                j_beats_i = columns[j] > columns[i]
                ranks[i] += j_beats_i
                ranks[j] += ~j_beats_i
        mask = torch.stack(ranks, dim=1) < n if m > 1 else torch.full_like(groups, n > 0, dtype=torch.bool)
        return mask.reshape(matrix.shape)
    mask = torch.zeros(groups.shape, dtype=torch.bool, device=matrix.device)
    if n and groups.numel():
        # a stable descending sort: among equal magnitudes the lower index is kept
        order = torch.sort(groups, dim=1, descending=True, stable=True).indices[:, :n]
        mask.scatter_(1, order, True)
    return mask.reshape(matrix.shape)


@op(KERNELS, "mn_2d_best(Tensor matrix, int m, int n) -> Tensor", check=_check_2d, fake=_mask_fake)
def mn_2d_best(a):
    matrix, m, n = a.matrix, a.m, a.n
    rows, cols = matrix.shape
    magnitude = _magnitudes(matrix)
    blocks = _blocks(magnitude, m)
    patterns = valid_2d_patterns(m, n).to(matrix.device) > 0.5
    # each pattern as the m*n positions it keeps: scores are exact sums, not a matmul (which TF32
    # or a low-precision reduction would round)
    kept = patterns.nonzero()[:, 1].reshape(patterns.shape[0], m * n)
    best = torch.empty(blocks.shape[0], dtype=torch.int64, device=matrix.device)
    for part in _chunks(blocks.shape[0], kept.numel()):
        scores = blocks[part][:, kept].sum(dim=2)
        # argmax returns the first maximum: ties go to the earlier pattern
        best[part] = torch.argmax(scores, dim=1)
    chosen = patterns[best]
    return _unblocks(chosen, rows, cols, m)


@op(KERNELS, "mn_2d_greedy(Tensor matrix, int m, int n) -> Tensor", check=_check_2d, fake=_mask_fake)
def mn_2d_greedy(a):
    matrix, m, n = a.matrix, a.m, a.n
    rows, cols = matrix.shape
    blocks = _blocks(_magnitudes(matrix), m)
    count = blocks.shape[0]
    order = torch.sort(blocks, dim=1, descending=True, stable=True).indices
    kept = torch.zeros(blocks.shape, dtype=torch.bool, device=matrix.device)
    in_row = torch.zeros(count, m, dtype=torch.int64, device=matrix.device)
    in_column = torch.zeros(count, m, dtype=torch.int64, device=matrix.device)
    # m*m steps, each over all blocks at once: the element of rank k is kept if its row and column
    # still have room.
    for k in range(m * m):
        index = order[:, k : k + 1]
        row, column = index // m, index % m
        room = (in_row.gather(1, row) < n) & (in_column.gather(1, column) < n)
        kept.scatter_(1, index, room)
        in_row.scatter_add_(1, row, room.long())
        in_column.scatter_add_(1, column, room.long())
    return _unblocks(kept, rows, cols, m)


# permutation search ops ------------------------------------------------------------------------


def _scalar_fake(a):
    return torch.empty((), dtype=torch.float32, device=a.matrix.device)


@op(
    KERNELS,
    "sum_after_2_to_4(Tensor matrix, int start_col, int end_col) -> Tensor",
    check=_check_sum,
    fake=_scalar_fake,
)
def sum_after_2_to_4(a):
    part = _magnitudes(a.matrix[:, a.start_col : a.end_col])
    return kept_2_of_4(part.reshape(part.shape[0], part.shape[1] // 4, 4)).sum().to(torch.float32)


def _permute_map_fake(a):
    groups = a.stripe_groups.shape[0]
    device = a.matrix.device
    return torch.empty(groups, dtype=torch.float32, device=device), torch.empty(
        groups, dtype=torch.int64, device=device
    )


def _check_index_values(op_name: str, name: str, t: torch.Tensor, limit: int) -> None:
    """Index values in [0, limit); reads the values (a host sync on CUDA, as upstream's copies)."""
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= limit):
        raise IndexError(f"{op_name}: {name} has a value outside [0, {limit})")


@op(
    KERNELS,
    "build_permute_map(Tensor matrix, Tensor stripe_groups, Tensor permutations) -> (Tensor, Tensor)",
    check=_check_permute_map,
    fake=_permute_map_fake,
)
def build_permute_map(a):
    matrix, groups, permutations = a.matrix, a.stripe_groups, a.permutations
    width = groups.shape[1]
    _check_index_values(a.op, "stripe_groups", groups, matrix.shape[1] // 4)
    _check_index_values(a.op, "permutations", permutations, 4 * width)
    magnitude = _magnitudes(matrix)
    rows = magnitude.shape[0]
    columns = (groups.unsqueeze(2) * 4 + torch.arange(4, device=matrix.device)).reshape(groups.shape[0], 4 * width)
    sums = torch.empty(groups.shape[0], permutations.shape[0], dtype=magnitude.dtype, device=matrix.device)
    per_group = rows * permutations.shape[0] * 4 * width
    for part in _chunks(groups.shape[0], per_group):
        gathered = magnitude[:, columns[part]]  # [rows, g, 4w]
        permuted = gathered[:, :, permutations]  # [rows, g, P, 4w]
        kept = kept_2_of_4(permuted.reshape(*permuted.shape[:3], width, 4)).sum(dim=(0, 3))
        sums[part] = kept
    if sums.shape[0] == 0:
        return _permute_map_fake(a)[0].zero_(), _permute_map_fake(a)[1].zero_()
    best_sum = sums.max(dim=1).values
    # the first permutation reaching the maximum (max() may return any of them)
    best = (sums == best_sum.unsqueeze(1)).to(torch.int8).argmax(dim=1)
    return (best_sum - sums[:, 0]).to(torch.float32), best


# The 16 swaps of build_swap_map as permutations of the 8 columns of a pair of stripes.
_SWAPS = []
for _c0 in range(4):
    for _c1 in range(4):
        _swap = list(range(8))
        _swap[_c0], _swap[4 + _c1] = 4 + _c1, _c0
        _SWAPS.append(_swap)


@op(
    KERNELS,
    "build_swap_map(Tensor matrix, Tensor stripe_pairs) -> Tensor",
    check=_check_swap_map,
    fake=lambda a: torch.empty(a.stripe_pairs.shape[0], 16, dtype=torch.float32, device=a.matrix.device),
)
def build_swap_map(a):
    matrix, pairs = a.matrix, a.stripe_pairs
    _check_index_values(a.op, "stripe_pairs", pairs, matrix.shape[1] // 4)
    magnitude = _magnitudes(matrix)
    rows = magnitude.shape[0]
    swaps = torch.tensor(_SWAPS, device=matrix.device)
    columns = (pairs.unsqueeze(2) * 4 + torch.arange(4, device=matrix.device)).reshape(pairs.shape[0], 8)
    out = torch.empty(pairs.shape[0], 16, dtype=magnitude.dtype, device=matrix.device)
    for part in _chunks(pairs.shape[0], rows * 16 * 8):
        gathered = magnitude[:, columns[part]]  # [rows, p, 8]
        base = kept_2_of_4(gathered.reshape(rows, gathered.shape[1], 2, 4)).sum(dim=(0, 2))
        swapped = gathered[:, :, swaps]  # [rows, p, 16, 8]
        kept = kept_2_of_4(swapped.reshape(rows, swapped.shape[1], 16, 2, 4)).sum(dim=(0, 3))
        out[part] = kept - base.unsqueeze(1)
    return out.to(torch.float32)


def kept_magnitude(matrix: torch.Tensor) -> float:
    """The magnitude 2:4 pruning keeps of a 2-D matrix whose columns are a multiple of 4."""
    return float(sum_after_2_to_4(matrix, 0, matrix.shape[1]))


__all__ = [
    "build_permute_map",
    "build_swap_map",
    "kept_magnitude",
    "mn_1d_best",
    "mn_2d_best",
    "mn_2d_greedy",
    "sum_after_2_to_4",
    "valid_2d_patterns",
]
