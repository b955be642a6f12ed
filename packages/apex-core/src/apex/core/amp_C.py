"""Upstream Apex's ``amp_C`` functions with their calling convention, on apex-core's ops.

Each takes ``(chunk_size, noop_flag, tensor_lists, *args)`` and is meant to be called through
:func:`apex.multi_tensor_apply.multi_tensor_applier`::

    from apex.core import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier
    multi_tensor_applier(amp_C.multi_tensor_scale, noop_flag, [grads, grads], 1.0 / scale)
"""

from __future__ import annotations

import torch

from apex.core import _ops


def _lists(op: str, tensor_lists, depths: tuple[int, ...]):
    if len(tensor_lists) not in depths:
        expected = " or ".join(str(d) for d in depths)
        raise ValueError(f"{op}: tensor_lists must hold {expected} lists, got {len(tensor_lists)}")
    return [list(lst) for lst in tensor_lists]


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``out = in * scale`` for ``tensor_lists = [inputs, outputs]``; ``scale`` a float or a 1-element fp32 tensor."""
    inputs, outputs = _lists("multi_tensor_scale", tensor_lists, (2,))
    if isinstance(scale, torch.Tensor):
        return _ops.multi_tensor_scale(chunk_size, noop_flag, inputs, outputs, 1.0, scale)
    return _ops.multi_tensor_scale(chunk_size, noop_flag, inputs, outputs, float(scale))


def multi_tensor_axpby(chunk_size, noop_flag, tensor_lists, a, b, arg_to_check):
    """``out = a * x + b * y`` for ``tensor_lists = [x, y, out]``; checks x (0), y (1) or both (-1) for inf/nan."""
    x, y, out = _lists("multi_tensor_axpby", tensor_lists, (3,))
    return _ops.multi_tensor_axpby(chunk_size, noop_flag, x, y, out, float(a), float(b), int(arg_to_check))


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """``(total_norm[1], per_tensor_norms[n or 0])`` in fp32 for ``tensor_lists = [inputs]``."""
    (inputs,) = _lists("multi_tensor_l2norm", tensor_lists, (1,))
    return _ops.multi_tensor_l2norm(chunk_size, noop_flag, inputs, bool(per_tensor))


def multi_tensor_unscale_l2norm(chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor=False):
    """Norm of ``inputs * inv_scale``; with ``tensor_lists = [inputs, outputs]`` also writes the unscaled values."""
    lists = _lists("multi_tensor_unscale_l2norm", tensor_lists, (1, 2))
    outputs = lists[1] if len(lists) == 2 else []
    return _ops.multi_tensor_unscale_l2norm(chunk_size, noop_flag, lists[0], outputs, inv_scale, bool(per_tensor))


def update_scale_hysteresis(
    current_scale,
    growth_tracker,
    hysteresis_tracker,
    found_inf,
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
):
    """Megatron-style dynamic loss-scale update with hysteresis, entirely on the device (in place)."""
    _ops.update_scale_hysteresis(
        current_scale,
        growth_tracker,
        hysteresis_tracker,
        found_inf,
        float(growth_factor),
        float(backoff_factor),
        int(growth_interval),
        int(hysteresis),
    )
    return current_scale
