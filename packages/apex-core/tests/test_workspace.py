"""The repository's packages agree with each other: lockstep versions, meta-package extras, layout."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2]
FOLDERS = sorted(p for p in PACKAGES.iterdir() if (p / "pyproject.toml").exists())
META = PACKAGES / "apex"

if not META.exists():
    pytest.skip("not running from a source checkout", allow_module_level=True)


def project(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]


def test_versions_are_in_lockstep():
    versions = {folder.name: project(folder)["version"] for folder in FOLDERS}
    assert len(set(versions.values())) == 1, versions
    for folder in FOLDERS:
        for requirement in project(folder).get("dependencies", []):
            if requirement.startswith("apex"):
                assert requirement.endswith(f"=={versions['apex']}"), (folder.name, requirement)


def test_meta_package_has_an_extra_per_package_and_all():
    extras = project(META)["optional-dependencies"]
    names = {project(folder)["name"] for folder in FOLDERS if folder != META}
    version = project(META)["version"]
    assert {f"{name}=={version}" for name in names} == set(extras["all"])
    for name in names:
        extra = name.removeprefix("apex-")
        assert extras[extra] == [f"{name}=={version}"], extra


@pytest.mark.parametrize("folder", [f for f in FOLDERS if f != META], ids=lambda f: f.name)
def test_package_layout(folder):
    src = folder / "src" / "apex"
    # apex/__init__.py is apex-core's alone (the namespace with lazy attribute access)
    assert (src / "__init__.py").exists() == (folder.name == "apex-core"), folder.name
    assert not (src / "contrib" / "__init__.py").exists()
    plugins = list(src.rglob("_plugin.py"))
    assert len(plugins) == 1, plugins
    module = ".".join(plugins[0].relative_to(folder / "src").with_suffix("").parts)
    entry_points = project(folder)["entry-points"]["apex.plugins"]
    assert list(entry_points.values()) == [f"{module}:PLUGIN"]
    assert (folder / "tests").is_dir() and any((folder / "tests").glob("test_*.py"))
    if (folder / "setup.py").exists():
        assert re.search(r"setup_kernel_package\(KERNELS\)", (folder / "setup.py").read_text())
