"""The ``apex`` command (also ``python -m apex.core``): report, list, build."""

from __future__ import annotations

import argparse
import json
import os
import sys

from apex.core import plugins
from apex.core._version import __version__

# The environment variables that change which kernels or epilogues run (apex-core's CUDA headers read them at
# every call): a report names those set, so a benchmark's report says when it did not run the defaults.
KERNEL_SWITCHES = ("APEX_SIDE_STREAM", "APEX_CUBLASLT_ENABLE", "APEX_CUBLASLT_DISABLE", "APEX_CUBLASLT_TUNE")


def kernel_switches() -> str:
    """``NAME=value`` of each kernel switch set in the environment, or ``(defaults)``."""
    set_ = [f"{name}={os.environ[name]}" for name in KERNEL_SWITCHES if name in os.environ]
    return ", ".join(set_) or "(defaults)"


def _environment() -> dict:
    import torch

    from apex.core import build

    env = {
        "apex-core": __version__,
        "torch": torch.__version__,
        "torch CUDA": torch.version.cuda or "none (CPU build)",
        "python": sys.version.split()[0],
        "APEX_OPS": os.environ.get("APEX_OPS", "auto"),
        "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "(unset)"),
        "kernel switches": kernel_switches(),
    }
    if torch.cuda.is_available():
        env["GPUs"] = ", ".join(
            f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
            for i in range(torch.cuda.device_count())
        )
    else:
        env["GPUs"] = "none visible"
    try:
        env["CUDA_HOME"] = str(build.find_cuda_home())
    except build.BuildUnavailable as exc:
        env["CUDA_HOME"] = f"not found ({exc})"
    from torch.utils.cpp_extension import is_ninja_available

    env["ninja"] = "yes" if is_ninja_available() else "no"
    return env


def report(as_json: bool = False, file=None) -> int:
    """Print every plugin with its version, kernel tier and why; return 1 on a broken or out-of-step plugin."""
    file = file or sys.stdout
    records = plugins.discover()
    rows = []
    for record in records:
        row = {
            "name": record.name,
            "distribution": record.plugin.distribution if record.plugin else None,
            "version": record.version,
            "found_by": record.found_by,
            "error": record.error,
        }
        state = plugins.kernel_status(record)
        if state is not None:
            row.update(
                library=state.name,
                tier=state.tier,
                reason=state.reason,
                built_for={k: state.build_info.get(k) for k in ("torch", "cuda", "python", "arch_list")}
                if state.build_info
                else None,
            )
        else:
            row.update(library=None, tier="pure python", reason="no kernels")
        rows.append(row)
    problems = plugins.lockstep_problems(records) + [f"{r.name}: {r.error}" for r in records if r.error]
    if as_json:
        json.dump({"environment": _environment(), "plugins": rows, "problems": problems}, file, indent=2)
        print(file=file)
        return 1 if problems else 0
    print("apex report", file=file)
    print("-" * 72, file=file)
    for key, value in _environment().items():
        print(f"{key:<22}{value}", file=file)
    print("-" * 72, file=file)
    # columns as wide as their longest entry plus two spaces (at least the old fixed widths)
    name_w = max([18] + [len(row["name"]) for row in rows]) + 2
    dist_w = max([28] + [len(row["distribution"] or "?") for row in rows]) + 2
    for row in rows:
        head = f"{row['name']:<{name_w}}{row['distribution'] or '?':<{dist_w}}{row['version']:<12}"
        if row["error"]:
            print(f"{head}BROKEN: {row['error']}", file=file)
            continue
        print(f"{head}{row['tier']:<12}{row['reason']}", file=file)
        if row.get("built_for"):
            built = ", ".join(f"{k} {v}" for k, v in row["built_for"].items())
            print(f"{'':<{name_w + dist_w + 12}}built for {built}", file=file)
    for problem in problems:
        print(f"PROBLEM: {problem}", file=file)
    return 1 if problems else 0


def list_plugins(file=None) -> int:
    file = file or sys.stdout
    for record in plugins.discover():
        provides = ", ".join(record.plugin.provides) if record.plugin else f"BROKEN: {record.error}"
        print(f"{record.name:<20}{record.version:<12}{provides}", file=file)
    return 0


def build_kernels(names: list[str], verbose: bool) -> int:
    """Compile the JIT kernels of the named plugins (all when none named) into the cache."""
    import time

    from apex.core import build, loader

    selected = plugins.kernel_libraries()
    if names:
        unknown = set(names) - {record.name for record, _ in selected}
        if unknown:
            print(f"apex build: no kernel package named {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        selected = [(r, lib) for r, lib in selected if r.name in names]
    failed = 0
    for i, (record, lib) in enumerate(selected, 1):
        print(f"[{i}/{len(selected)}] {record.name}: building {lib.name} ...", flush=True)
        start = time.monotonic()
        try:
            plugins.import_ops(record)
            result = loader.jit_build(lib, verbose=verbose)
            print(f"[{i}/{len(selected)}] {record.name}: done in {time.monotonic() - start:.0f} s ({result.reason})")
        except (build.BuildUnavailable, OSError, RuntimeError) as exc:
            failed += 1
            print(f"[{i}/{len(selected)}] {record.name}: FAILED to build {lib.name}: {exc}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="apex", description="apex: mixed-precision and distributed training kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    report_parser = sub.add_parser("report", help="versions, kernel tier of each package and why")
    report_parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("list", help="installed apex packages")
    build_parser = sub.add_parser("build", help="compile the JIT kernels ahead of time")
    build_parser.add_argument("names", nargs="*", help="plugin names (default: all)")
    build_parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    from apex.core import loader

    try:
        loader.requested_tier()
    except loader.KernelLoadError as exc:  # a bad environment is a usage error, as a bad argument is
        print(f"apex {args.command}: error: {exc}", file=sys.stderr)
        return 2
    if args.command == "report":
        return report(as_json=args.json)
    if args.command == "list":
        return list_plugins()
    return build_kernels(args.names, args.verbose)
