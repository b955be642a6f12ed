"""What an installed apex looks like: one namespace, our own apex-core, nothing shadowing it."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import apex
import apex.core

OWNER = "apex-core"  # the one distribution that ships apex/__init__.py (the lazy attribute access)


def test_apex_is_one_namespace_owned_by_apex_core():
    """apex/__init__.py is apex-core's (pkgutil-style: every folder holding an apex/ portion is on
    apex.__path__); no other folder of apex.__path__ has an __init__.py of its own."""
    init = Path(apex.__file__).resolve()
    assert init == Path(apex.core.__file__).resolve().parents[1] / "__init__.py"
    others = [Path(p) for p in apex.__path__ if Path(p).is_dir() and Path(p).resolve() != init.parent]
    assert not any((p / "__init__.py").exists() for p in others)


def test_import_apex_then_attributes_as_upstream():
    """Code written for upstream Apex: ``import apex`` alone, then ``apex.<package>.<name>``, with
    nothing imported (torch included) until an attribute is used."""
    code = """
import sys
import apex
assert "torch" not in sys.modules, "import apex imported torch"
assert not [m for m in sys.modules if m.startswith("apex.")], "import apex imported a package"
installed = {d.metadata["Name"] for d in __import__("importlib.metadata").metadata.distributions()}
wanted = {
    "apex-optimizers": ["apex.optimizers.FusedAdam", "apex.optimizers.FusedLAMB"],
    "apex-parallel": ["apex.parallel.SyncBatchNorm", "apex.parallel.convert_syncbn_model", "apex.parallel.LARC"],
    "apex-amp": ["apex.amp.initialize", "apex.amp.scale_loss", "apex.fp16_utils.FP16Model"],
    "apex-normalization": ["apex.normalization.FusedLayerNorm", "apex.normalization.FusedRMSNorm"],
    "apex-core": ["apex.multi_tensor_apply.multi_tensor_applier", "apex.core.status"],
}
for dist, names in wanted.items():
    if dist in installed:
        for name in names:
            assert eval(name) is not None, name
            assert hasattr(apex, name.split(".")[1]), name
if "apex-optimizers" in installed:
    import apex.optimizers
    assert isinstance(apex.optimizers.FusedAdam, type)
assert not hasattr(apex, "no_such_package")
try:
    apex.no_such_package
except AttributeError as exc:
    assert "no installed apex package provides it" in str(exc), exc
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr


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


def test_only_apex_core_ships_the_namespace_init():
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "apex" or name.startswith("apex-"):
            files = {str(f) for f in dist.files or []}
            if name != OWNER:
                assert "apex/__init__.py" not in files, name
            assert "apex/contrib/__init__.py" not in files, name


def test_upstreams_helpers_for_contrib_modules(monkeypatch):
    """``apex.deprecated_warning``, ``apex.DeprecatedFeatureWarning`` and
    ``apex.check_cudnn_version_and_warn``, as upstream's apex/__init__.py has them."""
    import pytest
    import torch

    assert issubclass(apex.DeprecatedFeatureWarning, FutureWarning)
    with pytest.warns(apex.DeprecatedFeatureWarning, match="use torch.cuda.gds"):
        apex.deprecated_warning("use torch.cuda.gds")
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 8300)
    with pytest.warns(UserWarning, match="needs_cudnn requires cuDNN 8400 or later, found 8300"):
        assert apex.check_cudnn_version_and_warn("needs_cudnn", 8400) is False
    assert apex.check_cudnn_version_and_warn("needs_cudnn", 8300) is True
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    with pytest.warns(UserWarning, match="requires cuDNN, which is not available"):
        assert apex.check_cudnn_version_and_warn("needs_cudnn", 8400) is False
