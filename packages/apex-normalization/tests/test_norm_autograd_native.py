"""The C++ autograd of the forward ops (csrc/norm_autograd.cpp) gives what the Python one gives.

On CUDA that file registers the AutogradCUDA kernels, which the GPU tests exercise. Here it is
compiled alone for AutogradCPU (APEX_NORM_AUTOGRAD_KEY) and loaded into a child pytest that runs
the CPU cases of the numerics and op tests, where the op computes the PyTorch reference: the
saved tensors, the needs_input_grad logic and the arguments of norm_backward are then checked
against float64 references, opcheck and torch.compile on any machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "src" / "apex" / "normalization" / "csrc" / "norm_autograd.cpp"
RUNNER = "import sys, torch\ntorch.ops.load_library(sys.argv[1])\nimport pytest\nsys.exit(pytest.main(sys.argv[2:]))\n"
CHECK = (
    "import sys, torch\n"
    "torch.ops.load_library(sys.argv[1])\n"
    "from apex.normalization.functional import fused_add_rms_norm_affine, fused_layer_norm_affine\n"
    "x = torch.randn(3, 8, requires_grad=True)\n"
    "w = torch.randn(8, requires_grad=True)\n"
    "y = fused_layer_norm_affine(x, w, torch.randn(8), 8)\n"
    "y2, s = fused_add_rms_norm_affine(x, torch.randn(3, 8), w, 8)\n"
    "print('|'.join([y.grad_fn.name(), y2.grad_fn.name(), s.grad_fn.name()]))\n"
)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    from torch.utils import cpp_extension

    build = tmp_path_factory.mktemp("norm_autograd_cpu")
    cpp_extension.load(
        name="apex_norm_autograd_cpu",
        sources=[str(SOURCE)],
        extra_cflags=["-O1", "-DAPEX_NORM_AUTOGRAD_KEY=AutogradCPU"],
        build_directory=str(build),
        is_python_module=False,
    )
    return str(build / "apex_norm_autograd_cpu.so")


def run(args, **kwargs):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=HERE.parents[2], capture_output=True, text=True, timeout=1200, **kwargs
    )


@pytest.mark.slow
def test_cpp_autograd_is_what_the_functions_use(library):
    result = run(["-c", CHECK, library])
    assert result.returncode == 0, result.stderr[-3000:]
    names = result.stdout.strip().split("|")
    assert len(names) == 3 and all("CppNode" in n for n in names), names
    assert "::NormForward" in names[0] and "AddNormForward" in names[1] and "AddNormForward" in names[2], names


@pytest.mark.slow
def test_cpp_autograd_numerics_and_ops(library):
    selection = "cpu and not test_many_rows"
    tests = [str(HERE / "test_norm_numerics.py"), str(HERE / "test_norm_ops.py"), str(HERE / "test_norm_modules.py")]
    result = run(["-c", RUNNER, library, *tests, "-q", "-x", "-p", "no:cacheprovider", "-k", selection])
    assert result.returncode == 0, f"{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
    assert " passed" in result.stdout and " failed" not in result.stdout, result.stdout[-2000:]
