"""Exhaustive search over stripe-group windows (upstream's ``Exhaustive_Search``).

For every set of ``w = stripe_group_size / 4`` stripes, every distinct layout of their ``4w``
columns into stripes is tried (35 for w=2, 5775 for w=3) with the ``build_permute_map`` op; the
best improvements are applied greedily to groups that share no stripe, only the groups touching a
changed stripe are re-evaluated, and this repeats until nothing improves. Then up to
``escape_attempts`` times a random group is perturbed (one column of its first half swapped with
one of its second half) to leave a local optimum, and the search goes on. The result is the best
permutation seen, so never worse than the start.
"""

from __future__ import annotations

import time

import torch

from apex.contrib.sparsity import _ops
from apex.contrib.sparsity.permutation_search_kernels.permutation_utilities import (
    BestSeen,
    as_magnitude_tensor,
    generator,
    predict_unique_combinations,
    stripe_columns,
    stripe_groups,
    unique_permutations,
)

# Improvements below this are rounding, not progress.
IMPROVEMENT_THRESHOLD = 1e-4
# Most layouts one whole-matrix search (stripe_group_size=-1) may try.
MAX_WHOLE_MATRIX_LAYOUTS = 3_000_000


def search_matrix(magnitude: torch.Tensor, permutation: torch.Tensor) -> torch.Tensor:
    """The best layout of all the matrix's columns at once (small matrices only)."""
    cols = magnitude.shape[1]
    count = predict_unique_combinations(cols, 4)
    if count > MAX_WHOLE_MATRIX_LAYOUTS:
        raise ValueError(
            f"Exhaustive_Search: a whole-matrix search of {cols} columns would try {count} layouts "
            f"(more than {MAX_WHOLE_MATRIX_LAYOUTS}); pass stripe_group_size=8 or 12"
        )
    layouts = unique_permutations(cols).to(magnitude.device)
    group = torch.arange(cols // 4, device=magnitude.device).unsqueeze(0)
    _, best = _ops.build_permute_map(magnitude[:, permutation], group, layouts)
    return permutation[layouts[int(best[0])]]


def _windowed(magnitude, permutation, width, escape_attempts, rng):
    device = magnitude.device
    num_stripes = magnitude.shape[1] // 4
    if num_stripes < width:
        return permutation
    groups = stripe_groups(num_stripes, width).to(device)
    layouts = unique_permutations(4 * width).to(device)
    group_columns = stripe_columns(groups)
    improvements, best = _ops.build_permute_map(magnitude[:, permutation], groups, layouts)
    best_seen = BestSeen(magnitude, permutation)
    escapes = 0
    while True:
        order = torch.argsort(improvements, descending=True, stable=True).tolist()
        gains = improvements.tolist()
        used = torch.zeros(num_stripes, dtype=torch.bool)
        groups_cpu = groups.cpu()
        applied = False
        for index in order:
            if gains[index] <= IMPROVEMENT_THRESHOLD:
                break
            stripes = groups_cpu[index]
            if bool(used[stripes].any()):
                continue
            columns = group_columns[index]
            permutation[columns] = permutation[columns][layouts[int(best[index])]]
            used[stripes] = True
            applied = True
        if not applied:
            best_seen.offer(permutation)
            if escapes >= escape_attempts:
                break
            escapes += 1
            index = int(torch.randint(groups.shape[0], (1,), generator=rng))
            half = 2 * width
            src = int(torch.randint(half, (1,), generator=rng))
            dst = half + int(torch.randint(half, (1,), generator=rng))
            columns = group_columns[index]
            permutation[columns[[src, dst]]] = permutation[columns[[dst, src]]]
            used[groups_cpu[index]] = True
        # re-evaluate the groups that touch a changed stripe
        stale = used.to(device)[groups].any(dim=1).nonzero().squeeze(1)
        if stale.numel():
            gains_stale, best_stale = _ops.build_permute_map(magnitude[:, permutation], groups[stale], layouts)
            improvements[stale] = gains_stale
            best[stale] = best_stale
    best_seen.offer(permutation)
    return best_seen.permutation


def Exhaustive_Search(matrix, stripe_group_size=-1, escape_attempts=0, permutation=None, seed=1):
    """Search a column permutation of ``matrix`` that keeps more magnitude after 2:4 pruning.

    Args:
        matrix: 2-D tensor (any device) or NumPy array, columns a multiple of 4.
        stripe_group_size: columns per window, 8 or 12 (any multiple of 4); -1 searches the
            whole matrix at once (only for a few columns: 16 columns have 2.6 million layouts).
        escape_attempts: random perturbations tried after the search stalls.
        permutation: the starting permutation (a list; default the identity).
        seed: the seed of the search's own random generator (ours; upstream seeds NumPy's).

    Returns ``(matrix[:, permutation], seconds, permutation)`` with the matrix of the input's kind
    and the permutation a list, as upstream. Matrices wider than 512 columns with windows of 12
    are searched in two halves, then together with windows of 8 (upstream's schedule).
    """
    start = time.perf_counter()
    magnitude = as_magnitude_tensor(matrix)
    cols = magnitude.shape[1]
    if permutation is None:
        perm = torch.arange(cols, device=magnitude.device)
    else:
        perm = torch.as_tensor(list(permutation), dtype=torch.int64, device=magnitude.device)
        if perm.shape != (cols,) or not torch.equal(perm.sort().values, torch.arange(cols, device=perm.device)):
            raise ValueError(f"Exhaustive_Search: permutation must be a permutation of range({cols})")
    base = magnitude[:, perm]
    if stripe_group_size == -1:
        found = search_matrix(base, torch.arange(cols, device=base.device))
    else:
        if stripe_group_size < 8 or stripe_group_size % 4:
            raise ValueError(
                "Exhaustive_Search: stripe_group_size must be -1 or a multiple of 4 of at least 8, "
                f"got {stripe_group_size}"
            )
        rng = generator(seed)
        identity = torch.arange(cols, device=base.device)
        if stripe_group_size == 12 and cols > 512:
            split = cols // 2 // 4 * 4
            left = _windowed(base[:, :split], identity[:split].clone(), 3, escape_attempts, rng)
            right = _windowed(base[:, split:], identity[: cols - split].clone(), 3, escape_attempts, rng)
            found = _windowed(base, torch.cat([left, split + right]), 2, max(escape_attempts, 100) * 10, rng)
        else:
            found = _windowed(base, identity, stripe_group_size // 4, escape_attempts, rng)
    perm = perm[found].tolist()
    result = matrix[:, perm]
    return result, time.perf_counter() - start, perm
