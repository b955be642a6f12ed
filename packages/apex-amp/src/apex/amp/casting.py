"""Casts: the model's inputs and outputs (O0/O2/O3), autocast around the forward (O1), and the
user's function registry (``half_function``, ``register_float_function``, ...).

O1 does not monkey-patch torch: each model's forward runs under ``torch.autocast`` with O1's
dtype, which casts around PyTorch's operators by its own op lists. Functions that the user
registers or decorates are the only ones wrapped; a wrapper acts only while autocast is on for
its arguments' device (so only inside a forward at O1) and then runs the function with autocast
off, on arguments cast to half, to float32, or to their widest floating type.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Mapping

import torch

from apex.amp._amp_state import maybe_print

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


def _first_tensor(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    if isinstance(value, Mapping):
        return _first_tensor(list(value.values()))
    return None


# --- disable_casts -----------------------------------------------------------------------

_local = threading.local()
AUTOCAST_DEVICE_TYPES = ("cuda", "cpu")


def casts_disabled() -> bool:
    return getattr(_local, "disabled", 0) > 0


@contextlib.contextmanager
def disable_casts():
    """Run the block without O1's casts: autocast is turned off, and forwards entered inside do not turn it on."""
    _local.disabled = getattr(_local, "disabled", 0) + 1
    try:
        with contextlib.ExitStack() as stack:
            for device_type in AUTOCAST_DEVICE_TYPES:
                if torch.is_autocast_enabled(device_type):
                    stack.enter_context(torch.autocast(device_type, enabled=False))
            yield
    finally:
        _local.disabled -= 1


# --- the model's casts -------------------------------------------------------------------


class ModelCasts:
    """Forward hooks of one model: inputs cast on the way in (or autocast entered), outputs on the way out.

    Args:
        input_dtype: floating-point inputs are cast to it (O0/O2/O3), or None.
        output_dtype: floating-point outputs are cast to it, or None.
        autocast_dtype: the forward runs under ``torch.autocast`` with this dtype (O1), or None.
        device_type: autocast's device type; None takes, at each call, the first parameter's (or input's).
    """

    def __init__(
        self,
        input_dtype: torch.dtype | None,
        output_dtype: torch.dtype | None,
        autocast_dtype: torch.dtype | None = None,
        device_type: str | None = None,
    ):
        self.input_dtype = input_dtype
        self.output_dtype = output_dtype
        self.autocast_dtype = autocast_dtype
        self.device_type = device_type
        self._local = threading.local()
        self._handles: list = []

    def attach(self, model: torch.nn.Module) -> None:
        previous = getattr(model, "_amp_casts", None)
        if previous is not None:
            previous.detach()
        self._handles = [
            model.register_forward_pre_hook(self.before_forward, with_kwargs=True),
            model.register_forward_hook(self.after_forward, with_kwargs=True, always_call=True),
        ]
        model._amp_casts = self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _stack(self) -> list:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def before_forward(self, module, args, kwargs):
        if self.autocast_dtype is not None:
            device_type = self.device_type
            if device_type is None:
                first = next(module.parameters(), None)
                if first is None:
                    first = _first_tensor((args, kwargs))
                device_type = first.device.type if first is not None else "cpu"
            context = torch.autocast(device_type, dtype=self.autocast_dtype, enabled=not casts_disabled())
            context.__enter__()
            self._stack().append(context)
        if self.input_dtype is not None:
            cast = functools.partial(to_type, self.input_dtype)
            return applier(args, cast), applier(kwargs, cast)
        return None

    def __getstate__(self):
        # deepcopy/pickle of a model carries its casts, not the thread-local stack or hook handles.
        state = dict(self.__dict__)
        state["_local"] = None
        state["_handles"] = []
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local = threading.local()

    def after_forward(self, module, args, kwargs, output):
        if self.autocast_dtype is not None:
            stack = self._stack()
            if stack:
                stack.pop().__exit__(None, None, None)
        if self.output_dtype is not None:
            return applier(output, functools.partial(to_type, self.output_dtype))
        return None


# --- the user's function registry ----------------------------------------------------------

# name -> (module, name, kind), keyed by (id(module), name); modules need not be hashable.
_USER_CAST_REGISTRY: dict = {}
_USER_PROMOTE_REGISTRY: dict = {}


def _floating_dtypes(args, kwargs) -> list[torch.dtype]:
    found = []
    applier((args, kwargs), lambda t: found.append(t.dtype) or t)
    return [d for d in found if d.is_floating_point]


def _cast_call(fn: Callable, kind: str, args, kwargs):
    first = _first_tensor((args, kwargs))
    if first is None or not torch.is_autocast_enabled(first.device.type):
        return fn(*args, **kwargs)
    device_type = first.device.type
    if kind == "half":
        dtype = torch.get_autocast_dtype(device_type)
    elif kind == "float":
        dtype = torch.float32
    else:  # promote: to the widest floating type among the arguments
        dtypes = _floating_dtypes(args, kwargs)
        if not dtypes:
            return fn(*args, **kwargs)
        dtype = functools.reduce(torch.promote_types, dtypes)
    cast = functools.partial(to_type, dtype)
    with torch.autocast(device_type, enabled=False):
        return fn(*applier(args, cast), **applier(kwargs, cast))


def _wrap(fn: Callable, kind: str) -> Callable:
    if getattr(fn, "_amp_cast_kind", None) is not None:
        fn = fn._amp_original

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return _cast_call(fn, kind, args, kwargs)

    wrapper._amp_cast_kind = kind
    wrapper._amp_original = fn
    return wrapper


def half_function(fn: Callable) -> Callable:
    """Decorator: under O1's casts, ``fn`` runs on half-precision inputs (O1's dtype), with autocast off inside."""
    return _wrap(fn, "half")


def float_function(fn: Callable) -> Callable:
    """Decorator: under O1's casts, ``fn`` runs on float32 inputs, with autocast off inside."""
    return _wrap(fn, "float")


def promote_function(fn: Callable) -> Callable:
    """Decorator: under O1's casts, ``fn`` runs on inputs cast to their widest floating type, with autocast off."""
    return _wrap(fn, "promote")


def _check_registrable(module, name: str) -> None:
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")


def register_half_function(module, name: str) -> None:
    """Have ``amp.initialize`` at O1 wrap ``module.name`` as :func:`half_function` (call before initialize)."""
    _check_registrable(module, name)
    _USER_CAST_REGISTRY[(id(module), name)] = (module, name, "half")


def register_float_function(module, name: str) -> None:
    """Have ``amp.initialize`` at O1 wrap ``module.name`` as :func:`float_function` (call before initialize)."""
    _check_registrable(module, name)
    _USER_CAST_REGISTRY[(id(module), name)] = (module, name, "float")


def register_promote_function(module, name: str) -> None:
    """Have ``amp.initialize`` at O1 wrap ``module.name`` as :func:`promote_function` (call before initialize)."""
    _check_registrable(module, name)
    _USER_PROMOTE_REGISTRY[(id(module), name)] = (module, name, "promote")


def apply_registered_functions() -> None:
    """Wrap every registered function in place, then empty the registries (as upstream does at init)."""
    for module, name, kind in [*_USER_CAST_REGISTRY.values(), *_USER_PROMOTE_REGISTRY.values()]:
        setattr(module, name, _wrap(getattr(module, name), kind))
        maybe_print(f"amp: {getattr(module, '__name__', module)}.{name} registered as a {kind} function", level=2)
    _USER_CAST_REGISTRY.clear()
    _USER_PROMOTE_REGISTRY.clear()
