"""Plain data describing a package to apex-core. Imports nothing heavy (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Where every kernel package keeps its sources (relative to the package directory, as the
# wheel ships them for a JIT build).
KERNEL_SOURCES = ("csrc/*.cu", "csrc/*.cpp")


def _import_path(module: str) -> str:
    return f"apex.{module}"


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

    @classmethod
    def of_package(cls, module: str, *, sources: tuple[str, ...] = KERNEL_SOURCES) -> KernelLibrary:
        """The library of the package ``apex.<module>`` (``"optimizers"``, ``"contrib.focal_loss"``),
        named by the convention: namespace ``apex_<module with underscores>``."""
        return cls(name="apex_" + module.replace(".", "_"), package=_import_path(module), sources=sources)


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

    @classmethod
    def of_package(
        cls,
        module: str,
        *,
        kernels: KernelLibrary | None = None,
        provides: tuple[str, ...] | None = None,
        requires: tuple[str, ...] = ("apex-core",),
        name: str | None = None,
    ) -> Plugin:
        """The plugin of the package ``apex.<module>`` (``"optimizers"``, ``"contrib.focal_loss"``),
        named by the convention: plugin name the module's last part (``name`` where that is a
        top-level package's too: contrib_optimizers), distribution
        ``apex-<module with hyphens>``, providing ``apex.<module>`` alone unless ``provides`` says more,
        requiring apex-core (which every other package builds on) unless ``requires`` says otherwise."""
        return cls(
            name=name or module.rsplit(".", 1)[-1],
            distribution="apex-" + module.replace(".", "-").replace("_", "-"),
            provides=(_import_path(module),) if provides is None else provides,
            kernel_library=kernels,
            requires=requires,
        )
