"""The one kernel loader of every apex package: AOT, then JIT, then reference.

``APEX_OPS=auto|aot|jit|reference`` picks the tier. ``auto`` tries AOT, then JIT, then falls
back to the PyTorch reference with one warning naming the reason; ``aot`` and ``jit`` are
strict and raise :class:`KernelLoadError` with the reason instead of falling back.

Loading is lazy: nothing is compiled or loaded at import. The reference implementation of
each op, reached for a CUDA tensor while no kernel is registered, calls :func:`load` once and
re-dispatches when a kernel became available.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from apex.core.descriptors import KernelLibrary

TIERS = ("auto", "aot", "jit", "reference")


class KernelLoadError(RuntimeError):
    """A strict tier (APEX_OPS=aot or jit) could not be loaded; the message says why."""


class ReferenceFallbackWarning(UserWarning):
    """CUDA tensors are running the PyTorch reference because no kernel could be loaded."""


@dataclass
class LibraryStatus:
    name: str
    tier: str  # "aot", "jit", "reference", or "not loaded"
    reason: str = ""
    path: str | None = None
    build_info: dict = field(default_factory=dict)
    attempts: list[str] = field(default_factory=list)

    @property
    def has_kernels(self) -> bool:
        return self.tier in ("aot", "jit")


_lock = threading.RLock()
_status: dict[str, LibraryStatus] = {}
_warned: set[str] = set()


def requested_tier() -> str:
    value = os.environ.get("APEX_OPS", "auto").strip().lower() or "auto"
    if value not in TIERS:
        raise KernelLoadError(f"APEX_OPS={value!r} is not one of {', '.join(TIERS)}")
    return value


def cache_root() -> Path:
    env = os.environ.get("APEX_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "apex"


def status(lib: KernelLibrary) -> LibraryStatus:
    """The library's status: what was loaded, or (before any CUDA op ran) what :func:`probe` expects."""
    with _lock:
        loaded = _status.get(lib.name)
    return loaded if loaded is not None else probe(lib)


def _find_aot(lib: KernelLibrary, root: Path) -> Path | None:
    candidates = sorted(root.glob("_C*.so")) + sorted(root.glob("_C*.pyd"))
    return candidates[0] if candidates else None


def _loadable_aot(lib: KernelLibrary) -> tuple[Path, dict]:
    """The installed AOT build and its build info, or BuildUnavailable saying why it can't be loaded."""
    from apex.core import build

    root = build.package_dir(lib)
    so_path = _find_aot(lib, root)
    if so_path is None:
        raise build.BuildUnavailable("no AOT build installed (the package was installed without compiling)")
    info_path = root / ("_C" + build.BUILD_INFO_SUFFIX)
    if not info_path.exists():
        raise build.BuildUnavailable(f"{so_path.name} has no build-info file {info_path.name}; refusing to load it")
    info = json.loads(info_path.read_text())
    mismatch = build.build_info_mismatch(info, lib, root)
    if mismatch:
        raise build.BuildUnavailable(f"AOT build not loadable: {mismatch}")
    return so_path, info


def _try_aot(lib: KernelLibrary) -> LibraryStatus:
    import torch

    so_path, info = _loadable_aot(lib)
    torch.ops.load_library(str(so_path))
    return LibraryStatus(lib.name, "aot", "ahead-of-time build matches this torch/CUDA/Python", str(so_path), info)


def jit_build_dir(lib: KernelLibrary) -> tuple[Path, dict]:
    import torch

    from apex.core import build

    root = build.package_dir(lib)
    info = build.build_info(lib, root, "jit")
    key_src = json.dumps(
        {**info, "flags": [build.cxx_flags(lib), build.nvcc_flags(lib)], "tier": "jit"}, sort_keys=True
    )
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    tag = f"torch{torch.__version__}-cu{torch.version.cuda}-py{info['python']}"
    return cache_root() / "jit" / f"{lib.name}-{tag}-{key}", info


def jit_build(lib: KernelLibrary, verbose: bool = False) -> LibraryStatus:
    """Compile the shipped sources into the JIT cache (or reuse the cached build) and load it."""
    from torch.utils import cpp_extension

    from apex.core import build

    build.check_toolchain()
    root = build.package_dir(lib)
    build_dir, info = jit_build_dir(lib)
    build_dir.mkdir(parents=True, exist_ok=True)
    build.max_jobs()
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
    return LibraryStatus(lib.name, "jit", f"compiled from the shipped sources into {build_dir}", str(build_dir), info)


def load(lib: KernelLibrary, *, verbose: bool = False) -> LibraryStatus:
    """Load ``lib``'s kernels once per process by the tier APEX_OPS asks for; return its status."""
    with _lock:
        cached = _status.get(lib.name)
        if cached is not None and cached.tier != "not loaded":
            return cached
        tier = requested_tier()
        attempts: list[str] = []
        result: LibraryStatus | None = None
        if tier == "reference":
            result = LibraryStatus(lib.name, "reference", "forced by APEX_OPS=reference")
        else:
            import torch

            from apex.core import build

            if torch.version.cuda is None and tier == "auto":
                result = LibraryStatus(lib.name, "reference", f"PyTorch {torch.__version__} is a CPU build")
            for name, attempt in (("aot", _try_aot), ("jit", lambda lib: jit_build(lib, verbose))):
                if result is not None or tier not in ("auto", name):
                    continue
                try:
                    result = attempt(lib)
                except (build.BuildUnavailable, OSError, RuntimeError, ImportError) as exc:
                    message = str(exc).strip().splitlines()
                    attempts.append(f"{name}: {message[-1] if message else type(exc).__name__}")
                    if tier == name:
                        raise KernelLoadError(f"{lib.name}: APEX_OPS={tier} but {attempts[-1]}") from exc
            if result is None:
                result = LibraryStatus(lib.name, "reference", "; ".join(attempts))
        result.attempts = attempts
        _status[lib.name] = result
        return result


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
    """Forget cached statuses (tests); loaded shared libraries stay loaded."""
    with _lock:
        if name is None:
            _status.clear()
            _warned.clear()
        else:
            _status.pop(name, None)
            _warned.discard(name)


def probe(lib: KernelLibrary) -> LibraryStatus:
    """What :func:`load` would do, without compiling or loading anything (for ``apex report``)."""
    with _lock:
        if lib.name in _status:
            return _status[lib.name]
    tier = requested_tier()
    if tier == "reference":
        return LibraryStatus(lib.name, "reference", "forced by APEX_OPS=reference")
    import torch

    from apex.core import build

    if torch.version.cuda is None:
        return LibraryStatus(lib.name, "reference", f"PyTorch {torch.__version__} is a CPU build")
    attempts = []
    if tier in ("auto", "aot"):
        try:
            so_path, info = _loadable_aot(lib)
            return LibraryStatus(lib.name, "aot", "ahead-of-time build matches", str(so_path), info)
        except (build.BuildUnavailable, OSError, ValueError) as exc:
            attempts.append(f"aot: {exc}")
    if tier in ("auto", "jit"):
        try:
            build.check_toolchain()
            build_dir, info = jit_build_dir(lib)
            if any(build_dir.glob("*.so")):
                return LibraryStatus(lib.name, "jit", f"cached build in {build_dir}", str(build_dir), info, attempts)
            return LibraryStatus(
                lib.name, "jit", "will compile on first CUDA use (or now: `apex build`)", None, info, attempts
            )
        except (build.BuildUnavailable, OSError, RuntimeError) as exc:
            attempts.append(f"jit: {exc}")
    return LibraryStatus(lib.name, "reference", "; ".join(attempts), attempts=attempts)
