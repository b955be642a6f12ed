"""``accelerated_search_for_good_permutation``: pick and run a permutation search strategy."""

from __future__ import annotations

import time
import warnings

import torch

from apex.contrib.sparsity import _ops
from apex.contrib.sparsity.permutation_search_kernels.channel_swap import Channel_Swap
from apex.contrib.sparsity.permutation_search_kernels.exhaustive_search import Exhaustive_Search
from apex.contrib.sparsity.permutation_search_kernels.permutation_utilities import as_magnitude_tensor, generator

STRATEGIES = ("exhaustive", "channel_swap", "progressive channel swap", "user defined")


def _progressive_channel_swap(magnitude, time_limit, threshold, rng):
    """Random swaps of columns of different stripes, each kept when it gains more than
    ``threshold``, until ``time_limit`` seconds have passed."""
    cols = magnitude.shape[1]
    permutation = torch.arange(cols, device=magnitude.device)
    start = time.perf_counter()
    while time.perf_counter() - start < time_limit and cols >= 8:
        c0, c1 = torch.randint(cols, (2,), generator=rng).tolist()
        if c0 // 4 == c1 // 4:
            continue
        pair = torch.tensor([[c0 // 4, c1 // 4]], device=magnitude.device)
        gain = float(_ops.build_swap_map(magnitude[:, permutation], pair)[0, (c0 % 4) * 4 + c1 % 4])
        if gain > threshold:
            permutation[[c0, c1]] = permutation[[c1, c0]]
    return permutation.tolist()


def accelerated_search_for_good_permutation(matrix_group, options=None, verbosity=0, seed=1):
    """A permutation of the columns (input channels) of ``matrix_group`` keeping more magnitude
    after 2:4 pruning, as a list: ``matrix_group[:, permutation]`` is the permuted matrix.

    Args:
        matrix_group: 2-D tensor (any device; the search runs there) or NumPy array, columns a
            multiple of 4 (the weights of a sibling group side by side, in create_mask's layout).
        options: a dict; ``"strategy"``: ``"exhaustive"`` (default; with ``"stripe_group_size"``,
            default 8, and ``"escape_attempts"``, default 100), ``"channel_swap"`` (with
            ``"escape_attempts"``, default 100), ``"progressive channel swap"`` (with
            ``"progressive_search_time_limit"`` seconds, default 60, and
            ``"improvement_threshold"``, default 1e-9) or ``"user defined"`` (the identity, with
            a warning, as upstream leaves the matrix to the user's own search). Another strategy
            raises ValueError. The dict gets the defaults filled in, as upstream's.
        verbosity: > 0 prints the strategy and the time taken.
        seed: the seed of the search's own random generator (ours).
    """
    if options is None:
        options = {}
    options.setdefault("strategy", "exhaustive")
    strategy = options["strategy"]
    if strategy not in STRATEGIES:
        raise ValueError(
            f"accelerated_search_for_good_permutation: unknown strategy {strategy!r}; expected one of "
            + ", ".join(repr(s) for s in STRATEGIES)
        )
    start = time.perf_counter()
    if strategy == "exhaustive":
        options.setdefault("stripe_group_size", 8)
        options.setdefault("escape_attempts", 100)
        _, _, permutation = Exhaustive_Search(
            matrix_group,
            stripe_group_size=options["stripe_group_size"],
            escape_attempts=options["escape_attempts"],
            seed=seed,
        )
    elif strategy == "channel_swap":
        options.setdefault("escape_attempts", 100)
        _, _, permutation = Channel_Swap(
            matrix_group, escape_attempts=options["escape_attempts"], verbosity=verbosity, seed=seed
        )
    elif strategy == "progressive channel swap":
        options.setdefault("progressive_search_time_limit", 60)
        options.setdefault("improvement_threshold", 1e-9)
        permutation = _progressive_channel_swap(
            as_magnitude_tensor(matrix_group),
            options["progressive_search_time_limit"],
            options["improvement_threshold"],
            generator(seed),
        )
    else:
        warnings.warn(
            "accelerated_search_for_good_permutation: strategy 'user defined' returns the identity "
            "permutation; run your own search on the matrix",
            stacklevel=2,
        )
        permutation = list(range(matrix_group.shape[1]))
    if verbosity > 0:
        print(
            f"[accelerated_search_for_good_permutation] strategy {strategy!r}, matrix "
            f"{tuple(matrix_group.shape)}, {time.perf_counter() - start:.4f} s"
        )
    return permutation
