"""Build helpers: CUDA_HOME detection, arch policy, include paths, build switch."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from apex.core import build
from apex.core._plugin import KERNELS

CORE_DIR = Path(__file__).resolve().parents[1]


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def wrapped_toolkit(tmp_path, monkeypatch):
    """A fake toolkit in tmp/toolkit and, first on PATH, a wrapper script that execs its nvcc."""
    toolkit = tmp_path / "toolkit"
    _executable(toolkit / "bin" / "nvcc", '#!/bin/sh\necho "#$ TOP=$(dirname "$0")/.." >&2\n')
    _executable(tmp_path / "wrappers" / "nvcc", f'#!/bin/sh\nexec {toolkit}/bin/nvcc "$@"\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'wrappers'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    return toolkit


def test_cuda_home_sees_through_a_wrapper_nvcc(wrapped_toolkit):
    assert build.find_cuda_home() == wrapped_toolkit.resolve()


def test_cuda_home_env_wins_only_when_it_holds_nvcc(wrapped_toolkit, tmp_path, monkeypatch):
    other = tmp_path / "other"
    _executable(other / "bin" / "nvcc", "#!/bin/sh\n")
    monkeypatch.setenv("CUDA_HOME", str(other))
    assert build.find_cuda_home() == other
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "missing"))
    assert build.find_cuda_home() == wrapped_toolkit.resolve()


def test_arch_list_from_environment(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert build.arch_list() == "9.0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU only")
def test_arch_list_must_be_explicit_without_a_gpu(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    with pytest.raises(build.BuildUnavailable, match="set TORCH_CUDA_ARCH_LIST"):
        build.arch_list()


def test_pip_cuda_headers_are_found(tmp_path, monkeypatch):
    include = tmp_path / "site" / "nvidia" / "cu13" / "include"
    include.mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert str(include) in build.pip_cuda_include_dirs()


@pytest.mark.parametrize(("value", "mode"), [("0", "off"), ("no", "off"), ("1", "on"), ("", "auto"), ("auto", "auto")])
def test_build_mode(monkeypatch, value, mode):
    monkeypatch.setenv("APEX_BUILD_OPS", value)
    assert build.build_mode() == mode


def test_max_jobs(monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "3")
    assert build.max_jobs() == 3


def test_setup_without_building(monkeypatch, capsys):
    monkeypatch.setenv("APEX_BUILD_OPS", "0")
    assert build.setup_kernel_package(KERNELS, src_root=str(CORE_DIR / "src")) == {}
    assert "APEX_BUILD_OPS=0, not compiling" in capsys.readouterr().out


@pytest.mark.skipif(torch.version.cuda is not None, reason="CPU-build behaviour")
def test_missing_toolchain_is_not_a_crash_unless_asked(monkeypatch, capsys):
    monkeypatch.setenv("APEX_BUILD_OPS", "auto")
    assert build.setup_kernel_package(KERNELS, src_root=str(CORE_DIR / "src")) == {}
    assert "not compiling (PyTorch" in capsys.readouterr().out
    monkeypatch.setenv("APEX_BUILD_OPS", "1")
    with pytest.raises(build.BuildUnavailable, match="CPU build"):
        build.setup_kernel_package(KERNELS, src_root=str(CORE_DIR / "src"))


def test_pure_install_takes_seconds(tmp_path):
    """``APEX_BUILD_OPS=0`` builds apex-core's wheel without compiling anything."""
    env = {**os.environ, "APEX_BUILD_OPS": "0"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(CORE_DIR),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    wheels = list(tmp_path.glob("apex_core-*.whl"))
    assert len(wheels) == 1
    import zipfile

    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "apex/core/csrc/include/apex/multi_tensor_apply.cuh" in names
    assert not any(n.endswith(".so") for n in names)
    assert "apex/__init__.py" in names  # apex-core's alone: the namespace with lazy attributes


def test_shared_headers_ship_with_the_package():
    include = Path(build.get_include())
    for header in ("multi_tensor_apply.cuh", "dispatch.h", "vectorized.cuh", "reductions.cuh", "welford.cuh"):
        assert (include / "apex" / header).is_file(), header
