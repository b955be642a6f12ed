"""Casts around a model (its inputs and outputs at O0/O2/O3, or only outputs when asked) and the
switch that suspends O1's function casts (:func:`disable_casts`).

O1's function casts themselves (``amp.init``, the cast lists, the decorators and registries)
live in :mod:`apex.amp.amp`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Mapping

import torch

# --- walking nested inputs and outputs ---------------------------------------------------


def applier(value, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``value`` with ``fn`` applied to every tensor inside tuples, lists, dicts and namedtuples."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(applier(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(applier(v, fn) for v in value)
    if isinstance(value, Mapping):
        items = {k: applier(v, fn) for k, v in value.items()}
        try:
            return type(value)(items)
        except TypeError:
            return items
    return value


def to_type(dtype: torch.dtype, t: torch.Tensor) -> torch.Tensor:
    """``t`` in ``dtype`` if it is floating point; other tensors unchanged."""
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


# --- disable_casts -----------------------------------------------------------------------

_local = threading.local()


def casts_disabled() -> bool:
    """Whether this thread is inside :func:`disable_casts`."""
    return getattr(_local, "disabled", 0) > 0


@contextlib.contextmanager
def disable_casts():
    """Run the block without O1's casts: every patched function calls straight through.

    Nests, and holds for this thread only. ``amp.initialize`` at O1 runs each optimizer's
    ``step`` inside it, as upstream does.
    """
    _local.disabled = getattr(_local, "disabled", 0) + 1
    try:
        yield
    finally:
        _local.disabled -= 1


# --- the model's casts -------------------------------------------------------------------


class ModelCasts:
    """Forward hooks of one model: floating inputs cast on the way in, floating outputs on the way out.

    Args:
        input_dtype: floating-point inputs are cast to it (O0/O2/O3), or None.
        output_dtype: floating-point outputs are cast to it, or None.
    """

    def __init__(self, input_dtype: torch.dtype | None, output_dtype: torch.dtype | None):
        self.input_dtype = input_dtype
        self.output_dtype = output_dtype
        self._handles: list = []

    def attach(self, model: torch.nn.Module) -> None:
        detach_from(model)
        self._handles = [
            model.register_forward_pre_hook(self.before_forward, with_kwargs=True),
            model.register_forward_hook(self.after_forward, with_kwargs=True, always_call=True),
        ]
        model._amp_casts = self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def before_forward(self, module, args, kwargs):
        if self.input_dtype is not None:
            cast = functools.partial(to_type, self.input_dtype)
            return applier(args, cast), applier(kwargs, cast)
        return None

    def after_forward(self, module, args, kwargs, output):
        if self.output_dtype is not None:
            return applier(output, functools.partial(to_type, self.output_dtype))
        return None

    def __getstate__(self):
        # deepcopy/pickle of a model carries its casts, not the hook handles.
        state = dict(self.__dict__)
        state["_handles"] = []
        return state


def detach_from(model: torch.nn.Module) -> None:
    """Remove the casts an earlier ``amp.initialize`` attached to ``model``, if any."""
    previous = getattr(model, "_amp_casts", None)
    if previous is not None:
        previous.detach()
        del model._amp_casts
