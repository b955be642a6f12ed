"""Every development task. Run ``nox -l`` for the list; ``nox`` runs the default (CI) set.

Our distribution names (``apex``, ``apex-core``, ...) belong to other projects on PyPI, so they
are never resolved against an index: packages install from this tree in dependency order with
``--no-deps --no-build-isolation``, or from our own wheelhouse with ``--no-index``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent / "tools"))
from workspace import PACKAGES, ROOT, install_order, is_kernel_package, package_dirs, project, provides

WHEELHOUSE = ROOT / "wheelhouse"
CPU_TORCH = "torch==2.13.0"  # a CPU build, on local disk on the dev/CI machines
CUDA_TORCH = "torch==2.14.1"  # a CUDA 13 build that can compile extensions without a GPU
BUILD_ARCH = "9.0"  # the H200 we prove kernels on
TEST_TOOLS = ("pytest", "pytest-xdist", "numpy")
BUILD_TOOLS = ("setuptools>=69", "wheel", "ninja", "hatchling")
EXPORT_TOOLS = ("onnx", "onnxscript", "onnxruntime")  # the ONNX export tests (tests session only)

# wheels before isolated: the isolated sessions then install the wheels just built and checked
# (a second or two each) instead of building every dependency from source again (62 builds).
nox.options.sessions = ["lint", "tests", "wheels", "isolated"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"


CORE = PACKAGES / "apex-core"


def build_batches(folders: list[Path]) -> list[list[Path]]:
    """``folders`` as pip calls: apex-core alone first (every kernel package's setup.py imports
    apex.core.build), then all the others in one call (a call per package cost about 6 s each of
    pip's and the build backends' start-up: 28 packages, close to three minutes a session)."""
    if folders and folders[0] == CORE:
        return [folders[:1], folders[1:]] if folders[1:] else [folders[:1]]
    return [folders] if folders else []


def install_packages(session: nox.Session, folders: list[Path], editable: bool = True) -> None:
    for batch in build_batches(folders):
        args = [a for f in batch for a in (["-e", str(f)] if editable else [str(f)])]
        session.install("--no-deps", "--no-build-isolation", *args, env={"APEX_BUILD_OPS": "0"})


SHARED = ROOT / ".nox" / "_shared"  # CPU torch and the tools, installed once for every CPU session
SHARED_REQUIREMENTS = (CPU_TORCH, *TEST_TOOLS, *BUILD_TOOLS, *EXPORT_TOOLS)


def _shared_site() -> Path:
    """The shared venv's site-packages, created on first use (and again when the requirements change).

    One CPU torch install (about 1 GB with its dependencies) serves the tests, the isolated sessions and
    the wheel check: fourteen copies filled the CI machine's disk."""
    marker = SHARED / "requirements.txt"
    wanted = "\n".join(SHARED_REQUIREMENTS) + "\n"
    python = SHARED / "bin" / "python"
    if not marker.is_file() or marker.read_text() != wanted:
        shutil.rmtree(SHARED, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(SHARED)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *SHARED_REQUIREMENTS], check=True)
        marker.write_text(wanted)
    return _purelib(python)


def _purelib(python: str | Path) -> Path:
    """The site-packages folder of ``python``'s environment."""
    query = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.run([str(python), "-c", query], check=True, capture_output=True, text=True).stdout.strip())


def link_shared(python: str | Path) -> None:
    """Put the shared venv's packages after ``python``'s own (a .pth file): pip, pytest, torch and the build
    backends come from there, while whatever the session installs (our packages) stays in its own venv."""
    target = _purelib(python)
    target.mkdir(parents=True, exist_ok=True)
    (target / "_apex_shared.pth").write_text(f"{_shared_site()}\n")


def base_venv(session: nox.Session) -> None:
    """The session's venv (made without pip, see ``CPU_VENV``) on the shared CPU torch and tools."""
    link_shared(Path(session.bin) / "python")


# The CPU sessions' venvs are made without pip: pip comes from the shared venv through the .pth file, so
# the session's own site-packages holds only what the session installs.
CPU_VENV = {"venv_params": ["--without-pip"]}


def pytest_args(session: nox.Session, paths: list[str]) -> list[str]:
    # One worker per core (pytest-xdist): the suites are single-threaded Python on small tensors.
    return ["python", "-m", "pytest", *paths, "-p", "no:cacheprovider", "-n", "auto", *session.posargs]


@nox.session(**CPU_VENV)
def tests(session: nox.Session) -> None:
    """Every package in one venv, CPU: the README's test command runs this among the defaults."""
    base_venv(session)
    install_packages(session, install_order())
    session.install("--no-deps", "--no-build-isolation", str(PACKAGES / "apex"))  # no code: nothing to edit
    session.run(*pytest_args(session, [str(PACKAGES), str(ROOT / "benchmarks")]))  # benchmarks/: its tools' tests
    # The end-to-end benchmark's tiny models through both eager stacks and a variant with an apex switch
    # set (every package at once, on the CPU), with its profile, both traces and the phase timing.
    traces = str(Path(session.create_tmp()) / "traces")
    smoke = ["--smoke", "--stacks", "native-eager,apex-eager,apex-eager+APEX_SIDE_STREAM=0", "--profile", "5"]
    smoke += ["--trace", traces]
    smoke += ["--trace-steps", "2", "--phase-steps", "2"]
    session.run("python", str(ROOT / "benchmarks" / "bench_e2e.py"), *smoke)


@nox.session(**CPU_VENV)
@nox.parametrize("package", list(package_dirs()))
def isolated(session: nox.Session, package: str) -> None:
    """A fresh venv with only ``package`` and what it depends on, then its tests."""
    base_venv(session)
    folders = install_order([package])
    if _WHEELHOUSE_BUILT:  # by this nox run's wheels session, from the tree as it is now
        wheels = [str(_wheel(WHEELHOUSE, f)) for f in folders]
        session.install("--no-deps", "--no-index", "--force-reinstall", *wheels)  # over a reused venv's
    else:
        install_packages(session, folders, editable=False)
    installed = session.run("python", "-m", "pip", "list", "--format=freeze", silent=True)
    apex_installed = sorted(line.split("==")[0] for line in installed.splitlines() if line.startswith("apex"))
    expected = sorted(project(f)["name"] for f in folders)
    if apex_installed != expected:
        session.error(f"isolated {package}: installed {apex_installed}, expected exactly {expected}")
    session.chdir(ROOT)
    session.run(*pytest_args(session, [str(package_dirs()[package] / "tests")]))


# Set by the wheels session once its wheels are built and checked; only a wheelhouse built in this
# run is used (one left from an earlier run may hold older sources).
_WHEELHOUSE_BUILT = False


def _wheel(folder: Path, package: Path) -> Path:
    """The one wheel of ``package`` (a package folder) in ``folder``."""
    name = project(package)["name"].replace("-", "_")
    wheels = sorted(folder.glob(f"{name}-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one {name} wheel in {folder}, found {[w.name for w in wheels]}")
    return wheels[0]


@nox.session
def build(session: nox.Session) -> None:
    """Compile every kernel package's CUDA sources for sm_90 without a GPU (catches compile errors)."""
    # CUDA torch and its dependencies but triton (0.9 GB the compile never uses): the CI disk is small.
    session.install("--no-deps", CUDA_TORCH)
    requires = session.run("python", "-c", _TORCH_REQUIRES, silent=True).split()
    session.install(*requires, *TEST_TOOLS, *BUILD_TOOLS)
    out = ROOT / "build" / "nox-build"
    shutil.rmtree(out, ignore_errors=True)
    env = {"APEX_BUILD_OPS": "1", "TORCH_CUDA_ARCH_LIST": BUILD_ARCH, "MAX_JOBS": session.env.get("MAX_JOBS", "2")}
    wheel_args = ["python", "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out)]

    def install_wheel(folder: Path) -> None:
        session.install("--no-deps", "--no-index", "--force-reinstall", str(_wheel(out, folder)))

    folders = install_order()
    kernels = [f for f in folders if is_kernel_package(f)]
    # apex-core first (every kernel package's setup.py imports apex.core.build), then the others
    # BUILD_JOBS at a time: most have one or two CUDA files, so one build alone leaves cores idle.
    session.run(*wheel_args, str(kernels[0]), env=env)
    install_wheel(kernels[0])
    python = str(Path(session.bin) / "python")
    logs = Path(session.create_tmp())

    def compile_one(folder: Path) -> tuple[Path, int]:
        with open(logs / f"{folder.name}.log", "w") as log:
            command = [python, *wheel_args[1:], str(folder)]
            path = session.bin + os.pathsep + os.environ.get("PATH", "")  # the venv's ninja first
            full_env = {**os.environ, **env, "PATH": path, "VIRTUAL_ENV": str(Path(session.bin).parent)}
            rc = subprocess.run(command, env=full_env, stdout=log, stderr=subprocess.STDOUT).returncode
        return folder, rc

    with ThreadPoolExecutor(max_workers=int(session.env.get("BUILD_JOBS", "2"))) as pool:
        results = list(pool.map(compile_one, kernels[1:]))
    for folder, rc in results:
        session.log(f"{folder.name}: pip wheel exit {rc}\n" + (logs / f"{folder.name}.log").read_text()[-3000:])
    failed = [folder.name for folder, rc in results if rc != 0]
    if failed:
        session.error(f"compile failed: {', '.join(failed)}")
    for folder in folders[1:]:
        if is_kernel_package(folder):
            install_wheel(folder)
        else:
            install_packages(session, [folder], editable=False)
    for wheel in out.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
        if not any(re.search(r"/_C[^/]*\.so$", n) for n in names):
            session.error(f"{wheel.name} carries no compiled _C library")
        if not any(n.endswith("_C.build.json") for n in names):
            session.error(f"{wheel.name} carries no build-info file")
        session.log(f"{wheel.name}: compiled library and build info present")
    # A compile check passes a .cu whose entry point no longer matches its declaration in cuda_ops.h (a new
    # overload): the library then fails to load. Load every installed library here (no GPU needed) and
    # count the CUDA kernels it registers.
    session.run("python", "-c", _LOAD_LIBRARIES, str(len(kernels)))


# Each kernel library as apex-core's plugin registry and build helpers know it (its dispatcher namespace
# and the folder of its AOT build).
_LOAD_LIBRARIES = """
import sys, torch
from apex.core import build, plugins
libraries = plugins.kernel_libraries()
if len(libraries) != int(sys.argv[1]):
    sys.exit(f"{len(libraries)} kernel libraries registered as plugins, {sys.argv[1]} kernel packages built")
for record, lib in libraries:
    (library,) = build.package_dir(lib).glob("_C*.so")
    torch.ops.load_library(str(library))
    ops = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith(lib.name + "::")]
    cuda = [n for n in ops if torch._C._dispatch_has_kernel_for_dispatch_key(n, "CUDA")]
    if not cuda:
        sys.exit(f"{library}: loaded, but registers no CUDA kernel under {lib.name}")
    print(f"{record.plugin.distribution}: {library.name} loads, {len(cuda)} CUDA kernels")
"""


def _check_wheel(session: nox.Session, wheel: Path) -> str:
    """apex/__init__.py (the namespace with lazy attribute access) is apex-core's alone."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    is_core = wheel.name.startswith("apex_core-")
    if ("apex/__init__.py" in names) != is_core:
        where = "apex-core's wheel lacks" if is_core else f"{wheel.name} carries"
        session.error(f"{where} apex/__init__.py: only apex-core ships the apex namespace's __init__")
    if "apex/contrib/__init__.py" in names:
        session.error(f"{wheel.name} carries apex/contrib/__init__.py: apex.contrib must stay a namespace package")
    return wheel.name.split("-")[1]


@nox.session(**CPU_VENV)
def wheels(session: nox.Session) -> None:
    """Build every wheel into ./wheelhouse, check them, install apex[all] from it with --no-index, import all."""
    base_venv(session)
    shutil.rmtree(WHEELHOUSE, ignore_errors=True)
    folders = [*install_order(), PACKAGES / "apex"]
    for batch in build_batches(folders):
        wheel = ["python", "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(WHEELHOUSE)]
        session.run(*wheel, *map(str, batch), env={"APEX_BUILD_OPS": "0"})
        if batch[0] == CORE:  # the other packages' setup.py imports apex.core.build
            session.install("--no-deps", "--no-index", "--force-reinstall", str(_wheel(WHEELHOUSE, CORE)))
    versions = {wheel.name: _check_wheel(session, wheel) for wheel in sorted(WHEELHOUSE.glob("*.whl"))}
    if len(set(versions.values())) != 1:
        session.error(f"wheel versions are not in lockstep: {versions}")
    session.log(f"{len(versions)} wheels, version {next(iter(versions.values()))}: {', '.join(versions)}")
    fresh = Path(session.create_tmp()) / "fresh"
    shutil.rmtree(fresh, ignore_errors=True)
    session.run("python", "-m", "venv", "--without-pip", str(fresh))
    python = str(fresh / "bin" / "python")
    link_shared(python)  # torch and pip from the shared venv; nothing of ours there
    session.run(
        python, "-m", "pip", "install", "--no-index", "--find-links", str(WHEELHOUSE), "apex[all]", external=True
    )
    modules = sorted({m for folder in folders[:-1] for m in provides(folder)})
    session.run(python, "-c", _IMPORT_CHECK.format(modules=modules), external=True)
    session.run(str(fresh / "bin" / "apex"), "report", external=True)
    global _WHEELHOUSE_BUILT
    _WHEELHOUSE_BUILT = True


_TORCH_REQUIRES = """
import importlib.metadata as metadata
for requirement in metadata.requires("torch"):
    spec, _, marker = requirement.partition(";")
    if "extra ==" not in marker and not spec.startswith("triton"):
        print(spec.replace(" ", ""))
"""

_IMPORT_CHECK = """
import importlib, sys, apex
assert apex.__file__.endswith("apex/__init__.py") and "torch" not in sys.modules, apex.__file__
for name in {modules}:
    importlib.import_module(name)
print("imported", {modules})
"""


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(**CPU_VENV)
def demo(session: nox.Session) -> None:
    """Train the tiny GPT of examples/ with every apex package installed."""
    base_venv(session)
    install_packages(session, install_order())
    session.run("python", str(ROOT / "examples" / "train_gpt.py"), *session.posargs)


@nox.session(default=False)
def gpu(session: nox.Session) -> None:
    """On a CUDA machine: AOT-build everything, run the gpu tests and benchmarks (tools/gpu_verify.sh)."""
    out = session.posargs[0] if session.posargs else str(ROOT / "gpu-results")
    session.run("bash", str(ROOT / "tools" / "gpu_verify.sh"), out, external=True)
