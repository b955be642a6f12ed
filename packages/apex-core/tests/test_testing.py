"""apex.core.testing.run_ranks: real gloo process groups, failures reported with their tracebacks, and
only a process group that did not come up (gloo's transient TCP errors) started again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.multiprocessing as mp

from apex.core.testing import RankFailed, _rank_context, _transient_start, once_per_run, run_ranks, wheel_files

RANKS = str(Path(__file__).with_name("_ranks_testing.py"))


def test_values_come_back_in_rank_order():
    assert run_ranks(RANKS, "summed", 2, args=(10.0,), timeout=120) == [21.0, 21.0]


def test_a_failure_in_the_function_is_reported_not_retried(capfd):
    with pytest.raises(RankFailed, match="rank one refuses"):
        run_ranks(RANKS, "raises_on_one", 2, timeout=120)
    assert "retrying" not in capfd.readouterr().err


def test_ranks_see_the_environment_of_the_call_and_start_clean(monkeypatch):
    """The ranks fork from a server started at the first call: they still see the caller's environment
    as it is at each call, and nothing an earlier call's ranks did."""
    run_ranks(RANKS, "mark_ran", 2, timeout=120)  # starts the server (if this test runs first)
    monkeypatch.setenv("APEX_TEST_RANKS_VALUE", "set after the first call")
    monkeypatch.delenv("PATH")  # the server started with one
    names = ["APEX_TEST_RANKS_VALUE", "PATH", "RANK", "WORLD_SIZE"]
    for environment, ran in run_ranks(RANKS, "environment", 2, args=(names,), timeout=120):
        assert environment["APEX_TEST_RANKS_VALUE"] == "set after the first call"
        assert environment["PATH"] is None
        assert environment["WORLD_SIZE"] == "2"
        assert not ran


def test_gloo_ranks_fork_from_a_server_and_nccl_ranks_spawn():
    forked = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    assert _rank_context("gloo").get_start_method() == forked
    assert _rank_context("nccl").get_start_method() == "spawn"  # a forked child may not reach CUDA


MESH = "RuntimeError: Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer [127.0.0.1]:23171"


@pytest.mark.parametrize(
    ("failures", "phases", "expected"),
    [
        ({0: MESH}, {0: "init"}, True),
        ({0: MESH, 1: MESH}, {0: "init", 1: "init"}, True),
        # a rank killed without reporting does not make a start transient or not
        ({0: MESH, 1: "rank 1 exited with code -9 without reporting"}, {0: "init"}, True),
        ({0: MESH}, {0: "run"}, False),  # the group was up: the test's own failure
        ({0: MESH, 1: "ValueError: x"}, {0: "init", 1: "run"}, False),
        ({0: "RuntimeError: Address already in use"}, {0: "init"}, False),
        ({0: "rank 0 exited with code 1 without reporting"}, {}, False),
        ({}, {}, False),
    ],
)
def test_only_a_transient_start_is_retried(failures, phases, expected):
    assert _transient_start(failures, phases) is expected


def test_wheel_files_skips_naming_a_missing_build_backend(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text('[build-system]\nbuild-backend = "no_such_backend_xyz.build"\n')
    with pytest.raises(pytest.skip.Exception, match=r"'no_such_backend_xyz\.build' is not installed"):
        wheel_files(project, tmp_path / "out")


class _Factory:
    def __init__(self, base):
        self.base = base

    def getbasetemp(self):
        return self.base


def test_once_per_run_shares_one_result_among_xdist_workers(tmp_path, monkeypatch):
    calls = []

    def compute():
        calls.append(1)
        return {"value": len(calls)}

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert [once_per_run("t", _Factory(tmp_path / "x"), compute)["value"] for _ in range(2)] == [1, 2]
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    (tmp_path / "run" / "popen-gw0").mkdir(parents=True)
    (tmp_path / "run" / "popen-gw1").mkdir()
    got = [once_per_run("t", _Factory(tmp_path / "run" / f"popen-gw{i}"), compute)["value"] for i in (0, 1, 0)]
    assert got == [3, 3, 3] and len(calls) == 3
