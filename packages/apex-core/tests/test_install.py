"""What an installed apex looks like: one namespace, our own apex-core, nothing shadowing it."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import apex
import apex.core


def test_apex_is_a_namespace_package():
    assert apex.__file__ is None
    assert not any((Path(p) / "__init__.py").exists() for p in apex.__path__)


def test_installed_apex_core_is_ours():
    dist = metadata.distribution("apex-core")
    entry_points = {(ep.group, ep.name): ep.value for ep in dist.entry_points}
    assert entry_points[("apex.plugins", "core")] == "apex.core._plugin:PLUGIN"
    assert entry_points[("console_scripts", "apex")] == "apex.core.cli:main"
    assert dist.version == apex.core.__version__
    # the imported apex.core is the file this distribution installed, or lives in the folder it was
    # installed from in editable mode: not some other project's "apex-core"
    located = Path(apex.core.__file__).resolve()
    installed = {Path(dist.locate_file(f)).resolve() for f in dist.files or []}
    direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    source = Path(direct_url.get("url", "file://").removeprefix("file://"))
    assert located in installed or (
        direct_url.get("dir_info", {}).get("editable") and located.is_relative_to(source.resolve())
    ), f"apex.core at {located} is not from the apex-core distribution"


def test_no_apex_distribution_ships_a_namespace_init():
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "apex" or name.startswith("apex-"):
            files = {str(f) for f in dist.files or []}
            assert "apex/__init__.py" not in files, name
            assert "apex/contrib/__init__.py" not in files, name
