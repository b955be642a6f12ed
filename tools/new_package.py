"""Create a new apex package from the template: ``python3 tools/new_package.py NAME [--kernels]``.

NAME is the module under ``apex``; one that starts with ``contrib.`` (or ``contrib/``,
``contrib-``) makes a contrib package. Hyphens and underscores are interchangeable:

    fused_dense         packages/apex-fused-dense, distribution apex-fused-dense, import apex.fused_dense
    contrib.focal_loss  packages/apex-contrib-focal-loss, distribution apex-contrib-focal-loss,
                        import apex.contrib.focal_loss

The ops' namespace is ``apex_`` and the module with underscores (``torch.ops.apex_fused_dense``,
``torch.ops.apex_contrib_focal_loss``); the plugin name is the module's last part (``apex list``
shows ``fused_dense``, ``focal_loss``); the meta-package extra is the distribution name without
``apex-`` (``apex[fused-dense]``, ``apex[contrib-focal-loss]``).

The package gets the shape of the others: a lockstep version and the apex-core dependency, the
``apex.plugins`` entry point, ``_plugin.py``, ``_ops.py`` with one example op defined through
``apex.core.library.op`` (``scale(Tensor x, float alpha) -> Tensor``: schema, check, reference,
fake) and a differentiable public ``scale``, its tests and a benchmark stub. ``--kernels`` makes
a kernel package (setuptools, setup.py, a CUDA kernel of the op in csrc/ registered with
TORCH_LIBRARY_IMPL); without it the package is pure Python (hatchling) and the op's reference
runs on every device. The meta-package gets the extra (and ``contrib`` for contrib packages,
and ``all``), README.md the package-table row. tools/workspace.py and noxfile.py find
packages/* by themselves: ``nox -s "isolated(package='DIST')"`` tests the new package alone.
"""

from __future__ import annotations

import argparse
import keyword
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from string import Template

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workspace import PACKAGES, ROOT, package_dirs, project, provides

META = PACKAGES / "apex"
README = ROOT / "README.md"
LINE_LENGTH = 120  # the workspace's ruff line length, also used for the TOML lists written here


@dataclass(frozen=True)
class Names:
    """Every name of one package, derived from its module under ``apex``."""

    module: str  # "fused_dense", "contrib.focal_loss"
    kernels: bool
    version: str
    description: str

    @property
    def contrib(self) -> bool:
        return self.module.startswith("contrib.")

    @property
    def leaf(self) -> str:
        return self.module.rsplit(".", 1)[-1]

    @property
    def import_path(self) -> str:
        return f"apex.{self.module}"

    @property
    def dist(self) -> str:
        return "apex-" + self.module.replace(".", "-").replace("_", "-")

    @property
    def extra(self) -> str:
        return self.dist.removeprefix("apex-")

    @property
    def plugin(self) -> str:
        # The name apex-core's namespace scan gives the package in a source tree: its folder, or
        # contrib_<folder> for a contrib package beside a top-level one of that name (optimizers).
        if self.contrib and (PACKAGES / f"apex-{self.leaf.replace('_', '-')}").is_dir():
            return f"contrib_{self.leaf}"
        return self.leaf

    @property
    def namespace(self) -> str:
        return "apex_" + self.module.replace(".", "_")

    @property
    def folder(self) -> Path:
        return PACKAGES / self.dist

    @property
    def package_dir(self) -> Path:
        return Path("src", *self.import_path.split("."))

    def substitutions(self) -> dict[str, str]:
        return {
            "module": self.module,
            "leaf": self.leaf,
            "import_path": self.import_path,
            "dist": self.dist,
            "plugin": self.plugin,
            "namespace": self.namespace,
            "version": self.version,
            "description": self.description,
            "folder": f"packages/{self.dist}",
            "package_dir": self.package_dir.as_posix(),
        }


def parse_module(name: str) -> str:
    """The module under ``apex`` that NAME stands for, or SystemExit saying what is wrong."""
    raw = re.sub(r"^apex[./-]", "", name.strip().lower())
    contrib = re.match(r"contrib[./-](.+)$", raw)
    leaf = (contrib.group(1) if contrib else raw).replace("-", "_")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", leaf) or keyword.iskeyword(leaf) or leaf.endswith("_"):
        raise SystemExit(
            f"new_package: {name!r} is not a package name: use lowercase letters, digits and _ or -, "
            "starting with a letter (e.g. fused_dense, contrib.focal_loss)"
        )
    if leaf in ("core", "contrib", "all"):
        raise SystemExit(f"new_package: {leaf!r} is reserved (apex-core, the contrib namespace, the 'all' extra)")
    return f"contrib.{leaf}" if contrib else leaf


def check_free(names: Names) -> None:
    """SystemExit unless no existing package has this folder, distribution, module or plugin name."""
    existing = package_dirs()
    taken = []
    if names.folder.exists():
        taken.append(f"folder {names.folder.relative_to(ROOT)} exists")
    if names.dist in existing:
        taken.append(f"distribution {names.dist} exists ({existing[names.dist].relative_to(ROOT)})")
    for dist, folder in existing.items():
        if names.import_path in provides(folder):
            taken.append(f"{dist} provides {names.import_path}")
        if names.plugin in project(folder).get("entry-points", {}).get("apex.plugins", {}):
            taken.append(f"{dist} has the plugin name {names.plugin!r}")
    if names.extra in meta_extras():
        taken.append(f"the meta-package already has an extra {names.extra!r}")
    if taken:
        raise SystemExit(f"new_package: {names.dist} is taken: " + "; ".join(taken))


# The generated files. ${...} are the names of Names.substitutions(); "$" appears nowhere else.

PYPROJECT_KERNELS = """\
[build-system]
requires = ["setuptools>=69", "wheel"]
build-backend = "setuptools.build_meta"

[project]
name = "${dist}"
version = "${version}"
description = "apex ${module}: ${description}"
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["apex-core==${version}", "torch>=2.6"]

[project.entry-points."apex.plugins"]
${plugin} = "${import_path}._plugin:PLUGIN"

[tool.setuptools.packages.find]
where = ["src"]
include = ["${import_path}*"]
namespaces = true

[tool.setuptools.package-data]
"${import_path}" = ["csrc/*.cu", "csrc/*.cpp", "csrc/*.h", "csrc/*.cuh"]
"""

PYPROJECT_PURE = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "${dist}"
version = "${version}"
description = "apex ${module}: ${description}"
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["apex-core==${version}", "torch>=2.6"]

[project.entry-points."apex.plugins"]
${plugin} = "${import_path}._plugin:PLUGIN"

# Ship ${package_dir} only: apex/__init__.py is apex-core's, and apex/contrib stays a namespace.
[tool.hatch.build.targets.wheel]
only-include = ["${package_dir}"]
sources = ["src"]
# Editable installs put src/ on sys.path (a .pth file), which needs no `editables` package.
dev-mode-dirs = ["src"]

[tool.hatch.build.targets.sdist]
include = ["${package_dir}", "tests", "benchmarks", "README.md", "pyproject.toml"]
"""

SETUP_PY = """\
import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).parent / "src"))

${setup_imports}

setup(**setup_kernel_package(KERNELS))
"""

PLUGIN_KERNELS = """\
from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary.of_package("${module}")
PLUGIN = Plugin.of_package("${module}", kernels=KERNELS)
"""

PLUGIN_PURE = """\
from apex.core.descriptors import KernelLibrary, Plugin

# The namespace of the ops. Without sources there is nothing to compile or load: the references
# run on every device. A kernel package keeps the default csrc/ sources and passes kernels=KERNELS.
KERNELS = KernelLibrary.of_package("${module}", sources=())
PLUGIN = Plugin.of_package("${module}")
"""

INIT_PY = '''\
"""${import_path}: ${description}.

Importing it registers its ops (``torch.ops.${namespace}.*``).
"""

from __future__ import annotations

import torch

from ${import_path} import _ops

__all__ = ["scale"]


def scale(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """Return ``x * alpha``, computed in float32 and rounded once to ``x``'s dtype.

    Args:
        x: a contiguous float32, float16 or bfloat16 tensor, on any device.
        alpha: the factor, a finite Python float.

    Differentiable in ``x``; ``torch.compile(fullgraph=True)`` traces it as the op
    ``torch.ops.${namespace}.scale``.
    """
    return _ops.differentiable_scale(x, alpha)
'''

OPS_PY = '''\
"""${namespace}'s dispatcher ops: schemas, checks, references, fakes, and their callers.

How an op is written: ``apex.core.library``.${kernel_note}
"""

from __future__ import annotations

import math

import torch

${ops_imports}


def _check_scale(a) -> None:
    if a.x.dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"{a.op}: x has dtype {a.x.dtype}; expected one of float32, float16, bfloat16")
    checks.dense(a.op, "x", a.x, a.x.device)
    if not math.isfinite(a.alpha):
        raise ValueError(f"{a.op}: alpha must be finite, got {a.alpha}")


def _scale_fake(a):
    return torch.empty_like(a.x)


@op(KERNELS, "scale(Tensor x, float alpha) -> Tensor", check=_check_scale, fake=_scale_fake)
def scale(a):
    # For 16-bit x torch computes in float32 and rounds once: the contract a CUDA kernel must keep too.
    return a.x * a.alpha


def _scale_setup_context(ctx, inputs, output) -> None:
    ctx.alpha = inputs[1]


def _scale_backward(ctx, grad):
    # Gradients may arrive expanded (the backward of sum()); the op takes contiguous tensors only.
    return scale(grad.contiguous(), ctx.alpha), None


differentiable_scale = autograd(scale, _scale_setup_context, _scale_backward, "Scale")
'''

KERNEL_CU = """\
// scale: out = x * alpha in float32, rounded once to x's dtype. The reference, and the wording of
// the checks below, are in ${import_path}'s _ops.py.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <cstdint>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/launch.cuh>
#include <apex/vectorized.cuh>

#include "cuda_ops.h"

namespace {

constexpr const char* kOp = "scale";
constexpr int kThreads = 256;
// 16-byte loads in flight per thread: a memory-bound kernel needs several to hide the latency.
constexpr int kAccessesInFlight = 4;
// Each block takes a few full steps of its threads. A whole number of 16-byte vectors, so every
// block starts at the alignment of the first and takes the vector path when it does.
template <typename T>
constexpr int64_t kPerBlock = int64_t{kThreads} * apex::vector_width<T>() * kAccessesInFlight * 4;

template <typename T>
__global__ void __launch_bounds__(kThreads) scale_kernel(const T* x, T* out, float alpha, int64_t n) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kPerBlock<T>;
  const int64_t count = n - begin < kPerBlock<T> ? n - begin : kPerBlock<T>;
  const T* block_x = x + begin;
  T* block_out = out + begin;
  apex::for_each_element<apex::vector_width<T>(), kAccessesInFlight>(
      count,
      [&](auto group) {
        using Group = decltype(group);
        float v[Group::kCount][Group::kWidth];
        group.load(v, block_x);
#pragma unroll
        for (int i = 0; i < Group::kCount; ++i) {
#pragma unroll
          for (int j = 0; j < Group::kWidth; ++j) v[i][j] *= alpha;
        }
        group.store(block_out, v);
      },
      block_x, block_out);
}

}  // namespace

namespace ${namespace} {

at::Tensor scale_cuda(const at::Tensor& x, double alpha) {
  namespace checks = apex::checks;
  TORCH_CHECK_TYPE(checks::contains(checks::kFloatDtypes, x.scalar_type()), kOp, ": x has dtype ",
                   checks::torch_dtype(x.scalar_type()), "; expected one of float32, float16, bfloat16");
  checks::dense(kOp, "x", x, x.device());
  TORCH_CHECK_VALUE(std::isfinite(alpha), kOp, ": alpha must be finite, got ", alpha);

  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return out;
  APEX_DISPATCH_FLOAT_TYPES(x.scalar_type(), kOp, "x", scalar_t, {
    const auto blocks = static_cast<unsigned int>(apex::ceil_div(n, kPerBlock<scalar_t>));
    scale_kernel<scalar_t><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), static_cast<float>(alpha), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace ${namespace}
"""

KERNEL_OPS_H = """\
// The CUDA entry points of this package's ops: defined in the .cu files, registered in cuda_ops.cpp
// (README, "An op": why registrations stay out of the .cu files).
#pragma once

#include <ATen/core/Tensor.h>

// scale.cu
namespace ${namespace} {
at::Tensor scale_cuda(const at::Tensor& x, double alpha);
}  // namespace ${namespace}
"""

KERNEL_OPS_CPP = """\
// The CUDA kernels of the ops declared in cuda_ops.h, registered for the CUDA dispatch key.
#include <torch/library.h>

#include "cuda_ops.h"

TORCH_LIBRARY_IMPL(${namespace}, CUDA, m) {
  m.impl("scale", &${namespace}::scale_cuda);
}
"""

TEST_PY = '''\
"""${import_path}'s example op against float64, on the CPU and (marked gpu) on CUDA: values, the
gradient, bad input, opcheck, torch.compile${kernel_tests_note}."""

from __future__ import annotations

import math

import pytest
import torch

${test_imports}

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Empty, one element, odd, not a multiple of any vector width, several blocks of the kernel.
SIZES = [0, 1, 7, 33, 1000, 70_001]
ALPHA = -1.37


def random_tensor(shape, dtype, device, offset=0):
    """Normal values in ``dtype`` (exact in float64); the tensor starts ``offset`` elements into its storage."""
    numel = math.prod(shape)
    storage = torch.randn(numel + offset, dtype=torch.float64).to(dtype=dtype, device=device)
    return storage[offset:].view(shape)


def assert_close_to_float64(actual, expected):
    """Within two units in the last place of ``actual``'s dtype (below its normal range, one step)."""
    info = torch.finfo(actual.dtype)
    torch.testing.assert_close(
        actual.cpu().double(), expected.cpu(), rtol=2 * info.eps, atol=info.smallest_normal * info.eps
    )


def poison_allocator(like):
    """Leave NaNs in a freed block like ``like``: the next allocation of that size likely gets it,
    so output elements the op does not write show up."""
    torch.full_like(like, float("nan"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_scale_matches_float64(device, dtype, size):
    x = random_tensor((size,), dtype, device)
    poison_allocator(x)
    out = _ops.scale(x, ALPHA)
    assert (out.shape, out.dtype, out.device) == (x.shape, x.dtype, x.device)
    assert_close_to_float64(out, x.double() * ALPHA)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_of_shaped_and_unaligned_tensors(device, dtype):
    # An odd 3-d shape, and a tensor one element into its storage (not 16-byte aligned).
    for x in (random_tensor((3, 5, 7), dtype, device), random_tensor((4099,), dtype, device, offset=1)):
        assert_close_to_float64(_ops.scale(x, 0.25), x.double() * 0.25)


def test_gradient(device):
    x = random_tensor((2, 333), torch.float32, device).requires_grad_()
    dy = random_tensor((2, 333), torch.float32, device)
    y = scale(x, ALPHA)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert_close_to_float64(y.detach(), x.detach().double() * ALPHA)
    assert_close_to_float64(dx, dy.double() * ALPHA)


def test_gradient_that_arrives_expanded(device):
    x = random_tensor((3, 4), torch.float16, device).requires_grad_()
    scale(x, ALPHA).sum().backward()
    assert_close_to_float64(x.grad, torch.full(x.shape, ALPHA, dtype=torch.float64))


BAD_INPUT = {  # case: (x on a device, alpha, error, message)
    "float64 x": (lambda d: torch.ones(4, dtype=torch.float64, device=d), 2.0, TypeError, "x has dtype torch.float64"),
    "int x": (lambda d: torch.ones(4, dtype=torch.int32, device=d), 2.0, TypeError, "x has dtype torch.int32"),
    "non-contiguous x": (lambda d: torch.ones(4, 6, device=d).t(), 2.0, ValueError, "x is not contiguous"),
    "infinite alpha": (lambda d: torch.ones(4, device=d), math.inf, ValueError, "alpha must be finite, got inf"),
    "nan alpha": (lambda d: torch.ones(4, device=d), math.nan, ValueError, "alpha must be finite, got nan"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_raises_naming_the_argument(device, case):
    make_x, alpha, error, message = BAD_INPUT[case]
    with pytest.raises(error, match="^scale: " + message):
        _ops.scale(make_x(device), alpha)


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(device, dtype):
    torch.library.opcheck(_ops.scale, (random_tensor((3, 67), dtype, device), ALPHA))


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    def loss(x, w):
        return scale(x * w, ALPHA).square().sum()

    # Inductor on the GPU; on the CPU, AOT autograd without code generation (fast, same tracing).
    compiled = torch.compile(loss, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    x = random_tensor((8, 65), torch.float32, device)
    w = random_tensor((8, 65), torch.float32, device).requires_grad_()
    results = []
    for fn in (loss, compiled):
        value = fn(x, w)
        results.append((value.detach(), *torch.autograd.grad(value, w)))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
${kernel_tests}

@pytest.mark.gpu
def test_runs_on_the_current_stream():
    # Work on another stream than the caller's would race with the side stream's writes to x.
    source = random_tensor((1 << 24,), torch.float16, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = source * 1.0
        out = _ops.scale(x, ALPHA)
    torch.cuda.current_stream().wait_stream(side)
    assert_close_to_float64(out, source.double() * ALPHA)


@pytest.mark.multigpu
def test_second_gpu():
    # cuda:0 is current; x lives on cuda:1.
    x = random_tensor((70_001,), torch.bfloat16, "cuda:1")
    out = _ops.scale(x, ALPHA)
    assert out.device == x.device
    assert_close_to_float64(out, x.double() * ALPHA)
'''

TEST_KERNEL_TESTS = """

@pytest.mark.gpu
def test_cuda_kernel_is_loaded():
    status = loader.load(KERNELS)
    assert status.has_kernels, f"{KERNELS.name}: tier {status.tier} ({status.reason})"


@pytest.mark.gpu
@pytest.mark.slow
def test_more_than_2_pow_31_elements():
    n = (1 << 31) + 5
    x = torch.randn(n, dtype=torch.float16, device="cuda")
    out = _ops.scale(x, ALPHA)
    for part in (slice(0, 70_000), slice(n - 70_000, n)):
        assert_close_to_float64(out[part], x[part].double() * ALPHA)
"""

BENCH_PY = '''\
"""${import_path}.scale against PyTorch's ``x * alpha``, eager and under torch.compile (CUDA only).

    python ${folder}/benchmarks/bench_${leaf}.py [--out DIR] [--samples N]

Per shape and dtype: ours, eager and compiled torch in ms (CUDA events, median of samples, data
cycling through enough copies to outgrow L2), eager / ours, and ours in GB/s (bytes read and
written) and as a fraction of the device copy bandwidth measured in the same run. Bar: ours moves
at least COPY_FRACTION_BAR of the copy bandwidth at every shape.
"""

from __future__ import annotations

import math
import sys

import torch

${bench_imports}

SHAPES = [(8192, 8192), (16384, 8191)]
DTYPES = [torch.bfloat16, torch.float32]
ALPHA = 0.5
COPY_FRACTION_BAR = 0.8
HEADER = ["shape", "dtype", "ours ms", "eager ms", "compiled ms", "eager / ours", "ours GB/s", "% of copy"]


def measure(shape, dtype, samples: int, compiled) -> tuple[list[str], float]:
    """One row of the table, and ours in GB/s."""
    copies = copies_for_l2(2 * math.prod(shape) * dtype.itemsize)
    data = [torch.randn(shape, device="cuda").to(dtype) for _ in range(copies)]
    torch.testing.assert_close(scale(data[0], ALPHA), data[0] * ALPHA)

    def timed(fn):
        return time_ms([lambda x=x: fn(x) for x in data], samples)

    ours = timed(lambda x: scale(x, ALPHA))
    eager = timed(lambda x: x * ALPHA)
    compiled_ms = timed(compiled)
    gbps = gb_per_s(2 * nbytes(data[:1]), ours)  # x read, out written
    row = [f"{ours:.3f}", f"{eager:.3f}", f"{compiled_ms:.3f}", f"{eager / ours:.2f}x", f"{gbps:.0f}"]
    return row, gbps


def main(argv: list[str] | None = None) -> int:
    args = bench_arguments("bench_${leaf}", __doc__).parse_args(argv)
    if not require_cuda("bench_${leaf}"):
        return 1${require_kernels_call}
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps(args.samples)
    compiled = torch.compile(lambda x: x * ALPHA, fullgraph=True)
    rows, verdicts = [], []
    for shape in SHAPES:
        for dtype in DTYPES:
            cells, gbps = measure(shape, dtype, args.samples, compiled)
            case = ["x".join(map(str, shape)), str(dtype).removeprefix("torch.")]
            rows.append([*case, *cells, f"{100 * gbps / copy_gbps:.0f}%"])
            verdicts.append(verdict(f"{' '.join(case)}: share of copy bandwidth", gbps / copy_gbps, COPY_FRACTION_BAR))
    return finish("bench_${leaf}", HEADER, rows, verdicts, out=args.out, copy_gbps=copy_gbps)


if __name__ == "__main__":
    sys.exit(main())
'''

NOTES_MD = """\
# ${dist}: benchmark notes

What was tried on this package's kernels and measured, kept or dropped, with the numbers (device,
date, torch, command), for the next person tuning them. The current figures are in the
repository's BENCHMARKS.md; `benchmarks/bench_${leaf}.py` prints them.
"""

README_MD = """\
# ${dist}

`${import_path}`: ${description}.
Its ops are `torch.ops.${namespace}.*`; ${kernel_sentence} See the repository README.

```python
import torch
import ${import_path}

x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
y = ${import_path}.scale(x, 0.5)  # differentiable; torch.compile traces it as one op
```

Tests: `pytest ${folder}/tests`; benchmark (CUDA): `python ${folder}/benchmarks/bench_${leaf}.py`.
"""


def render(text: str, names: Names, **extra: str) -> str:
    return Template(text).substitute(names.substitutions(), **extra)


def import_block(lines: list[str]) -> str:
    """First-party imports in ruff's isort order: ``import`` lines, then ``from`` lines, each by module."""
    plain = sorted((line for line in lines if line.startswith("import ")), key=lambda line: line.split()[1])
    froms = sorted((line for line in lines if line.startswith("from ")), key=lambda line: line.split()[1])
    return "\n".join(plain + froms)


def package_files(names: Names) -> dict[Path, str]:
    """Relative path -> content of every file of the new package."""
    kernels = names.kernels
    if kernels:
        kernel_note = " The CUDA kernels (``csrc/``) make the same\nchecks with the same words."
        kernel_sentence = "a CUDA kernel serves CUDA tensors, the PyTorch reference everything else."
    else:
        kernel_note = " Pure PyTorch: the references run on every device."
        kernel_sentence = "pure Python, the PyTorch reference runs on every device."
    ops_imports = ["from apex.core import checks", "from apex.core.library import autograd, op"]
    test_imports = [f"from {names.import_path} import _ops, scale"]
    if kernels:
        test_imports += ["from apex.core import loader", f"from {names.import_path}._plugin import KERNELS"]
    test_extra = {
        "test_imports": import_block(test_imports),
        "kernel_tests": render(TEST_KERNEL_TESTS, names) if kernels else "",
        "kernel_tests_note": ", and that CUDA runs the kernel, with 64-bit indexing" if kernels else "",
    }
    benchmarking = ["bench_arguments", "copies_for_l2", "copy_bandwidth_gbps", "finish", "gb_per_s", "nbytes"]
    benchmarking += ["require_cuda", *(["require_kernels"] if kernels else []), "time_ms", "verdict"]
    bench_imports = [
        "from apex.core.benchmarking import (\n" + "".join(f"    {name},\n" for name in benchmarking) + ")",
        f"from {names.import_path} import scale",
    ]
    bench_extra = {
        "bench_imports": import_block(bench_imports),
        "require_kernels_call": f'\n    require_kernels("{names.plugin}")' if kernels else "",
    }
    setup_imports = [
        "from apex.core.build import setup_kernel_package",
        f"from {names.import_path}._plugin import KERNELS",
    ]
    pkg = names.package_dir
    files = {
        Path("README.md"): render(README_MD, names, kernel_sentence=kernel_sentence),
        Path("pyproject.toml"): render(PYPROJECT_KERNELS if kernels else PYPROJECT_PURE, names),
        pkg / "__init__.py": render(INIT_PY, names),
        pkg / "_plugin.py": render(PLUGIN_KERNELS if kernels else PLUGIN_PURE, names),
        pkg / "_ops.py": render(
            OPS_PY,
            names,
            kernel_note=kernel_note,
            ops_imports=import_block([*ops_imports, f"from {names.import_path}._plugin import KERNELS"]),
        ),
        Path("tests") / f"test_{names.leaf}.py": render(TEST_PY, names, **test_extra),
        Path("benchmarks") / f"bench_{names.leaf}.py": render(BENCH_PY, names, **bench_extra),
        Path("benchmarks") / "NOTES.md": render(NOTES_MD, names),
    }
    if kernels:
        files[Path("setup.py")] = render(SETUP_PY, names, setup_imports=import_block(setup_imports))
        files[pkg / "csrc" / "scale.cu"] = render(KERNEL_CU, names)
        files[pkg / "csrc" / "cuda_ops.h"] = render(KERNEL_OPS_H, names)
        files[pkg / "csrc" / "cuda_ops.cpp"] = render(KERNEL_OPS_CPP, names)
    return files


# Registration: the meta-package's extras and README.md's package table.


def meta_extras() -> dict[str, list[str]]:
    return tomllib.loads((META / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})


def _toml_list(key: str, values: list[str]) -> str:
    quoted = [f'"{v}"' for v in values]
    one_line = f"{key} = [{', '.join(quoted)}]"
    if len(one_line) <= LINE_LENGTH:
        return one_line
    return "\n".join([f"{key} = [", *(f'    "{v}",' for v in values), "]"])


def register_extras(names: Names) -> None:
    """Add the package's extra to the meta-package, and the package to ``all`` (and ``contrib``)."""
    path = META / "pyproject.toml"
    text = path.read_text()
    requirement = f"{names.dist}=={names.version}"
    extras = {k: v for k, v in meta_extras().items() if k not in ("contrib", "all")}
    extras[names.extra] = [requirement]
    contrib = list(meta_extras().get("contrib", []))
    if names.contrib:
        contrib.append(requirement)
    if contrib:
        extras["contrib"] = contrib
    extras["all"] = [*meta_extras().get("all", []), requirement]
    lines = text.splitlines()
    header = "[project.optional-dependencies]"
    if header not in lines:
        raise SystemExit(f"new_package: no {header} table in {path}")
    start = lines.index(header)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    blank_before_next = end < len(lines)
    section = [header, *(_toml_list(k, v) for k, v in extras.items()), *([""] if blank_before_next else [])]
    path.write_text("\n".join([*lines[:start], *section, *lines[end:]]) + "\n")


def table_row(names: Names) -> str:
    what = "CUDA kernel" if names.kernels else "pure Python, the reference on every device"
    return (
        f"| `{names.dist}` | `{names.import_path}` | the template's example op `scale` ({what}; "
        f"`torch.ops.{names.namespace}.*`) | new: generated by `tools/new_package.py` |"
    )


def register_readme(names: Names) -> bool:
    """Append the package's row to README.md's package table and list its extra in the meta-package row."""
    lines = README.read_text().splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("| `apex")]
    if not rows:
        return False
    lines.insert(rows[-1] + 1, table_row(names))
    extras = ", ".join(f"`{extra}`" for extra in meta_extras())
    for i in rows:
        if lines[i].startswith("| `apex` |"):
            lines[i] = re.sub(r"extras: [^|]*?(?= \|)", lambda _: f"extras: {extras}", lines[i])
    README.write_text("\n".join(lines) + "\n")
    return True


def create(names: Names) -> list[Path]:
    check_free(names)
    written = []
    for relative, content in package_files(names).items():
        path = names.folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        written.append(path)
    register_extras(names)
    written.append(META / "pyproject.toml")
    if register_readme(names):
        written.append(README)
    else:
        print(f"new_package: README.md has no package table; add a row for {names.dist} by hand", file=sys.stderr)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/new_package.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("name", metavar="NAME", help="e.g. fused_dense, or contrib.focal_loss for a contrib package")
    parser.add_argument("--kernels", action="store_true", help="a kernel package: setup.py and a CUDA kernel in csrc/")
    parser.add_argument("--description", help="one line for pyproject.toml and the package's README")
    args = parser.parse_args(argv)
    module = parse_module(args.name)
    description = (args.description or "an example op, scale, from tools/new_package.py (replace it)").rstrip(".")
    if re.search(r'["\\\n]', description):
        raise SystemExit("new_package: the description is one line without quotes or backslashes")
    names = Names(
        module=module,
        kernels=args.kernels,
        version=project(PACKAGES / "apex-core")["version"],
        description=description,
    )
    for path in create(names):
        print(f"wrote {path.relative_to(ROOT)}")
    print(
        f"\n{names.dist} ({'kernel' if names.kernels else 'pure'} package, import {names.import_path}, "
        f"ops torch.ops.{names.namespace}.*, plugin {names.plugin!r}, extra apex[{names.extra}]).\n"
        f"Next: pip install --no-deps --no-build-isolation -e {names.folder.relative_to(ROOT)}, then\n"
        f"  pytest {names.folder.relative_to(ROOT)}/tests   and   nox -s \"isolated(package='{names.dist}')\""
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
