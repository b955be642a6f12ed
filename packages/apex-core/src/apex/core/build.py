"""Build helpers shared by every kernel package's ``setup.py`` and by the JIT loader.

Everything that decides *how* a kernel library is compiled lives here once: which CUDA
toolkit, which architectures, which include directories and flags, how many jobs, and
whether to build at all.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from apex.core.descriptors import KernelLibrary

# No -std=...: torch.utils.cpp_extension adds the C++ standard its own headers need (C++20
# for recent torch, whose headers do not compile as C++17), but only when none is given.
COMMON_CXX_FLAGS = ("-O3",)
COMMON_NVCC_FLAGS = (
    "-O3",
    "--use_fast_math",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    # torch's headers define these away for half/bfloat16 operators; we want them.
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
)
BUILD_INFO_SUFFIX = ".build.json"


class BuildUnavailable(RuntimeError):
    """No kernel can be compiled here; the message says why."""


def get_include() -> str:
    """Directory holding apex-core's shared CUDA headers (``#include <apex/...>``)."""
    return str(Path(__file__).parent / "csrc" / "include")


def package_dir(lib: KernelLibrary) -> Path:
    spec = importlib.util.find_spec(lib.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {lib.package!r} of kernel library {lib.name!r} not found")
    return Path(next(iter(spec.submodule_search_locations)))


def source_files(lib: KernelLibrary, root: Path | None = None) -> list[Path]:
    root = root or package_dir(lib)
    files: list[Path] = []
    for pattern in lib.sources:
        files.extend(Path(p) for p in sorted(glob.glob(str(root / pattern))))
    if not files:
        raise BuildUnavailable(f"kernel library {lib.name!r}: no sources match {lib.sources} under {root}")
    return files


def sources_hash(lib: KernelLibrary, root: Path | None = None) -> str:
    """Hash of the library's sources and of every shared header they may include."""
    root = root or package_dir(lib)
    digest = hashlib.sha256()
    headers = sorted(Path(get_include()).rglob("*"))
    local_headers = sorted(p for p in root.joinpath("csrc").rglob("*") if p.suffix in (".h", ".cuh"))
    for path in [*source_files(lib, root), *local_headers, *headers]:
        if path.is_file():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def find_cuda_home() -> Path:
    """The CUDA toolkit folder itself.

    ``CUDA_HOME``/``CUDA_PATH`` win when they hold ``bin/nvcc``. Otherwise ``nvcc`` is asked
    where it lives (``--dryrun`` prints its ``TOP``), which also sees through wrapper
    scripts on PATH that make ``dirname(dirname(which nvcc))`` point at the wrong place.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value and (Path(value) / "bin" / "nvcc").exists():
            return Path(value)
    nvcc = shutil.which("nvcc")
    if nvcc:
        try:
            out = subprocess.run(
                [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                capture_output=True,
                text=True,
                timeout=30,
            )
            match = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.MULTILINE)
            if match:
                top = Path(match.group(1).strip()).resolve()
                if (top / "bin" / "nvcc").exists():
                    return top
        except (OSError, subprocess.SubprocessError):
            pass
        guess = Path(nvcc).resolve().parent.parent
        if (guess / "include" / "cuda_runtime.h").exists() or (guess / "targets").exists():
            return guess
    default = Path("/usr/local/cuda")
    if (default / "bin" / "nvcc").exists():
        return default.resolve()
    raise BuildUnavailable("no CUDA toolkit found: set CUDA_HOME or put nvcc on PATH")


def pip_cuda_include_dirs() -> list[str]:
    """Include folders of the CUDA wheels that pip-installed torch depends on (nvidia/*/include)."""
    dirs: list[str] = []
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}:
        root = Path(site) / "nvidia"
        if root.is_dir():
            dirs.extend(str(p) for p in sorted(root.glob("*/include")) if p.is_dir())
    return sorted(set(dirs))


def arch_list() -> str:
    """The TORCH_CUDA_ARCH_LIST to build for; never left for torch to guess without a GPU."""
    value = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if value:
        return value
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        value = ";".join(f"{major}.{minor}" for major, minor in caps)
        os.environ["TORCH_CUDA_ARCH_LIST"] = value
        return value
    raise BuildUnavailable("no GPU visible to pick the CUDA architectures: set TORCH_CUDA_ARCH_LIST (e.g. '9.0')")


def max_jobs() -> int:
    value = os.environ.get("MAX_JOBS")
    if value and value.isdigit() and int(value) > 0:
        return int(value)
    jobs = max(1, (os.cpu_count() or 1))
    os.environ["MAX_JOBS"] = str(jobs)
    return jobs


def build_mode() -> str:
    value = os.environ.get("APEX_BUILD_OPS", "auto").strip().lower()
    if value in ("0", "false", "no", "off"):
        return "off"
    if value in ("1", "true", "yes", "on"):
        return "on"
    return "auto"


def check_toolchain() -> Path:
    """Raise BuildUnavailable naming the first missing piece; return CUDA_HOME."""
    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        raise BuildUnavailable(f"PyTorch {torch.__version__} is a CPU build (no CUDA)")
    cuda_home = find_cuda_home()
    if not cpp_extension.is_ninja_available():
        raise BuildUnavailable("ninja is not installed (pip install ninja)")
    os.environ["CUDA_HOME"] = str(cuda_home)
    # torch.utils.cpp_extension read CUDA_HOME at import; make it see the real toolkit.
    cpp_extension.CUDA_HOME = str(cuda_home)
    arch_list()
    return cuda_home


def include_dirs(lib: KernelLibrary, root: Path) -> list[str]:
    return [get_include(), *(str(root / d) for d in lib.include_dirs), *pip_cuda_include_dirs()]


def cxx_flags(lib: KernelLibrary) -> list[str]:
    return [*COMMON_CXX_FLAGS, *lib.extra_cflags]


def nvcc_flags(lib: KernelLibrary) -> list[str]:
    return [*COMMON_NVCC_FLAGS, f"--threads={min(4, max_jobs())}", *lib.extra_cuda_cflags]


def build_info(lib: KernelLibrary, root: Path, tier: str, version: str | None = None) -> dict:
    import torch

    from apex.core._version import __version__

    return {
        "library": lib.name,
        "tier": tier,
        "apex_version": version or __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST", ""),
        "sources_hash": sources_hash(lib, root),
    }


def cache_root() -> Path:
    """The JIT cache: ``APEX_CACHE_DIR``, else ``$XDG_CACHE_HOME/apex``, else ``~/.cache/apex``."""
    env = os.environ.get("APEX_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "apex"


def jit_dir(lib: KernelLibrary, root: Path | None = None) -> tuple[Path, dict]:
    """The JIT cache folder of ``lib`` for this torch/CUDA/Python/arch/sources/flags, and its build info."""
    import torch

    root = root or package_dir(lib)
    info = build_info(lib, root, "jit")
    key_src = json.dumps({**info, "flags": [cxx_flags(lib), nvcc_flags(lib)]}, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    tag = f"torch{torch.__version__}-cu{torch.version.cuda}-py{info['python']}"
    return cache_root() / "jit" / f"{lib.name}-{tag}-{key}", info


def build_info_mismatch(info: dict, lib: KernelLibrary, root: Path) -> str | None:
    """Why a build described by ``info`` must not be loaded here, or None if it may."""
    import torch

    here = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    for key, value in here.items():
        if info.get(key) != value:
            return f"built for {key} {info.get(key)}, running {value}"
    current = sources_hash(lib, root)
    if info.get("sources_hash") != current:
        return f"built from other sources (hash {info.get('sources_hash')}, now {current})"
    return None


def _project_version(pyproject: str = "pyproject.toml") -> str | None:
    """The version in the ``pyproject.toml`` of the package being built (setup.py runs in its folder)."""
    path = Path(pyproject)
    if not path.exists():
        return None
    match = re.search(r'^version\s*=\s*"([^"]+)"', path.read_text(), re.MULTILINE)
    return match.group(1) if match else None


def setup_kernel_package(lib: KernelLibrary, src_root: str = "src") -> dict:
    """``setup()`` keyword arguments for a kernel package: its ``_C`` extension, or none.

    With ``APEX_BUILD_OPS=0``, or when no toolchain is found in ``auto`` mode, the package
    installs as pure Python and says which tier it will use at run time.
    """
    mode = build_mode()
    root = Path(src_root).resolve() / Path(*lib.package.split("."))
    if mode == "off":
        print(f"[apex] {lib.name}: APEX_BUILD_OPS=0, not compiling; kernels load by JIT or reference")
        return {}
    try:
        check_toolchain()
    except BuildUnavailable as exc:
        if mode == "on":
            raise
        print(f"[apex] {lib.name}: not compiling ({exc}); kernels will load by JIT or reference")
        return {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    ext = CUDAExtension(
        name=f"{lib.package}._C",
        sources=[os.path.relpath(p) for p in source_files(lib, root)],
        include_dirs=include_dirs(lib, root),
        extra_compile_args={"cxx": cxx_flags(lib), "nvcc": nvcc_flags(lib)},
        py_limited_api=False,
    )

    class BuildWithInfo(BuildExtension):
        def run(self):
            super().run()
            for extension in self.extensions:
                so_path = Path(self.get_ext_fullpath(extension.name))
                info_path = so_path.parent / ("_C" + BUILD_INFO_SUFFIX)
                info = build_info(lib, root, "aot", _project_version())
                info_path.write_text(json.dumps(info, indent=2) + "\n")

    print(f"[apex] {lib.name}: compiling for TORCH_CUDA_ARCH_LIST={arch_list()} with MAX_JOBS={max_jobs()}")
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildWithInfo.with_options(use_ninja=True)}}
