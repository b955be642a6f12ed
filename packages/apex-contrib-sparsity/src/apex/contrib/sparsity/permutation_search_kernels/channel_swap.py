"""Channel swap search (upstream's ``Channel_Swap``).

For every pair of stripes, the ``build_swap_map`` op gives the gain of each of the 16 swaps of
one column of the first stripe with one of the second. The best swaps are applied greedily to
pairs that share no stripe, the pairs touching a changed stripe are re-evaluated, and this
repeats until no swap gains. Then up to ``escape_attempts`` times two random columns of
different stripes are swapped to leave a local optimum, and the search goes on. The result is
the best permutation seen, so never worse than the start.
"""

from __future__ import annotations

import time

import torch

from apex.contrib.sparsity import _ops
from apex.contrib.sparsity.permutation_search_kernels.exhaustive_search import IMPROVEMENT_THRESHOLD
from apex.contrib.sparsity.permutation_search_kernels.permutation_utilities import (
    BestSeen,
    as_magnitude_tensor,
    generator,
    stripe_groups,
)


def _search(base: torch.Tensor, escape_attempts: int, rng: torch.Generator, verbosity: int) -> torch.Tensor:
    device = base.device
    cols = base.shape[1]
    num_stripes = cols // 4
    permutation = torch.arange(cols, device=device)
    if num_stripes < 2:
        return permutation
    pairs = stripe_groups(num_stripes, 2).to(device)
    pairs_cpu = pairs.cpu()
    gains = _ops.build_swap_map(base, pairs)
    best_seen = BestSeen(base, permutation)
    escapes = swaps = 0
    while True:
        best_gain, best_swap = gains.max(dim=1)
        order = torch.argsort(best_gain, descending=True, stable=True).tolist()
        values = best_gain.tolist()
        used = torch.zeros(num_stripes, dtype=torch.bool)
        applied = False
        for index in order:
            if values[index] <= IMPROVEMENT_THRESHOLD:
                break
            s0, s1 = pairs_cpu[index].tolist()
            if used[s0] or used[s1]:
                continue
            swap = int(best_swap[index])
            c0, c1 = 4 * s0 + swap // 4, 4 * s1 + swap % 4
            permutation[[c0, c1]] = permutation[[c1, c0]]
            used[[s0, s1]] = True
            applied = True
            swaps += 1
        if not applied:
            best_seen.offer(permutation)
            if escapes >= escape_attempts:
                break
            escapes += 1
            c0, c1 = torch.randperm(cols, generator=rng)[:2].tolist()
            if c0 // 4 == c1 // 4:
                continue
            permutation[[c0, c1]] = permutation[[c1, c0]]
            used[[c0 // 4, c1 // 4]] = True
        stale = used.to(device)[pairs].any(dim=1).nonzero().squeeze(1)
        if stale.numel():
            gains[stale] = _ops.build_swap_map(base[:, permutation], pairs[stale])
    best_seen.offer(permutation)
    if verbosity > 0:
        print(f"[Channel_Swap] {swaps} swaps, {escapes} escape attempts")
    return best_seen.permutation


def Channel_Swap(matrix, escape_attempts=0, verbosity=0, permutation=None, seed=1):
    """Search a column permutation of ``matrix`` by greedy channel swaps.

    Args:
        matrix: 2-D tensor (any device) or NumPy array, columns a multiple of 4.
        escape_attempts: random swaps tried after the search stalls.
        verbosity: > 0 prints a summary.
        permutation: the starting permutation (a list; default the identity).
        seed: the seed of the search's own random generator (ours).

    Returns ``(matrix[:, permutation], seconds, permutation)`` (the permutation a list), as upstream.
    """
    start = time.perf_counter()
    magnitude = as_magnitude_tensor(matrix)
    cols = magnitude.shape[1]
    perm = torch.arange(cols, device=magnitude.device)
    if permutation is not None:
        perm = torch.as_tensor(list(permutation), dtype=torch.int64, device=magnitude.device)
        if perm.shape != (cols,) or not torch.equal(perm.sort().values, torch.arange(cols, device=perm.device)):
            raise ValueError(f"Channel_Swap: permutation must be a permutation of range({cols})")
    found = _search(magnitude[:, perm], escape_attempts, generator(seed), verbosity)
    perm = perm[found].tolist()
    return matrix[:, perm], time.perf_counter() - start, perm
