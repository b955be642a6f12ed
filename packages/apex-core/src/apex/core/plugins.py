"""Discovery of the installed apex packages (plugins).

Each distribution declares ``[project.entry-points."apex.plugins"] <name> = "apex.<name>._plugin:PLUGIN"``.
Source-tree runs without installed metadata are covered by a scan of the ``apex`` namespace
for ``_plugin`` modules. A plugin that fails to load is isolated and reported; every other
plugin still works. All apex distributions share one version (lockstep).
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from apex.core.descriptors import KernelLibrary, Plugin

ENTRY_POINT_GROUP = "apex.plugins"
SOURCE_VERSION = "0+source"


@dataclass
class PluginRecord:
    name: str
    target: str  # "module:attribute"
    found_by: str  # "entry point" or "namespace scan"
    plugin: Plugin | None = None
    version: str = SOURCE_VERSION
    error: str | None = None


_lock = threading.Lock()
_records: list[PluginRecord] | None = None


def _distribution_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return SOURCE_VERSION


def _load(record: PluginRecord) -> PluginRecord:
    module_name, _, attribute = record.target.partition(":")
    try:
        plugin = getattr(importlib.import_module(module_name), attribute or "PLUGIN")
        if not isinstance(plugin, Plugin):
            raise TypeError(f"{record.target} is a {type(plugin).__name__}, not an apex.core.descriptors.Plugin")
        record.plugin = plugin
        record.version = _distribution_version(plugin.distribution)
    except Exception as exc:  # a broken plugin must not take the others down
        record.error = f"{type(exc).__name__}: {exc}"
    return record


def _scan_namespace() -> list[tuple[str, str]]:
    """(name, "apex.x._plugin:PLUGIN") for every apex.x and apex.contrib.x holding a _plugin.py.

    A contrib package is named by its folder, or ``contrib_<folder>`` where a top-level package
    has that name (apex.contrib.optimizers beside apex.optimizers), as tools/new_package.py names
    its entry point. Looks at files only, so a broken package is reported when loaded, not while
    scanning.
    """
    found: list[tuple[str, str]] = []
    for prefix in ("apex", "apex.contrib"):
        try:
            package = importlib.import_module(prefix)
        except ImportError:
            continue
        if prefix == "apex":  # pkgutil-style (apex/__init__.py): pick up folders added to sys.path since
            package.__path__ = pkgutil.extend_path(package.__path__, prefix)
        for folder in map(Path, package.__path__):
            for candidate in sorted(folder.glob("*/_plugin.py")):
                module = candidate.parent.name
                if module == "contrib":
                    continue
                name = module
                if prefix == "apex.contrib" and any(seen == module for seen, _ in found):
                    name = f"contrib_{module}"
                found.append((name, f"{prefix}.{module}._plugin:PLUGIN"))
    return found


def discover(refresh: bool = False) -> list[PluginRecord]:
    """All plugins, entry points first, then namespace-scan finds under names not yet seen."""
    global _records
    with _lock:
        if _records is not None and not refresh:
            return _records
        records: dict[str, PluginRecord] = {}
        for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
            records.setdefault(entry.name, PluginRecord(entry.name, entry.value, "entry point"))
        targets = {r.target.split(":")[0] for r in records.values()}
        for name, target in _scan_namespace():
            if target.split(":")[0] not in targets and name not in records:
                records[name] = PluginRecord(name, target, "namespace scan")
        _records = [_load(records[name]) for name in sorted(records, key=lambda n: (n != "core", n))]
        return _records


def get(name: str) -> PluginRecord:
    for record in discover():
        if record.name == name:
            return record
    raise KeyError(f"no apex plugin named {name!r}; installed: {', '.join(r.name for r in discover())}")


def kernel_libraries() -> list[tuple[PluginRecord, KernelLibrary]]:
    return [(r, r.plugin.kernel_library) for r in discover() if r.plugin and r.plugin.kernel_library]


def lockstep_problems(records: list[PluginRecord] | None = None) -> list[str]:
    """Distributions whose version differs from apex-core's (all apex packages move in lockstep)."""
    records = records if records is not None else discover()
    core_version = _distribution_version("apex-core")
    return [
        f"{r.plugin.distribution} {r.version} does not match apex-core {core_version}"
        for r in records
        if r.plugin is not None and r.version != core_version
    ]


def import_ops(record: PluginRecord) -> None:
    """Import the plugin's public module, which registers its ops, before its kernels load."""
    if record.plugin and record.plugin.provides:
        importlib.import_module(record.plugin.provides[0])


def kernel_status(record: PluginRecord):
    """The loader's plan (or, once loaded, state) of the record's kernels; None for a pure-Python package."""
    from apex.core import loader

    lib = record.plugin.kernel_library if record.plugin else None
    return None if lib is None else loader.plan(lib)
