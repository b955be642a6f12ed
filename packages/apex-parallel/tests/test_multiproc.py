"""The ``python -m apex.parallel.multiproc`` launcher: environment, --pass-rank, logs, failure handling."""

from __future__ import annotations

import subprocess
import sys
import time

SCRIPT = """
import os, sys
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
print(" ".join(f"{k}={os.environ[k]}" for k in keys), "ARGS=" + ",".join(sys.argv[1:]))
if os.environ["RANK"] == "1" and "--fail" in sys.argv:
    sys.exit(7)
if "--fail" in sys.argv:
    import time
    time.sleep(120)  # rank 0 would hang; the launcher must stop it
"""


def launch(tmp_path, *args, timeout=60):
    script = tmp_path / "show_env.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "apex.parallel.multiproc", "--log-dir", str(tmp_path), *args, str(script)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def test_sets_the_environment_of_each_rank(tmp_path):
    done = launch(tmp_path, "--nproc", "3", "--master-port", "29555")
    assert done.returncode == 0, done.stderr
    rank0 = done.stdout.strip()
    assert rank0.startswith(
        "RANK=0 LOCAL_RANK=0 WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555"
    )
    for rank in (1, 2):
        log = (tmp_path / f"GPU_{rank}.log").read_text()
        assert log.startswith(f"RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=3"), log


def test_pass_rank_appends_or_replaces_arguments(tmp_path):
    script = tmp_path / "show_env.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "apex.parallel.multiproc", "--nproc", "2", "--pass-rank", "--log-dir", str(tmp_path)]
    done = subprocess.run([*cmd, str(script), "--lr", "1", "--rank", "9"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "ARGS=--lr,1,--rank,0,--world-size,2" in done.stdout
    assert "ARGS=--lr,1,--rank,1,--world-size,2" in (tmp_path / "GPU_1.log").read_text()


def test_a_failing_rank_stops_the_others(tmp_path):
    start = time.monotonic()
    script = tmp_path / "show_env.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "apex.parallel.multiproc", "--nproc", "2", "--log-dir", str(tmp_path)]
    done = subprocess.run([*cmd, str(script), "--fail"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 7, (done.stdout, done.stderr)
    assert "rank(s) [1] failed" in done.stderr
    assert time.monotonic() - start < 30
