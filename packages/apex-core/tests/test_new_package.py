"""tools/new_package.py: packages generated into a copy of the tree are complete, registered and clean,
and their tests pass.

The copy holds what the tool and the workspace checks read: tools/, packages/ without build
outputs, the root pytest configuration and README.md. Nothing is installed: the generated tests
run in a child pytest, in the copy, with the generated src/ folders on PYTHONPATH and this
environment's apex-core. The child sees no GPU: a generated package's CUDA path needs its kernel
built, which is ``nox -s build``'s job.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TOOL = Path("tools") / "new_package.py"

if not (ROOT / TOOL).exists():
    pytest.skip("not running from a source checkout", allow_module_level=True)

# One of each kind, named to sort after and before "core" (the order of the generated imports).
KERNEL = {"args": ["template_kernels", "--kernels"], "dist": "apex-template-kernels", "module": "template_kernels"}
PURE = {"args": ["contrib-template-pure"], "dist": "apex-contrib-template-pure", "module": "contrib.template_pure"}
VERSION = tomllib.loads((ROOT / "packages" / "apex-core" / "pyproject.toml").read_text())["project"]["version"]


def run_tool(tree: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(tree / TOOL), *args], capture_output=True, text=True, cwd=tree)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("tree")
    ignore = shutil.ignore_patterns("build", "__pycache__", "*.egg-info", "*.so", "*.build.json", ".nox")
    for folder in ("tools", "packages"):
        shutil.copytree(ROOT / folder, tree / folder, ignore=ignore)
    for name in ("pyproject.toml", "conftest.py", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    for package in (KERNEL, PURE):
        result = run_tool(tree, *package["args"])
        assert result.returncode == 0, result.stderr
    return tree


def files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_the_packages_have_every_file_and_nothing_else(tree):
    common = {"README.md", "pyproject.toml", "benchmarks/NOTES.md"}
    kernel_src = "src/apex/template_kernels"
    assert files(tree / "packages" / KERNEL["dist"]) == common | {
        "setup.py",
        f"{kernel_src}/__init__.py",
        f"{kernel_src}/_plugin.py",
        f"{kernel_src}/_ops.py",
        f"{kernel_src}/csrc/scale.cu",
        f"{kernel_src}/csrc/cuda_ops.h",
        f"{kernel_src}/csrc/cuda_ops.cpp",
        "tests/test_template_kernels.py",
        "benchmarks/bench_template_kernels.py",
    }
    pure_src = "src/apex/contrib/template_pure"  # no apex/__init__.py, no apex/contrib/__init__.py
    assert files(tree / "packages" / PURE["dist"]) == common | {
        f"{pure_src}/__init__.py",
        f"{pure_src}/_plugin.py",
        f"{pure_src}/_ops.py",
        "tests/test_template_pure.py",
        "benchmarks/bench_template_pure.py",
    }


def test_the_kernel_registers_the_op_for_cuda_with_the_shared_headers(tree):
    csrc = tree / "packages" / KERNEL["dist"] / "src/apex/template_kernels/csrc"
    source = (csrc / "scale.cu").read_text()
    # The .cu defines the entry point in the library's namespace; cuda_ops.cpp registers it (g++ only).
    assert "torch/library.h" not in source and "TORCH_LIBRARY" not in source
    assert "namespace apex_template_kernels {\n\nat::Tensor scale_cuda(" in source
    for needed in ("<apex/vectorized.cuh>", "CUDAGuard", "getCurrentCUDAStream()", "int64_t n", '"cuda_ops.h"'):
        assert needed in source, needed
    header = (csrc / "cuda_ops.h").read_text()
    assert "at::Tensor scale_cuda(const at::Tensor& x, double alpha);" in header
    registration = (csrc / "cuda_ops.cpp").read_text()
    assert "TORCH_LIBRARY_IMPL(apex_template_kernels, CUDA, m)" in registration
    assert 'm.impl("scale", &apex_template_kernels::scale_cuda)' in registration


def test_the_packages_are_registered(tree):
    meta = tomllib.loads((tree / "packages" / "apex" / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    kernel, pure = f"{KERNEL['dist']}=={VERSION}", f"{PURE['dist']}=={VERSION}"
    assert extras["template-kernels"] == [kernel]
    assert extras["contrib-template-pure"] == [pure]
    original = tomllib.loads((ROOT / "packages" / "apex" / "pyproject.toml").read_text())["project"]
    # The contrib extra gains the contrib package after those it already had (if any).
    assert extras["contrib"] == [*original["optional-dependencies"].get("contrib", []), pure]
    assert extras["all"] == [*original["optional-dependencies"]["all"], kernel, pure]
    assert list(extras)[-2:] == ["contrib", "all"]

    readme = (tree / "README.md").read_text()
    for package in (KERNEL, PURE):
        assert re.search(rf"^\| `{package['dist']}` \| `apex\.{re.escape(package['module'])}` \|", readme, re.M)
    meta_row = next(line for line in readme.splitlines() if line.startswith("| `apex` |"))
    assert "`template-kernels`, `contrib-template-pure`, `contrib`, `all`" in meta_row

    order = subprocess.run(
        [sys.executable, "tools/workspace.py", "order", KERNEL["dist"], PURE["dist"]],
        capture_output=True,
        text=True,
        cwd=tree,
        check=True,
    ).stdout.split("\n")
    packages = tree / "packages"
    assert order[:3] == [
        f"kernel {packages / 'apex-core'}",
        f"kernel {packages / KERNEL['dist']}",
        f"pure {packages / PURE['dist']}",
    ]


@pytest.mark.slow
def test_the_generated_tests_and_the_workspace_checks_pass(tree):
    sources = [str(tree / "packages" / p["dist"] / "src") for p in (KERNEL, PURE)]
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([*sources, *inherited])}
    tests = [f"packages/{p['dist']}/tests" for p in (KERNEL, PURE)] + ["packages/apex-core/tests/test_workspace.py"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *tests, "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        cwd=tree,
        env=env,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 50 and "failed" not in summary, summary


def test_the_benchmarks_import_only_what_apex_core_benchmarking_has(tree):
    import apex.core.benchmarking as benchmarking

    for package in (KERNEL, PURE):
        leaf = package["module"].rsplit(".", 1)[-1]
        module = ast.parse((tree / "packages" / package["dist"] / "benchmarks" / f"bench_{leaf}.py").read_text())
        imported = [
            alias.name
            for node in ast.walk(module)
            if isinstance(node, ast.ImportFrom) and node.module == "apex.core.benchmarking"
            for alias in node.names
        ]
        assert imported, leaf
        assert [name for name in imported if not hasattr(benchmarking, name)] == []


def _ruff() -> list[str] | None:
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    found = shutil.which("ruff")
    return [found] if found else None


def test_the_generated_files_pass_ruff(tree):
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed here (nox -s lint has it)")
    folders = [f"packages/{p['dist']}" for p in (KERNEL, PURE)]
    for command in (["check", "--no-cache"], ["format", "--check", "--no-cache"]):
        result = subprocess.run([*ruff, *command, *folders], capture_output=True, text=True, cwd=tree)
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("amp", "apex-amp is taken"),
        ("template_kernels", "apex-template-kernels is taken"),
        ("contrib.template_pure", "apex-contrib-template-pure is taken"),
        ("contrib", "reserved"),
        ("core", "reserved"),
        ("Fused Dense", "not a package name"),
        ("2d", "not a package name"),
        ("contrib.class", "not a package name"),
    ],
)
def test_bad_or_taken_names_change_nothing(tree, name, message):
    meta, readme = tree / "packages" / "apex" / "pyproject.toml", tree / "README.md"
    before = (meta.read_text(), readme.read_text(), sorted(p.name for p in (tree / "packages").iterdir()))
    result = run_tool(tree, name)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert (meta.read_text(), readme.read_text(), sorted(p.name for p in (tree / "packages").iterdir())) == before


@pytest.mark.parametrize(
    ("name", "module", "dist"),
    [
        ("fused_dense", "fused_dense", "apex-fused-dense"),
        ("fused-dense", "fused_dense", "apex-fused-dense"),
        ("apex-fused-dense", "fused_dense", "apex-fused-dense"),
        ("contrib.focal_loss", "contrib.focal_loss", "apex-contrib-focal-loss"),
        ("contrib/focal_loss", "contrib.focal_loss", "apex-contrib-focal-loss"),
        ("contrib-focal-loss", "contrib.focal_loss", "apex-contrib-focal-loss"),
    ],
)
def test_names(tree, monkeypatch, name, module, dist):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the tool puts tools/ first to import workspace
    monkeypatch.delitem(sys.modules, "workspace", raising=False)
    spec = importlib.util.spec_from_file_location("new_package_under_test", tree / TOOL)
    tool = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, tool)  # dataclasses look their module up there
    spec.loader.exec_module(tool)
    monkeypatch.delitem(sys.modules, "workspace", raising=False)
    names = tool.Names(tool.parse_module(name), kernels=False, version=VERSION, description="")
    assert (names.module, names.dist) == (module, dist)
    assert names.namespace == "apex_" + module.replace(".", "_")
    assert names.plugin == module.rsplit(".", 1)[-1]
