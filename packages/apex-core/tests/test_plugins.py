"""Plugin discovery, isolation of a broken plugin, lockstep versions and the ``apex`` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

from apex.core import cli, plugins


@pytest.fixture
def broken_plugin(tmp_path, monkeypatch):
    """A namespace portion apex/brokenthing whose _plugin module fails to import."""
    folder = tmp_path / "apex" / "brokenthing"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / "_plugin.py").write_text("raise ImportError('needs a library that is not installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    monkeypatch.undo()
    plugins.discover(refresh=True)


def test_core_is_discovered_through_its_entry_point():
    record = plugins.get("core")
    assert record.error is None
    assert record.found_by == "entry point"
    assert record.plugin.distribution == "apex-core"
    assert record.version == metadata.version("apex-core")
    assert record.plugin.kernel_library.name == "apex_core"


def test_a_broken_plugin_is_isolated_and_reported(broken_plugin, capsys):
    records = {r.name: r for r in plugins.discover(refresh=True)}
    assert records["brokenthing"].found_by == "namespace scan"
    assert "needs a library that is not installed" in records["brokenthing"].error
    assert records["core"].error is None
    assert cli.report() == 1
    out = capsys.readouterr().out
    assert "BROKEN: ImportError: needs a library that is not installed" in out
    assert "PROBLEM: brokenthing" in out


def test_a_contrib_package_beside_a_top_level_one_of_its_name_gets_a_contrib_prefix(tmp_path, monkeypatch):
    for folder in (tmp_path / "apex" / "widget", tmp_path / "apex" / "contrib" / "widget"):
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text("")
        (folder / "_plugin.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = dict(plugins._scan_namespace())
    assert found["widget"] == "apex.widget._plugin:PLUGIN"
    assert found["contrib_widget"] == "apex.contrib.widget._plugin:PLUGIN"


def test_lockstep_versions_are_checked():
    core = plugins.get("core")
    stray = plugins.PluginRecord("stray", "x:PLUGIN", "entry point", core.plugin, "9.9.9")
    problems = plugins.lockstep_problems([core, stray])
    assert problems == [f"apex-core 9.9.9 does not match apex-core {core.version}"]
    assert plugins.lockstep_problems([core]) == []


def _apex(*args):
    return subprocess.run([sys.executable, "-m", "apex.core", *args], capture_output=True, text=True, timeout=120)


def test_report_json():
    result = _apex("report", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    core = next(p for p in data["plugins"] if p["name"] == "core")
    assert core["tier"] in ("aot", "jit", "reference") and core["reason"]
    assert data["environment"]["torch"]
    assert data["problems"] == []


def test_report_names_the_kernel_switches_set(monkeypatch):
    # The variables apex-core's CUDA headers read at every call (side stream, cuBLASLt epilogues and their
    # tuning): a report says which are set, so a benchmark's report tells it did not run the defaults.
    from apex.core import cli

    for name in cli.KERNEL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert cli.kernel_switches() == "(defaults)"
    monkeypatch.setenv("APEX_SIDE_STREAM", "0")
    monkeypatch.setenv("APEX_CUBLASLT_TUNE", "gelu_aux")
    assert cli.kernel_switches() == "APEX_SIDE_STREAM=0, APEX_CUBLASLT_TUNE=gelu_aux"
    result = subprocess.run(
        [sys.executable, "-m", "apex.core", "report", "--json"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        json.loads(result.stdout)["environment"]["kernel switches"] == "APEX_SIDE_STREAM=0, APEX_CUBLASLT_TUNE=gelu_aux"
    )


def test_report_and_list_text():
    report = _apex("report")
    assert report.returncode == 0 and "apex-core" in report.stdout and "core" in report.stdout
    # every plugin row keeps its columns apart, however long a distribution's name is
    rows = [line.split() for line in report.stdout.splitlines() if line.startswith(tuple(_names()))]
    assert rows and all(len(r) >= 3 and r[2][0].isdigit() for r in rows), report.stdout
    listing = _apex("list")
    assert listing.returncode == 0 and "apex.multi_tensor_apply" in listing.stdout


def test_build_unknown_name():
    result = _apex("build", "no-such-package")
    assert result.returncode == 2 and "no kernel package named no-such-package" in result.stderr


@pytest.mark.parametrize("command", ["report", "list", "build"])
def test_a_bad_apex_ops_is_one_line_and_exit_2(command):
    result = subprocess.run(
        [sys.executable, "-m", "apex.core", command],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "APEX_OPS": "bogus"},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"apex {command}: error: APEX_OPS='bogus' is not one of auto, aot, jit, reference"
    ]


def test_status_names_each_installed_package(monkeypatch):
    import apex.core
    from apex.core import loader

    # Once loaded (by an earlier test of this process, on a GPU) status reports what was loaded: forget it.
    monkeypatch.delitem(loader._loaded, "apex_core", raising=False)
    monkeypatch.setenv("APEX_OPS", "reference")
    state = apex.core.status("core")
    assert (state.name, state.tier, state.reason) == ("apex_core", "reference", "forced by APEX_OPS=reference")
    with pytest.raises(KeyError, match="no apex plugin named 'nonexistent'"):
        apex.core.status("nonexistent")


def test_status_of_a_pure_package_is_none():
    import apex.core

    if not any(r.name == "amp" for r in plugins.discover()):
        pytest.skip("apex-amp is not installed")
    assert apex.core.status("amp") is None


def _names() -> list[str]:
    from apex.core import plugins

    return [f"{r.name} " for r in plugins.discover()]
