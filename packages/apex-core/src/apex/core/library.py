"""The one way to define a package's dispatcher op: schema, check, reference, and a fake if needed.

::

    @op(KERNELS, "scale_(Tensor(a!) x, float factor) -> ()", check=_check_scale)
    def scale_(a):
        a.x.mul_(a.factor)

defines ``torch.ops.<KERNELS.name>.scale_`` and binds the module name ``scale_`` to it. The
check, the reference and the fake each take one argument, ``a``: the op's arguments by the
names of the schema (defaults filled in), plus ``a.op``, the op's name for error messages.

- ``check(a)`` reads only metadata (it runs on fake tensors under ``torch.compile``) and raises
  an error naming the bad argument. It runs once per call, before the reference or the fake, and
  may store what it derived on ``a`` (an output dtype, a device) for them.
- The decorated function is the PyTorch reference: the ``CompositeExplicitAutograd`` kernel,
  so the CPU path, and the CUDA path until (or unless) the package's compiled library registers
  a ``CUDA`` kernel, which the dispatcher then prefers. The first CUDA call that reaches the
  reference asks the loader for the compiled library and, when it loads, re-dispatches. A
  library without ``sources`` (the op namespace of a pure-Python package) has nothing to load:
  its references run on every device.
- ``fake(a)`` returns empty outputs of the right metadata. An op that returns nothing (a pure
  in-place op, ``-> ()``) needs none: its fake is the check.

Autograd: :func:`autograd` turns a forward op and its backward into a differentiable callable
(a plain ``torch.autograd.Function``; the op itself then carries no autograd formula). Where host
time per call matters enough to write the autograd in C++ as well, register the Python formula on
the op with ``torch.library.register_autograd`` instead and the C++ one for ``AutogradCUDA`` in
the compiled library: the dispatcher then picks, and the Python API calls the op
(apex-normalization does this; a Python Function layer costs it 20-50 us per eager call).
"""

from __future__ import annotations

import inspect
import sys
import threading
import warnings
from collections.abc import Callable

import torch

from apex.core import loader
from apex.core.descriptors import KernelLibrary

_libraries: dict[str, torch.library.Library] = {}
_redispatching = threading.local()
_missing_kernels: set[str] = set()
_ARGS_SIGNATURE = inspect.Signature([inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)])


class Args:
    """An op call's arguments by schema name (``a.params``, ``a.lr``), and ``a.op``, its name."""

    def __init__(self, values: dict):
        if torch.compiler.is_compiling():
            # Dynamo before torch 2.12 cannot trace __dict__.update on a user object; setattr it can
            for key, value in values.items():
                setattr(self, key, value)
        else:
            self.__dict__.update(values)

    def __repr__(self) -> str:
        return f"Args({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items() if k != 'op')})"


def _library(lib: KernelLibrary) -> torch.library.Library:
    if lib.name not in _libraries:
        _libraries[lib.name] = torch.library.Library(lib.name, "DEF")
    return _libraries[lib.name]


def _first_tensor(args) -> torch.Tensor | None:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg
        if isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, torch.Tensor):
                    return item
    return None


def _binder(overload, name: str) -> Callable[[tuple, dict], Args]:
    """A function turning a dispatcher call's (args, kwargs) into :class:`Args` of ``overload``."""
    arguments = overload._schema.arguments
    names = [arg.name for arg in arguments]
    if "op" in names:
        raise ValueError(f"{name}: an argument may not be called 'op' (Args.op is the op's name)")
    defaults = {arg.name: arg.default_value for arg in arguments if arg.has_default_value()}

    def bind(args: tuple, kwargs: dict) -> Args:
        values = {"op": name, **defaults, **dict(zip(names, args)), **kwargs}
        return Args(values)

    return bind


def op(
    lib: KernelLibrary,
    schema: str,
    *,
    check: Callable | None = None,
    fake: Callable | None = None,
    tags: tuple = (),
):
    """Decorator: define ``schema`` in ``lib``'s namespace with the decorated reference; return the op.

    See the module docstring for what ``check``, the reference and ``fake`` receive. A fake is
    required unless the op returns nothing. ``tags`` are the op's ``torch.Tag`` values (for
    Inductor's layout of its inputs: :data:`CONTIGUOUS_INPUTS`).
    """
    name = schema.split("(", 1)[0].strip()
    returns_nothing = schema.rsplit("->", 1)[1].strip() == "()"
    if fake is None and not returns_nothing:
        raise TypeError(f"{name}: an op that returns tensors needs a fake")
    qualname = f"{lib.name}::{name}"

    def decorate(reference: Callable):
        library = _library(lib)
        library.define(schema, tags=tags)
        # Under torch.compile a graph's fake tensors may carry strides that Inductor changes to
        # contiguous ones for such an op before it runs (a saved activation laid out by the forward
        # graph): the check and fake see the inputs as the kernel will.
        contiguous_inputs = any(t in tags for t in CONTIGUOUS_INPUTS)
        overload = getattr(getattr(torch.ops, lib.name), name).default
        bind = _binder(overload, name)

        def run_direct(*args, **kwargs):
            a = bind(args, kwargs)
            if check is not None:
                check(a)
            return reference(a)

        def run_reference(*args, **kwargs):
            first = _first_tensor(args)
            if lib.sources and first is not None and first.is_cuda and qualname not in _missing_kernels:
                if not getattr(_redispatching, "active", False):
                    if loader.kernels_for_cuda(lib):
                        _redispatching.active = True
                        try:
                            return overload(*args, **kwargs)
                        finally:
                            _redispatching.active = False
                else:  # re-dispatched here: the library loaded but has no CUDA kernel for this op
                    _missing_kernels.add(qualname)
                    warnings.warn(
                        f"apex: {lib.name} is loaded but registers no CUDA kernel for {qualname}; "
                        "using the PyTorch reference",
                        loader.ReferenceFallbackWarning,
                        stacklevel=2,
                    )
            return run_direct(*args, **kwargs)

        def run_fake(*args, **kwargs):
            if _inductor_pending and "torch._inductor.lowering" in sys.modules:
                _register_inductor_fallbacks()
            if contiguous_inputs:  # the kernel will get them contiguous (the tag's promise)
                args = tuple(x.contiguous() if isinstance(x, torch.Tensor) else x for x in args)
                kwargs = {k: x.contiguous() if isinstance(x, torch.Tensor) else x for k, x in kwargs.items()}
            a = bind(args, kwargs)
            if check is not None:
                check(a)
            return None if fake is None else fake(a)

        library.impl(name, run_reference, "CompositeExplicitAutograd")
        torch.library.register_fake(qualname, run_fake, lib=library)
        _direct[overload] = run_direct
        _inductor_pending.append(overload)
        if "torch._inductor.lowering" in sys.modules:
            _register_inductor_fallbacks()
        return overload

    return decorate


_direct: dict = {}
_inductor_pending: list = []


def _register_inductor_fallbacks() -> None:
    """Give Inductor each op as a fallback kernel before it lowers one, with the layout constraint
    its implicit fallback would pick.

    Inductor meets an op without a lowering by logging "Creating implicit fallback for:" with its
    arguments, and torch up to 2.11 formats that message eagerly, whether INFO is logged or not:
    the ``str`` of an IR argument prints the whole graph behind it, shared nodes once per path, so
    it grows exponentially with depth. A 12-layer GPT-2 whose blocks pass on two tensors (fused
    residual-add norms) spent over six minutes there on an H200 (torch 2.11) without finishing.
    Registering the fallback first skips that branch and does exactly what it would have done.
    Called from the fakes (Inductor traces with them after importing its lowering module) and at
    op definition when that module is already imported; private Inductor API, so on a torch where
    it moved this does nothing and Inductor's own path applies.
    """
    pending = list(_inductor_pending)
    _inductor_pending.clear()
    try:
        from torch._inductor import lowering
        from torch._library.utils import get_layout_constraint_tag
    except Exception:  # no Inductor in this build: nothing to register
        return
    for overload in pending:
        if overload in lowering.lowerings:
            continue
        try:
            constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(overload, with_default=True))
            lowering.make_fallback(overload, layout_constraint=constraint, warn=False)
        except Exception as error:  # another torch's private API: its own path applies
            warnings.warn(
                f"apex: could not register {overload} with Inductor ahead of time ({error}); "
                "compiling deep models that use it may be slow on torch <= 2.11",
                stacklevel=2,
            )
            return


# The tags of an op whose kernels take contiguous tensors only: under torch.compile Inductor then
# hands them contiguous inputs (it may otherwise lay out an intermediate, e.g. a permuted view of a
# channels-last activation saved for the backward, in strides the eager run did not have). Empty on
# a torch without the tag.
CONTIGUOUS_INPUTS = tuple(t for t in (getattr(torch.Tag, "needs_contiguous_strides", None),) if t is not None)


def direct(overload) -> Callable:
    """An op's check and reference as a plain function of the op's arguments, past the dispatcher.

    For an eager CPU fast path where the dispatcher's share of a call matters (the op, its Python
    autograd layer and the re-dispatch cost 30-80 us of host time a call against a kernel of tens
    of microseconds): call it only where :func:`plain_cpu` holds, where the dispatcher would reach
    the same reference anyway, and wrap it with :func:`autograd` for gradients.
    """
    return _direct[overload]


def plain_cpu(*tensors) -> bool:
    """Whether an eager call on these tensors (None skipped) may skip the dispatcher: plain CPU
    tensors or parameters (no subclass, no functorch wrapper), no torch function or dispatch mode
    active (FakeTensorMode, FlopCounterMode, ...), not under torch.compile or torch.jit.trace
    (which records the op; a Python autograd node it could not save)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack():
        return False
    if torch._C._get_tracing_state() is not None:
        return False
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _PLAIN or not t.is_cpu or torch._C._functorch.is_functorch_wrapped_tensor(t):
            return False
    return True


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def autograd(forward: Callable, setup_context: Callable, backward: Callable, name: str) -> Callable:
    """A differentiable caller of ``forward`` (an op, or a function of ops), with the given backward.

    ``setup_context(ctx, inputs, output)`` and ``backward(ctx, *grad_outputs)`` are those of
    ``torch.autograd.Function`` (and of ``torch.library.register_autograd``): ``inputs`` are the
    caller's positional arguments, ``backward`` returns one gradient (or None) per input. The
    result is ``Function.apply`` of a Function named ``name`` (``<name>Backward`` in grad_fn),
    which eager mode, ``torch.compile`` and ``torch.func.grad`` all differentiate. Without a
    gradient to record, the caller calls ``forward`` directly.
    """

    def forward_(*args):
        return forward(*args)

    # Function.apply binds its arguments to inspect.signature(forward) on every call; a signature
    # given up front spares the inspection (a few microseconds of host time per call).
    forward_.__signature__ = _ARGS_SIGNATURE
    function = type(
        name,
        (torch.autograd.Function,),
        {
            "forward": staticmethod(forward_),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward),
        },
    )
    apply = function.apply

    # The same Function in the older form (forward(ctx, ...) calling setup_context itself), for
    # eager calls outside torch.func transforms and torch.compile, which need the form above:
    # Function.apply binds the arguments of a Function with setup_context to its forward's
    # signature on every call (inspect.Signature.bind: 10-17 us of host time a call, torch 2.13),
    # and skips that for this form.
    def legacy_forward(ctx, *args):
        output = forward(*args)
        setup_context(ctx, args, output)
        return output

    legacy_apply = type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(legacy_forward), "backward": staticmethod(backward)},
    ).apply
    transforms_active = torch._C._are_functorch_transforms_active
    is_compiling = torch.compiler.is_compiling

    def call(*args):
        if torch.is_grad_enabled():
            for t in args:  # a loop, not any(<generator>): a few tenths of a microsecond per call
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    if is_compiling() or transforms_active():
                        return apply(*args)
                    return legacy_apply(*args)
        return forward(*args)

    return call
