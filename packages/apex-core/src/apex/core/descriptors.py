"""Plain data describing a package to apex-core. Imports nothing heavy (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KernelLibrary:
    """A package's compiled kernel library.

    ``name`` is both the dispatcher namespace of its ops (``torch.ops.<name>``) and the
    stem of the JIT cache entry; the AOT build is ``<package>/_C*.so`` next to
    ``<package>/_C.build.json``. ``sources`` are relative to the package directory and are
    shipped in the wheel so that a JIT build is possible after install.
    """

    name: str
    package: str
    sources: tuple[str, ...]
    include_dirs: tuple[str, ...] = ()
    extra_cflags: tuple[str, ...] = ()
    extra_cuda_cflags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plugin:
    """What one distribution contributes to the ``apex`` namespace.

    ``provides`` lists the public modules; importing the first registers the package's
    dispatcher ops (their schemas, references and fakes).
    """

    name: str
    distribution: str
    provides: tuple[str, ...]
    kernel_library: KernelLibrary | None = None
    requires: tuple[str, ...] = field(default_factory=tuple)
