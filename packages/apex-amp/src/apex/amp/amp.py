"""O1's function casts: ``amp.init`` patches ``torch``, ``torch.nn.functional`` and ``torch.Tensor``.

``amp.init()`` replaces every function on the cast lists (:mod:`apex.amp.lists`) by a wrapper
that casts its floating-point tensor arguments and calls the original:

* reduced-precision list (``linear``, ``conv*``, ``matmul``, ``mm``, ``bmm``, ..., and the RNNs):
  arguments go to fp16 (or the handle's ``dtype``, bf16), so the result is fp16. An fp32
  ``nn.Parameter``'s copy is cached until the iteration ends (``amp.scale_loss`` exits, or an
  optimizer step that ``amp.initialize`` prepared returns), so a weight used several times is cast once.
* fp32 list (``softmax``, ``sum``, ``exp``, ``layer_norm``, the losses, ``Tensor.cpu``, ...):
  floating arguments go to fp32. The in-place forms (``x.exp_()``, ``torch.exp_(x)``) raise on a
  reduced-precision tensor rather than round an fp32 result back into it.
* promote list (``add``, ``mul``, ``cat``, ``stack``, comparisons, the arithmetic operators, ...):
  when floating arguments of different dtypes meet, all are cast to the widest. Other in-place
  methods (``x.add_(y)``) cast their arguments to ``x``'s dtype.
* banned (``F.binary_cross_entropy``): raises with advice on a reduced-precision input, unless
  ``allow_banned=True``, which runs it in fp32.

Like upstream Apex, only tensors on a CUDA device are cast: CPU tensors pass through untouched.
``CAST_DEVICE_TYPES`` (or ``amp.init(device_types=...)``) widens that, e.g. to
``("cuda", "cpu")`` with ``dtype=torch.bfloat16`` to try O1 on the CPU. As upstream, the two
lists cast every floating dtype, float64 included; only the promote list keeps float64 (the widest).

The handle that ``amp.init`` returns (also ``amp._amp_state.handle``) records every patch;
``handle._deactivate()`` puts the original functions back. A later ``amp.init`` first undoes the
previous one (upstream stacked its wrappers instead), keeping the functions the user registered.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable

import torch

from apex.amp import casting
from apex.amp._amp_state import _amp_state
from apex.amp.lists import RNN_CELL_FUNCS, RNN_FUNCS, functional_overrides, tensor_overrides, torch_overrides

# Device types whose floating tensors O1 casts. Upstream casts CUDA tensors only.
CAST_DEVICE_TYPES: tuple[str, ...] = ("cuda",)

REDUCED_DTYPES = (torch.float16, torch.bfloat16)
_SHORT_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}

_OLD_API_MESSAGE = (
    "The handle's scale_loss (amp's old API) is no longer supported: use amp.initialize(model, optimizer, "
    "opt_level='O1') and `with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()`."
)


def _short(dtype: torch.dtype) -> str:
    return _SHORT_NAMES.get(dtype, str(dtype))


def _map_value(fn: Callable[[torch.Tensor], torch.Tensor], value):
    """``fn`` on a tensor, or on the tensors of a plain list/tuple (nested); anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if type(value) in (list, tuple):
        return type(value)(_map_value(fn, item) for item in value)
    return value


def _map_args(fn, args, kwargs):
    return [_map_value(fn, a) for a in args], {k: _map_value(fn, v) for k, v in kwargs.items()}


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif type(value) in (list, tuple):
            yield from _tensors(value)


def _inplace(names):
    return [name + "_" for name in names]


# --- the handles --------------------------------------------------------------------------


class AmpHandle:
    """What ``amp.init`` returns: the casts in force, the cache of cast parameters, the patches.

    Args:
        loss_scale: recorded for compatibility (upstream's old API scaled losses through the
            handle; use ``amp.initialize`` and ``amp.scale_loss``).
        enable_caching: cache the reduced-precision copies of fp32 parameters for the iteration.
        verbose: print every cast, with the function it is for.
        dtype: (keyword) the reduced precision, ``torch.float16`` (upstream's) or ``torch.bfloat16``.
        device_types: (keyword) device types whose tensors are cast; None: ``CAST_DEVICE_TYPES``.
    """

    def __init__(
        self,
        loss_scale="dynamic",
        enable_caching: bool = True,
        verbose: bool = False,
        *,
        dtype: torch.dtype = torch.float16,
        device_types=None,
    ):
        if dtype not in REDUCED_DTYPES:
            raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        self.loss_scale = loss_scale
        self.dtype = dtype
        if device_types is None:
            device_types = CAST_DEVICE_TYPES
        self.device_types = (device_types,) if isinstance(device_types, str) else tuple(device_types)
        self._enable_caching = enable_caching
        self._verbose = verbose
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._is_active = True
        # (owner, name, the owner's own previous value or None, whether the owner had its own)
        self._patches: list = []
        self._user_registrations: dict = {}

    # upstream's handle interface

    def is_active(self) -> bool:
        return self._is_active and not casting.casts_disabled()

    def _disable_casts(self):
        return casting.disable_casts()

    @property
    def has_cache(self) -> bool:
        return self._enable_caching

    @property
    def cache(self) -> dict:
        """The cached casts: ``id(parameter) -> (parameter, its reduced-precision copy)``."""
        return self._cache

    @property
    def verbose(self) -> bool:
        return self._verbose

    def remove_cache(self, param: torch.Tensor) -> None:
        self._cache.pop(id(param), None)

    def _clear_cache(self) -> None:
        self._cache.clear()

    @contextlib.contextmanager
    def scale_loss(self, loss, optimizer):
        raise RuntimeError(_OLD_API_MESSAGE)
        yield  # pragma: no cover

    def wrap_optimizer(self, optimizer, num_loss=1):
        raise RuntimeError(_OLD_API_MESSAGE)

    def _deactivate(self) -> None:
        """Put back every function this handle patched, newest first; the handle then does nothing."""
        for owner, name, previous, owned in reversed(self._patches):
            if isinstance(owner, dict):
                owner[name] = previous
            elif owned:
                setattr(owner, name, previous)
            else:
                delattr(owner, name)
        self._patches = []
        self._is_active = False
        self._cache.clear()

    # casting tensors

    def _castable(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type in self.device_types

    def _convert(self, t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
        if self._verbose:
            print(f"amp: {_short(t.dtype)} -> {_short(dtype)} ({name})")
        return t.to(dtype)

    def _down(self, t, name: str):
        if self._castable(t) and t.dtype != self.dtype:
            return self._convert(t, self.dtype, name)
        return t

    def _up(self, t, name: str):
        if self._castable(t) and t.dtype != torch.float32:
            return self._convert(t, torch.float32, name)
        return t

    def _cached_down(self, t, name: str):
        if not (
            self._enable_caching
            and isinstance(t, torch.nn.Parameter)
            and t.dtype == torch.float32
            and self._castable(t)
        ):
            return self._down(t, name)
        entry = self._cache.get(id(t))
        if entry is not None and entry[0] is t:
            cached = entry[1]
            # A copy made without grad (eval) must not stand in for one that needs the parameter's
            # graph; under no_grad any copy will do.
            if not (torch.is_grad_enabled() and t.requires_grad != cached.requires_grad):
                return cached
        cast = self._down(t, name)
        self._cache[id(t)] = (t, cast)
        return cast

    def _is_reduced(self, t) -> bool:
        return self._castable(t) and t.dtype in REDUCED_DTYPES

    # wrappers

    def _wrapper(self, orig: Callable, name: str, kind: str) -> Callable:
        """A wrapper of ``orig`` of one kind: "half", "float", "promote" or "sequence"."""
        if kind == "promote":
            return self._promote_wrapper(orig, name)
        if kind == "sequence":
            return self._sequence_wrapper(orig, name)
        handle = self
        cast = {"half": self._cached_down, "float": self._up}[kind]

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if not handle.is_active():
                return orig(*args, **kwargs)
            args, kwargs = _map_args(lambda t: cast(t, name), args, kwargs)
            return orig(*args, **kwargs)

        return wrapper

    def _promote_to(self, tensors, name: str):
        """The widest floating dtype of ``tensors`` when they have more than one, else None."""
        dtypes = {t.dtype for t in tensors if t.is_floating_point()}
        if len(dtypes) < 2:
            return None
        return functools.reduce(torch.promote_types, dtypes)

    def _caster_to(self, dtype: torch.dtype, name: str):
        def cast(t):
            return self._convert(t, dtype, name) if self._castable(t) and t.dtype != dtype else t

        return cast

    def _promote_wrapper(self, orig: Callable, name: str) -> Callable:
        handle = self

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if not handle.is_active():
                return orig(*args, **kwargs)
            widest = handle._promote_to(_tensors(itertools.chain(args, kwargs.values())), name)
            if widest is None:
                return orig(*args, **kwargs)
            args, kwargs = _map_args(handle._caster_to(widest, name), args, kwargs)
            return orig(*args, **kwargs)

        return wrapper

    def _sequence_wrapper(self, orig: Callable, name: str) -> Callable:
        handle = self

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if not handle.is_active():
                return orig(*args, **kwargs)
            in_kwargs = not args and "tensors" in kwargs
            seq = kwargs["tensors"] if in_kwargs else (args[0] if args else None)
            if type(seq) not in (list, tuple):
                return orig(*args, **kwargs)
            widest = handle._promote_to(_tensors(seq), name)
            if widest is None:
                return orig(*args, **kwargs)
            seq = _map_value(handle._caster_to(widest, name), seq)
            if in_kwargs:
                return orig(**{**kwargs, "tensors": seq})
            return orig(seq, *args[1:], **kwargs)

        return wrapper

    def _match_self_wrapper(self, orig: Callable, name: str) -> Callable:
        """In-place methods off the fp32 list: the other arguments take ``self``'s dtype."""
        handle = self

        @functools.wraps(orig)
        def wrapper(self_, *args, **kwargs):
            if not handle.is_active() or not isinstance(self_, torch.Tensor):
                return orig(self_, *args, **kwargs)
            if self_.dtype not in (torch.float32, *REDUCED_DTYPES):
                return orig(self_, *args, **kwargs)
            args, kwargs = _map_args(handle._caster_to(self_.dtype, name), args, kwargs)
            return orig(self_, *args, **kwargs)

        return wrapper

    def _refuse_reduced_wrapper(self, orig: Callable, name: str, message: str | None = None) -> Callable:
        """In-place fp32-list functions (and banned ones): refuse any reduced-precision argument."""
        handle = self

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if handle.is_active():
                for t in _tensors(itertools.chain(args, kwargs.values())):
                    if handle._is_reduced(t):
                        raise NotImplementedError(
                            message or f"Cannot call in-place function {name} with {_short(t.dtype)} arguments."
                        )
            return orig(*args, **kwargs)

        return wrapper

    def _refuse_reduced_self_wrapper(self, orig: Callable, name: str) -> Callable:
        """In-place fp32-list methods: refuse a reduced-precision ``self``; cast the rest to fp32."""
        handle = self

        @functools.wraps(orig)
        def wrapper(self_, *args, **kwargs):
            if not handle.is_active():
                return orig(self_, *args, **kwargs)
            if handle._is_reduced(self_):
                raise NotImplementedError(f"Cannot call in-place method {name} on {_short(self_.dtype)} Tensors.")
            args, kwargs = _map_args(lambda t: handle._up(t, name), args, kwargs)
            return orig(self_, *args, **kwargs)

        return wrapper

    # recurrent networks

    def _rnn_weights(self, weights, name: str) -> list:
        weights = list(weights)
        uniform = weights and all(
            self._castable(w) and w.dtype == torch.float32 and w.device == weights[0].device for w in weights
        )
        if not uniform:
            return [self._down(w, name) for w in weights]
        # One cast into one buffer: the reduced-precision weights lie in a single chunk, as cuDNN
        # wants them, and their gradients flow back into the fp32 parameters through the cast.
        flat = torch.cat([w.reshape(-1) for w in weights])
        flat = self._convert(flat, self.dtype, name)
        return [piece.view(w.shape) for piece, w in zip(flat.split([w.numel() for w in weights]), weights)]

    def _rnn_wrapper(self, orig: Callable, name: str) -> Callable:
        """``torch._VF.lstm``/``gru``/``rnn_*``: input, hidden state and weights in reduced precision.

        Called as ``(input, hx, weights, ...)``, or with a PackedSequence's data as
        ``(data, batch_sizes, hx, weights, ...)``.
        """
        handle = self

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if not handle.is_active() or kwargs or len(args) < 4 or not handle._castable(args[0]):
                return orig(*args, **kwargs)
            packed = isinstance(args[1], torch.Tensor) and not args[1].is_floating_point()
            hx_at, weights_at = (2, 3) if packed else (1, 2)
            args = list(args)
            args[0] = handle._down(args[0], name)
            args[hx_at] = _map_value(lambda t: handle._down(t, name), args[hx_at])
            args[weights_at] = handle._rnn_weights(args[weights_at], name)
            return orig(*args)

        return wrapper

    def _rnn_check_input_wrapper(self, orig: Callable, name: str) -> Callable:
        """``RNNBase.check_input`` refuses an input whose dtype is not the weights'; under O1 the
        ``_VF`` wrapper casts both, so the check sees a shape-only stand-in of the weights' dtype."""
        handle = self

        @functools.wraps(orig)
        def check_input(module, input, batch_sizes):
            weights = getattr(module, "_flat_weights", None)
            if handle.is_active() and handle._castable(input) and weights and weights[0] is not None:
                if input.dtype != weights[0].dtype:
                    input = torch.empty(input.shape, dtype=weights[0].dtype, device="meta")
            return orig(module, input, batch_sizes)

        return check_input

    # patching

    def _patch(self, owner, name: str, make_wrapper: Callable[[Callable], Callable]) -> bool:
        if isinstance(owner, dict):
            if name not in owner:
                return False
            current, previous, owned = owner[name], owner[name], True
            owner[name] = make_wrapper(current)
        else:
            if not hasattr(owner, name):
                return False
            current = getattr(owner, name)
            owned = name in vars(owner)
            previous = vars(owner)[name] if owned else None
            setattr(owner, name, make_wrapper(current))
        self._patches.append((owner, name, previous, owned))
        return True

    def _install(self, registrations: dict, allow_banned: bool) -> None:
        """Patch everything, in upstream's order (later patches wrap earlier ones)."""
        for module, name, kind in registrations.values():
            self._patch(module, name, functools.partial(self._wrapper, name=name, kind=kind))
        self._user_registrations = dict(registrations)

        namespaces = (functional_overrides, torch_overrides, tensor_overrides)
        for lists, (list_name, kind) in itertools.product(
            namespaces, (("FP16_FUNCS", "half"), ("FP32_FUNCS", "float"))
        ):
            for name in getattr(lists, list_name):
                self._patch(lists.MODULE, name, functools.partial(self._wrapper, name=name, kind=kind))
        for lists, (list_name, kind) in itertools.product(
            namespaces, (("CASTS", "promote"), ("SEQUENCE_CASTS", "sequence"))
        ):
            for name in getattr(lists, list_name):
                self._patch(lists.MODULE, name, functools.partial(self._wrapper, name=name, kind=kind))

        for name in _inplace(torch_overrides.FP32_FUNCS):
            self._patch(torch, name, functools.partial(self._refuse_reduced_wrapper, name=name))
        for name in _inplace(tensor_overrides.FP32_FUNCS):
            self._patch(torch.Tensor, name, functools.partial(self._refuse_reduced_self_wrapper, name=name))
        for name in _inplace(tensor_overrides.FP16_FUNCS + tensor_overrides.CASTS):
            self._patch(torch.Tensor, name, functools.partial(self._match_self_wrapper, name=name))

        self._install_rnns()

        for name, advice in functional_overrides.BANNED_FUNCS:
            if allow_banned:
                self._patch(
                    functional_overrides.MODULE, name, functools.partial(self._wrapper, name=name, kind="float")
                )
            else:
                self._patch(
                    functional_overrides.MODULE,
                    name,
                    functools.partial(self._refuse_reduced_wrapper, name=name, message=advice),
                )

    def _install_rnns(self) -> None:
        # torch.nn's RNN modules call the kernels through the name `_VF` of torch.nn.modules.rnn:
        # that one name is replaced by a namespace whose recurrent kernels cast (other code that
        # imported torch._VF is unaffected).
        rnn = torch.nn.modules.rnn
        real = rnn._VF
        shim = _VFShim(real)
        for name in RNN_FUNCS:
            if hasattr(real, name):
                setattr(shim, name, self._rnn_wrapper(getattr(real, name), name))
        for name in RNN_CELL_FUNCS:
            if hasattr(real, name):
                setattr(shim, name, self._wrapper(getattr(real, name), name, "half"))
        self._patch(rnn, "_VF", lambda previous: shim)
        impls = getattr(rnn, "_rnn_impls", None)
        if isinstance(impls, dict):
            for key in list(impls):
                if hasattr(shim, key.lower()):
                    self._patch(impls, key, lambda previous, key=key: getattr(shim, key.lower()))
        self._patch(torch.nn.RNNBase, "check_input", functools.partial(self._rnn_check_input_wrapper, name="rnn"))


class _VFShim:
    """``torch._VF`` with some functions replaced; everything else is looked up on the real one."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)


class NoOpHandle:
    """What ``amp.init(enabled=False)`` returns: casts nothing, caches nothing."""

    def is_active(self) -> bool:
        return False

    @contextlib.contextmanager
    def _disable_casts(self):
        yield

    @property
    def has_cache(self) -> bool:
        return False

    @property
    def verbose(self) -> bool:
        return False

    @contextlib.contextmanager
    def scale_loss(self, loss, optimizer):
        yield loss

    def remove_cache(self, param) -> None:
        pass

    def _clear_cache(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass


# --- the user's functions ---------------------------------------------------------------------

# (id(module), name) -> (module, name, kind): modules need not be hashable.
_USER_CAST_REGISTRY: dict = {}
_USER_PROMOTE_REGISTRY: dict = {}


def _decorate(fn: Callable, kind: str) -> Callable:
    original = getattr(fn, "_amp_original", fn)
    name = getattr(original, "__name__", repr(original))

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        handle = getattr(_amp_state, "handle", None)
        if handle is None or not handle.is_active():
            return original(*args, **kwargs)
        return handle._wrapper(original, name, kind)(*args, **kwargs)

    wrapper._amp_cast_kind = kind
    wrapper._amp_original = original
    return wrapper


def half_function(fn: Callable) -> Callable:
    """Decorator: while ``amp.init``'s casts are on, ``fn`` gets its floating inputs in reduced precision."""
    return _decorate(fn, "half")


def float_function(fn: Callable) -> Callable:
    """Decorator: while ``amp.init``'s casts are on, ``fn`` gets its floating inputs in fp32."""
    return _decorate(fn, "float")


def promote_function(fn: Callable) -> Callable:
    """Decorator: while ``amp.init``'s casts are on, ``fn``'s floating inputs are cast to the widest of their dtypes."""
    return _decorate(fn, "promote")


def _register(registry: dict, module, name: str, kind: str) -> None:
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")
    registry[(id(module), name)] = (module, name, kind)


def register_half_function(module, name: str) -> None:
    """Have the next ``amp.init`` (or ``amp.initialize`` at O1) run ``module.name`` in reduced precision."""
    _register(_USER_CAST_REGISTRY, module, name, "half")


def register_float_function(module, name: str) -> None:
    """Have the next ``amp.init`` (or ``amp.initialize`` at O1) run ``module.name`` in fp32."""
    _register(_USER_CAST_REGISTRY, module, name, "float")


def register_promote_function(module, name: str) -> None:
    """Have the next ``amp.init`` (or ``amp.initialize`` at O1) cast ``module.name``'s inputs to their widest dtype."""
    _register(_USER_PROMOTE_REGISTRY, module, name, "promote")


# --- init ----------------------------------------------------------------------------------------


def init(
    enabled: bool = True,
    loss_scale="dynamic",
    enable_caching: bool = True,
    verbose: bool = False,
    allow_banned: bool = False,
    *,
    dtype: torch.dtype = torch.float16,
    device_types=None,
):
    """Turn on O1's casts for the whole process: patch torch's functions by upstream Apex's lists.

    From here on, everywhere (not only inside a model's forward), functions on the
    reduced-precision list run in fp16, those on the fp32 list in fp32, and the promote list takes
    the widest input dtype; see :mod:`apex.amp.amp`. ``amp.initialize(opt_level="O1")`` calls it.

    Args:
        enabled: False patches nothing and returns a :class:`NoOpHandle`.
        loss_scale: kept on the handle for compatibility; loss scaling is ``amp.initialize``'s.
        enable_caching: cache fp32 parameters' reduced-precision copies until the iteration ends.
        verbose: print each cast.
        allow_banned: run banned functions (``F.binary_cross_entropy``) in fp32 instead of raising.
        dtype: (keyword) the reduced precision: ``torch.float16`` (upstream's) or ``torch.bfloat16``.
        device_types: (keyword) device types whose tensors are cast (default ``CAST_DEVICE_TYPES``,
            CUDA only, as upstream).

    Functions registered with ``register_*_function`` are patched first. Calling ``init`` again
    undoes the previous call's patches first, then patches anew (with its registrations kept).

    Returns:
        the handle, also kept as ``amp._amp_state.handle``; ``handle._deactivate()`` undoes the
        patches and ``amp.disable_casts()`` suspends them for a block.
    """
    previous = getattr(_amp_state, "handle", None)
    if previous is not None:
        for key, registration in getattr(previous, "_user_registrations", {}).items():
            registry = _USER_PROMOTE_REGISTRY if registration[2] == "promote" else _USER_CAST_REGISTRY
            registry.setdefault(key, registration)
        previous._deactivate()
    if not enabled:
        handle = NoOpHandle()
        _amp_state.handle = handle
        return handle

    handle = AmpHandle(loss_scale, enable_caching, verbose, dtype=dtype, device_types=device_types)
    handle._install({**_USER_CAST_REGISTRY, **_USER_PROMOTE_REGISTRY}, allow_banned)
    _USER_CAST_REGISTRY.clear()
    _USER_PROMOTE_REGISTRY.clear()
    _amp_state.handle = handle
    return handle
