"""The kernels' tuning switches give the results the defaults give.

The switches are environment variables that the compiled library reads once per process (see
benchmarks/sweep_norms.sh), so each one runs the CUDA cases of the numerics and determinism
tests in a child pytest with the switch set. The switches exist to compare kernel variants in
benchmarks; a variant that gives wrong gradients must fail here before it is timed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SWITCHES = {
    "prefetch-off": "APEX_NORM_PREFETCH=0",
    "prefetch-always": "APEX_NORM_PREFETCH=2",
    "forward-small-off": "APEX_NORM_FWD_SMALL=0",
    "forward-hold-never": "APEX_NORM_FWD_HOLD=0",
    "forward-hold-always": "APEX_NORM_FWD_HOLD=2",
    "backward-prefetch-off": "APEX_NORM_BWD_PREFETCH=0",
    "backward-long-row-kernel": "APEX_NORM_BWD_VECS=4",
    "backward-short-row-kernel": "APEX_NORM_BWD_VECS=2",
    "backward-second-kernel-sums": "APEX_NORM_BWD_FINISH=0",
    "backward-whole-rows-off": "APEX_NORM_BWD_WHOLE=0",
}
CHILD_TESTS = [
    (HERE / "test_norm_numerics.py", "cuda and (test_layer_norm or test_rms_norm or test_many_rows)"),
    (HERE / "test_norm_ops.py", "deterministic or every_output_element"),
]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("switch", list(SWITCHES.values()), ids=list(SWITCHES))
def test_results_under_switch(switch):
    name, value = switch.split("=")
    env = dict(os.environ, **{name: value})
    root = HERE.parents[2]
    for path, selection in CHILD_TESTS:
        command = [sys.executable, "-m", "pytest", str(path), "-q", "-x", "-p", "no:cacheprovider", "-k", selection]
        result = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"{switch}: {path.name}\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
        assert " passed" in result.stdout, result.stdout[-2000:]
