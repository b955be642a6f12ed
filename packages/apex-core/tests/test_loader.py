"""The kernel loader's tiers, strictness and build-info check, on a throwaway kernel library."""

from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch

from apex.core import build, loader
from apex.core.descriptors import KernelLibrary


@pytest.fixture
def fake_lib(tmp_path, monkeypatch):
    """A kernel library in a temporary package with one source file and no build."""
    package = tmp_path / "apex_loader_fake"
    (package / "csrc").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "csrc" / "kernel.cu").write_text("// a kernel\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    lib = KernelLibrary(name="apex_loader_fake", package="apex_loader_fake", sources=("csrc/*.cu",))
    loader.reset(lib.name)
    yield lib, package
    loader.reset(lib.name)


def write_build(package, lib, **overrides):
    (package / "_C.so").write_bytes(b"not really a library")
    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "sources_hash": build.sources_hash(lib, package),
        **overrides,
    }
    (package / "_C.build.json").write_text(json.dumps(info))


def test_unknown_tier_is_refused(monkeypatch, fake_lib):
    monkeypatch.setenv("APEX_OPS", "fastest")
    with pytest.raises(loader.KernelLoadError, match=r"APEX_OPS='fastest' is not one of auto, aot, jit, reference"):
        loader.load(fake_lib[0])


def test_forced_reference(monkeypatch, fake_lib):
    monkeypatch.setenv("APEX_OPS", "reference")
    result = loader.load(fake_lib[0])
    assert (result.tier, result.reason) == ("reference", "forced by APEX_OPS=reference")
    assert not result.has_kernels


def test_strict_aot_without_a_build_raises_the_reason(monkeypatch, fake_lib):
    monkeypatch.setenv("APEX_OPS", "aot")
    with pytest.raises(loader.KernelLoadError, match=r"APEX_OPS=aot but aot: no AOT build installed"):
        loader.load(fake_lib[0])


def test_aot_without_build_info_is_refused(monkeypatch, fake_lib):
    lib, package = fake_lib
    (package / "_C.so").write_bytes(b"x")
    monkeypatch.setenv("APEX_OPS", "aot")
    with pytest.raises(loader.KernelLoadError, match=r"has no build-info file _C.build.json"):
        loader.load(lib)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"torch": "1.0.0"}, r"built for torch 1.0.0, running " + torch.__version__.replace("+", r"\+")),
        ({"python": "2.7"}, r"built for python 2.7"),
        ({"cuda": "9.9"}, r"built for cuda 9.9"),
        ({"sources_hash": "0123"}, r"built from other sources \(hash 0123"),
    ],
)
def test_aot_built_for_something_else_is_refused(monkeypatch, fake_lib, override, message):
    lib, package = fake_lib
    write_build(package, lib, **override)
    monkeypatch.setenv("APEX_OPS", "aot")
    with pytest.raises(loader.KernelLoadError, match=message):
        loader.load(lib)
    assert loader.plan(lib).tier == "unavailable"  # strict aot, the build refused


def test_sources_hash_follows_the_sources(fake_lib):
    lib, package = fake_lib
    before = build.sources_hash(lib, package)
    (package / "csrc" / "kernel.cu").write_text("// another kernel\n")
    assert build.sources_hash(lib, package) != before


@pytest.mark.skipif(torch.version.cuda is not None, reason="CPU-build behaviour")
def test_cpu_torch_falls_back_to_reference_quietly_and_jit_is_strict(monkeypatch, fake_lib):
    lib = fake_lib[0]
    monkeypatch.setenv("APEX_OPS", "auto")
    result = loader.load(lib)
    assert result.tier == "reference" and "CPU build" in result.reason
    assert loader.plan(lib).tier == "reference"
    loader.reset(lib.name)
    monkeypatch.setenv("APEX_OPS", "jit")
    with pytest.raises(loader.KernelLoadError, match=r"APEX_OPS=jit but jit: .*CPU build"):
        loader.load(lib)


def test_fallback_warns_once_with_the_reason(monkeypatch, fake_lib):
    lib = fake_lib[0]
    monkeypatch.setattr(loader, "load", lambda lib, **_: loader.LibraryStatus(lib.name, "reference", "nvcc exploded"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loader.kernels_for_cuda(lib) is False
        assert loader.kernels_for_cuda(lib) is False
    messages = [str(w.message) for w in caught if issubclass(w.category, loader.ReferenceFallbackWarning)]
    assert len(messages) == 1
    assert "apex_loader_fake kernels unavailable" in messages[0] and "nvcc exploded" in messages[0]


def test_plan_before_loading_then_what_was_loaded(monkeypatch, fake_lib):
    lib = fake_lib[0]
    monkeypatch.setenv("APEX_OPS", "reference")
    planned = loader.plan(lib)
    assert (planned.reason, planned.loaded) == ("forced by APEX_OPS=reference", False)
    loaded = loader.load(lib)
    assert loaded.loaded and loader.plan(lib) is loaded


def test_a_jit_compile_says_when_it_starts_and_ends(monkeypatch, tmp_path, fake_lib, capsys):
    lib = fake_lib[0]
    monkeypatch.setenv("APEX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "check_toolchain", lambda: tmp_path)
    compiled = []

    def fake_compile(name, build_directory, **_):
        compiled.append(name)
        (__import__("pathlib").Path(build_directory) / f"{name}.so").write_bytes(b"")

    monkeypatch.setattr("torch.utils.cpp_extension.load", fake_compile)
    monkeypatch.setattr(loader, "_announced", set())
    first = loader.jit_build(lib)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("apex: compiling the apex_loader_fake kernels (apex_loader_fake)")
    assert str(tmp_path / "cache" / "jit") in err[0] and "minute" in err[0]
    assert err[1].startswith("apex: apex_loader_fake compiled in ")
    assert "compiled from the shipped sources" in first.reason
    again = loader.jit_build(lib)  # cached now: nothing printed
    assert capsys.readouterr().err == "" and "reused the cached build" in again.reason
    assert compiled == ["apex_loader_fake_jit"] * 2


def test_jit_cache_key_depends_on_sources(monkeypatch, tmp_path, fake_lib):
    lib, package = fake_lib
    monkeypatch.setenv("APEX_CACHE_DIR", str(tmp_path / "cache"))
    first, _ = build.jit_dir(lib)
    (package / "csrc" / "kernel.cu").write_text("// changed\n")
    second, _ = build.jit_dir(lib)
    assert first != second
    assert first.parent == tmp_path / "cache" / "jit"


@pytest.mark.gpu
def test_cuda_ops_run_the_compiled_kernels():
    import apex.core

    noop = torch.zeros(1, dtype=torch.int32, device="cuda")
    x = [torch.randn(1000, device="cuda")]
    torch.ops.apex_core.multi_tensor_scale(2048, noop, x, x, 2.0)
    state = apex.core.status("core")
    assert state.loaded
    assert state.has_kernels, f"CUDA ops ran the reference: {state.reason}"


@pytest.mark.gpu
@pytest.mark.slow
def test_jit_tier_compiles_loads_and_runs(tmp_path):
    import subprocess

    code = (
        "import torch\n"
        "from apex.core import loader\n"
        "from apex.core._plugin import KERNELS\n"
        "state = loader.load(KERNELS)\n"
        "print('tier', state.tier)\n"
        "x = [torch.randn(4099, device='cuda')]\n"
        "out = [torch.empty(4099, device='cuda', dtype=torch.float16)]\n"
        "noop = torch.zeros(1, dtype=torch.int32, device='cuda')\n"
        "torch.ops.apex_core.multi_tensor_scale(2048, noop, x, out, 2.0)\n"
        "torch.testing.assert_close(out[0].float(), (x[0] * 2).half().float())\n"
    )
    env = {**__import__("os").environ, "APEX_OPS": "jit", "APEX_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tier jit" in result.stdout
    assert any((tmp_path / "jit").glob("apex_core-*/_C.build.json"))
