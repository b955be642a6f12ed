"""The packages of this repository and their install order (used by noxfile.py and gpu_verify.sh).

``python tools/workspace.py order [DIST ...]`` prints ``<kind> <folder>`` lines, dependencies
first, for the named distributions (default: all but the meta-package); kind is ``kernel``
(setuptools, has setup.py) or ``pure`` (hatchling).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"


def project(path: Path) -> dict:
    return tomllib.loads((path / "pyproject.toml").read_text())["project"]


def apex_requirements(path: Path) -> list[str]:
    """Names of the apex distributions a package depends on."""
    names = []
    for requirement in project(path).get("dependencies", []):
        name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]
        if name == "apex" or name.startswith("apex-"):
            names.append(name)
    return names


def package_dirs() -> dict[str, Path]:
    """Distribution name -> folder, for every package except the meta-package."""
    found = {}
    for path in sorted(PACKAGES.iterdir()):
        if (path / "pyproject.toml").exists() and path.name != "apex":
            found[project(path)["name"]] = path
    return found


def install_order(names: list[str] | None = None) -> list[Path]:
    """Folders of ``names`` (default all) and everything they need, dependencies first."""
    dirs, ordered, seen = package_dirs(), [], set()

    def visit(name: str) -> None:
        if name in seen:
            return
        if name not in dirs:
            raise SystemExit(f"unknown apex distribution {name!r}; known: {', '.join(dirs)}")
        seen.add(name)
        for dependency in apex_requirements(dirs[name]):
            visit(dependency)
        ordered.append(dirs[name])

    for name in names or list(dirs):
        visit(name)
    return ordered


def is_kernel_package(path: Path) -> bool:
    return (path / "setup.py").exists()


def provides(path: Path) -> list[str]:
    """The public modules a package's plugin descriptor lists."""
    text = next((path / "src").rglob("_plugin.py")).read_text()
    match = re.search(r"provides=\(([^)]*)\)", text)
    return re.findall(r'"([\w.]+)"', match.group(1)) if match else []


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "order":
        raise SystemExit(__doc__)
    for folder in install_order(sys.argv[2:] or None):
        print("kernel" if is_kernel_package(folder) else "pure", folder)
