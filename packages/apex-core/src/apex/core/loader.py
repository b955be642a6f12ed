"""The one kernel loader of every apex package: AOT, then JIT, then reference.

``APEX_OPS=auto|aot|jit|reference`` picks the tier. ``auto`` tries AOT, then JIT, then falls
back to the PyTorch reference with one warning naming the reason; ``aot`` and ``jit`` are
strict and raise :class:`KernelLoadError` with the reason instead of falling back.

:func:`plan` decides the tier from what is installed and cached, without compiling or loading
anything (``apex report`` shows it); :func:`load` carries the plan out once per process.
Loading is lazy: the reference implementation of each op, reached for a CUDA tensor while no
kernel is registered, calls :func:`load` and re-dispatches when a kernel became available.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from apex.core.descriptors import KernelLibrary

TIERS = ("auto", "aot", "jit", "reference")
# What a JIT build of one package took on the machines we measured (16-core H200 host: 40-70 s).
JIT_BUILD_TIME = "about a minute on 16 cores, longer on fewer"


class KernelLoadError(RuntimeError):
    """A strict tier (APEX_OPS=aot or jit) could not be loaded, or APEX_OPS is not a tier."""


class ReferenceFallbackWarning(UserWarning):
    """CUDA tensors are running the PyTorch reference because no kernel could be loaded."""


@dataclass
class LibraryStatus:
    name: str
    tier: str  # "aot", "jit", "reference", or "unavailable" (a strict APEX_OPS tier that can't be had)
    reason: str = ""
    path: str | None = None  # the AOT library, or the JIT cache folder
    build_info: dict = field(default_factory=dict)
    attempts: list[str] = field(default_factory=list)  # why the tiers before this one were passed over
    loaded: bool = False  # whether load() carried this out in this process

    @property
    def has_kernels(self) -> bool:
        return self.tier in ("aot", "jit")


_lock = threading.RLock()
_loaded: dict[str, LibraryStatus] = {}
_warned: set[str] = set()


def requested_tier() -> str:
    value = os.environ.get("APEX_OPS", "auto").strip().lower() or "auto"
    if value not in TIERS:
        raise KernelLoadError(f"APEX_OPS={value!r} is not one of {', '.join(TIERS)}")
    return value


def _aot_build(lib: KernelLibrary) -> tuple[Path, dict]:
    """The installed AOT build and its build info, or BuildUnavailable saying why it can't be loaded."""
    from apex.core import build

    root = build.package_dir(lib)
    candidates = sorted(root.glob("_C*.so")) + sorted(root.glob("_C*.pyd"))
    if not candidates:
        raise build.BuildUnavailable("no AOT build installed (the package was installed without compiling)")
    so_path = candidates[0]
    info_path = root / ("_C" + build.BUILD_INFO_SUFFIX)
    if not info_path.exists():
        raise build.BuildUnavailable(f"{so_path.name} has no build-info file {info_path.name}; refusing to load it")
    info = json.loads(info_path.read_text())
    mismatch = build.build_info_mismatch(info, lib, root)
    if mismatch:
        raise build.BuildUnavailable(f"AOT build not loadable: {mismatch}")
    return so_path, info


def _jit_plan(lib: KernelLibrary) -> LibraryStatus:
    from apex.core import build

    build.check_toolchain()
    build_dir, info = build.jit_dir(lib)
    if any(build_dir.glob("*.so")):
        return LibraryStatus(lib.name, "jit", f"cached build in {build_dir}", str(build_dir), info)
    return LibraryStatus(lib.name, "jit", "will compile on first CUDA use (or now: `apex build`)", str(build_dir), info)


def plan(lib: KernelLibrary) -> LibraryStatus:
    """The tier :func:`load` takes for ``lib``, and why, without compiling or loading anything.

    Once loaded, the status of what was loaded. A strict ``APEX_OPS`` tier that is not to be had
    plans tier "unavailable" (:func:`load` raises it); a bad ``APEX_OPS`` raises KernelLoadError.
    """
    with _lock:
        if lib.name in _loaded:
            return _loaded[lib.name]
    tier = requested_tier()
    if tier == "reference":
        return LibraryStatus(lib.name, "reference", "forced by APEX_OPS=reference")
    import torch

    from apex.core import build

    if torch.version.cuda is None and tier == "auto":
        return LibraryStatus(lib.name, "reference", f"PyTorch {torch.__version__} is a CPU build")
    attempts: list[str] = []
    for name in ("aot", "jit"):
        if tier not in ("auto", name):
            continue
        try:
            if name == "aot":
                so_path, info = _aot_build(lib)
                status = LibraryStatus(lib.name, "aot", "ahead-of-time build matches this torch/CUDA/Python")
                status.path, status.build_info = str(so_path), info
            else:
                status = _jit_plan(lib)
            status.attempts = attempts
            return status
        except (build.BuildUnavailable, OSError, RuntimeError, ValueError) as exc:
            attempts.append(f"{name}: {_last_line(exc)}")
            if tier == name:
                return LibraryStatus(lib.name, "unavailable", f"APEX_OPS={tier} but {attempts[-1]}", attempts=attempts)
    return LibraryStatus(lib.name, "reference", "; ".join(attempts), attempts=attempts)


_announced: set[str] = set()


def jit_build(lib: KernelLibrary, verbose: bool = False) -> LibraryStatus:
    """Compile the shipped sources into the JIT cache (or reuse the cached build) and load it.

    A compile says so on stderr when it starts and ends (once per library and process): the
    first CUDA call otherwise seems to hang for a minute.
    """
    from torch.utils import cpp_extension

    from apex.core import build

    build.check_toolchain()
    root = build.package_dir(lib)
    build_dir, info = build.jit_dir(lib, root)
    cached = any(build_dir.glob("*.so"))
    build_dir.mkdir(parents=True, exist_ok=True)
    announce = not cached and lib.name not in _announced
    if announce:
        _announced.add(lib.name)
        print(
            f"apex: compiling the {lib.package} kernels ({lib.name}) for this machine, "
            f"{JIT_BUILD_TIME}; cached in {build_dir}",
            file=sys.stderr,
            flush=True,
        )
    start = time.monotonic()
    cpp_extension.load(
        name=f"{lib.name}_jit",
        sources=[str(p) for p in build.source_files(lib, root)],
        extra_include_paths=build.include_dirs(lib, root),
        extra_cflags=build.cxx_flags(lib),
        extra_cuda_cflags=build.nvcc_flags(lib),
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=verbose,
    )
    (build_dir / ("_C" + build.BUILD_INFO_SUFFIX)).write_text(json.dumps(info, indent=2) + "\n")
    if announce:
        print(f"apex: {lib.name} compiled in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    how = "reused the cached build in" if cached else "compiled from the shipped sources into"
    return LibraryStatus(lib.name, "jit", f"{how} {build_dir}", str(build_dir), info)


def _last_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[-1] if lines else type(exc).__name__


def _carry_out(lib: KernelLibrary, status: LibraryStatus, verbose: bool) -> LibraryStatus:
    if status.tier == "aot":
        import torch

        torch.ops.load_library(status.path)
        return status
    built = jit_build(lib, verbose)
    built.attempts = status.attempts
    return built


def load(lib: KernelLibrary, *, verbose: bool = False) -> LibraryStatus:
    """Carry out ``lib``'s :func:`plan` once per process; return what was loaded.

    Under ``APEX_OPS=auto`` an AOT build that fails to load falls through to JIT, and a JIT
    build that fails to the reference.
    """
    from apex.core import build

    with _lock:
        if lib.name in _loaded:
            return _loaded[lib.name]
        status = plan(lib)
        if status.tier == "unavailable":
            raise KernelLoadError(f"{lib.name}: {status.reason}")
        while status.has_kernels:
            try:
                status = _carry_out(lib, status, verbose)
                break
            except (build.BuildUnavailable, OSError, RuntimeError, ImportError) as exc:
                reason = f"{status.tier}: {_last_line(exc)}"
                if requested_tier() != "auto":
                    raise KernelLoadError(f"{lib.name}: APEX_OPS={status.tier} but {reason}") from exc
                attempts = [*status.attempts, reason]
                status = LibraryStatus(lib.name, "reference", "; ".join(attempts), attempts=attempts)
                if reason.startswith("aot"):
                    try:
                        status = _jit_plan(lib)
                        status.attempts = attempts
                    except (build.BuildUnavailable, OSError, RuntimeError) as jit_exc:
                        attempts.append(f"jit: {_last_line(jit_exc)}")
                        status.reason = "; ".join(attempts)
        status.loaded = True
        _loaded[lib.name] = status
        return status


def kernels_for_cuda(lib: KernelLibrary) -> bool:
    """Called by a reference implementation that received CUDA tensors.

    Returns True when a kernel library was loaded just now (the caller re-dispatches);
    otherwise warns once, naming the reason, and returns False (the caller computes the
    reference result).
    """
    result = load(lib)
    if result.has_kernels:
        return True
    if result.name not in _warned and "APEX_OPS=reference" not in result.reason:
        _warned.add(result.name)
        warnings.warn(
            f"apex: {lib.name} kernels unavailable, CUDA tensors use the PyTorch reference "
            f"({result.reason}). Run `apex report` for details.",
            ReferenceFallbackWarning,
            stacklevel=3,
        )
    return False


def reset(name: str | None = None) -> None:
    """Forget what was loaded (tests); loaded shared libraries stay loaded."""
    with _lock:
        if name is None:
            _loaded.clear()
            _warned.clear()
        else:
            _loaded.pop(name, None)
            _warned.discard(name)
