"""Running a function on several ranks of a real ``torch.distributed`` process group, for tests.

``run_ranks(path, function, world_size, backend="gloo", args=(), timeout=120)`` starts
``world_size`` processes, each of which initializes the default process
group (rendezvous through a file in a fresh temporary folder: no port to pick, so no race for
one), loads the file at ``path`` as a module and calls ``function(rank, world_size, *args)``.
It returns the ranks' return values in rank order (they must pickle; tensors come back by
value), or raises ``RankFailed`` with the traceback of every rank that failed, or
``RankTimeout`` naming the ranks that had not finished after ``timeout`` seconds (the
processes are killed: a hung collective ends the test instead of the session). Gloo's TCP mesh
sometimes fails to connect on a loaded machine ("Connection closed by peer" from
``connectFullMesh``, before any rank has run the function); such a start is retried up to twice
with a fresh rendezvous. A failure after the process group is up is never retried.

gloo ranks are forked from a forkserver that imported torch once per test process (where the
platform has one; nccl ranks, and every rank elsewhere, are fresh interpreters: spawn). Like a
spawned rank, each starts from a process that never ran a test and gets the caller's environment
as it is at the call, but it does not import torch again (a four-rank call on the two-core CI
machine: 8 s with spawn, 0.5 s forked).

Worker functions live in the test file itself: test modules are imported under names that a
child process cannot import, so the child loads the file by path instead. With ``backend
="nccl"`` rank r uses ``cuda:r``.

``with_and_without_side_stream(monkeypatch, compute)`` runs a CUDA op's test under both settings of
``APEX_SIDE_STREAM``, for the ops whose backward uses apex/side_stream.h.

``assert_first_use_in_graph_capture(imports, layers, ...)`` checks, in a fresh Python process, that
CUDA modules whose ops are first used inside a CUDA graph capture (heuristic caches, the side
stream) capture, and that the replay gives the eager result.

``wheel_files(project, out)`` builds a package's wheel into ``out`` (no dependencies, no build
isolation) and returns the names of its files; the test skips, naming the module, where the package's
build backend is not installed (the GPU machine has no hatchling unless its wheel is carried there).

``once_per_run(name, tmp_path_factory, compute)`` returns ``compute()``, computed once per pytest run
and shared (pickled, under a file lock) by the run's pytest-xdist workers: for a module-scoped fixture
that starts ranks for a whole suite, which every worker drawing one of the module's tests would
otherwise run again.

``load_example(name, start)`` loads ``examples/<name>.py`` of the source checkout that holds
``start`` (a test file's path), for tests of what the demo picks; None outside a checkout.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import pickle
import queue as queue_module
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


class RankFailed(AssertionError):
    """One or more ranks raised; the message holds each one's traceback."""


class RankTimeout(AssertionError):
    """Ranks did not finish within the timeout (a hang, or a rank waiting for a dead peer)."""


def graph_reaches(node, name: str, depth: int = 8) -> bool:
    """Whether an autograd node whose name contains ``name`` is among the first ``depth`` levels of the
    graph behind ``node`` (a ``grad_fn``): which path a module took, e.g. torch's batch norm or our op."""
    if node is None or depth == 0:
        return False
    return name in node.name() or any(graph_reaches(n, name, depth - 1) for n, _ in node.next_functions)


def with_and_without_side_stream(monkeypatch, compute) -> dict[str, list[torch.Tensor]]:
    """``compute()`` (returning tensors) with ``APEX_SIDE_STREAM=1`` and then ``0`` (apex-core's
    apex/side_stream.h), each time on a fresh caller stream whose allocations right after the call reuse
    what the op freed (its temporaries must not be handed out while the side stream still reads them):
    ``{"1": clones, "0": clones}``, for tests that the two settings agree bitwise."""
    caller = torch.cuda.Stream()
    results = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("APEX_SIDE_STREAM", setting)
        caller.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(caller):
            got = list(compute())
            scribbles = [torch.full_like(t, 3.0) for t in got for _ in range(4)]
        torch.cuda.current_stream().wait_stream(caller)
        results[setting] = [t.clone() for t in got]
        del scribbles
    return results


_CAPTURE_CHILD = """
import torch
{imports}
torch.manual_seed(0)
warm = torch.randn(8, 8, device="cuda", requires_grad=True)
(warm @ warm).sum().backward()
torch.cuda.synchronize()
for layer in [{layers}]:
    layer = layer.cuda()
    x = torch.randn({rows}, {in_features}, device="cuda", requires_grad=True)
    dy = torch.randn({rows}, {out_features}, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
        grads = torch.autograd.grad(out, [x, *{wrt}], dy)
    graph.replay()
    torch.cuda.synchronize()
    x2 = x.detach().clone().requires_grad_()
    eager = layer(x2)
    eager_grads = torch.autograd.grad(eager, [x2, *{wrt}], dy)
    torch.testing.assert_close(out, eager)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e)
print("OK")
"""


def assert_first_use_in_graph_capture(
    imports: str,
    layers: str,
    in_features: int,
    out_features: int,
    rows: int = 40,
    parameter_grads: bool = True,
    timeout: float = 300,
) -> None:
    """In a fresh Python process (in this one an earlier test may have met the shapes and made the side
    stream): each module of ``layers`` (the source of a comma-separated list of modules mapping
    ``in_features`` to ``out_features``, after ``imports``) runs its forward and its gradients (the
    input's, and every parameter's unless ``parameter_grads`` is False) first inside a CUDA graph
    capture, so the shapes' cuBLASLt heuristic is asked there and so is apex/side_stream.h's side
    stream (not created inside a capture: that call runs its side work inline). The capture must
    succeed and the replay give the eager result of the same module afterwards (which takes the side
    stream). Before the capture, a plain torch GEMM's forward and backward create the cuBLAS handles
    of this thread and of autograd's device thread, as PyTorch requires of any capture with a GEMM
    (cublasCreate fails inside one: CUBLAS_STATUS_NOT_INITIALIZED, torch.mm's as well as ours)."""
    code = _CAPTURE_CHILD.format(
        imports=imports,
        layers=layers,
        rows=rows,
        in_features=in_features,
        out_features=out_features,
        wrt="layer.parameters()" if parameter_grads else "()",
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr


def _load(path: str):
    name = "_apex_rank_module_" + Path(path).stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_example(name: str, start: str | Path):
    """The module ``examples/<name>.py`` of the source checkout holding ``start`` (a test file),
    loaded under a private name; None when no folder above ``start`` has it (an installed copy)."""
    for folder in Path(start).resolve().parents:
        path = folder / "examples" / f"{name}.py"
        if path.is_file():
            return _load(str(path))
    return None


def once_per_run(name: str, tmp_path_factory, compute):
    """``compute()``, once for all the xdist workers of this run (each worker alone without xdist)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return compute()
    from filelock import FileLock  # a dependency of torch

    # A worker's base temporary folder is <the run's>/popen-gwN: the parent is this run's alone.
    path = tmp_path_factory.getbasetemp().parent / f"apex-once-{name}.pickle"
    with FileLock(f"{path}.lock"):
        if path.is_file():
            return pickle.loads(path.read_bytes())
        value = compute()
        path.write_bytes(pickle.dumps(value))
        return value


def wheel_files(project: str | Path, out: str | Path) -> list[str]:
    """The file names in the wheel of the package at ``project`` (built into ``out``)."""
    import re
    import zipfile

    import pytest

    # The [build-system] table's backend (a regular expression: tomllib is Python 3.11's, and 3.10 is supported).
    backend = re.search(r'^build-backend\s*=\s*"([^"]+)"', (Path(project) / "pyproject.toml").read_text(), re.M)[1]
    if importlib.util.find_spec(backend.split(".")[0]) is None:
        pytest.skip(f"the build backend {backend!r} is not installed")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
    subprocess.run([*pip_wheel, str(project)], check=True)
    (wheel,) = Path(out).glob("*.whl")
    return zipfile.ZipFile(wheel).namelist()


def _child(rank, world_size, backend, store_file, path, function, args, results, collective_timeout, env) -> None:
    # The caller's environment at the call (a forkserver's children inherit the server's, from its start).
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    phase = "init"
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        kwargs = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
        torch.distributed.init_process_group(
            backend,
            init_method=Path(store_file).as_uri(),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout),
            **kwargs,
        )
        phase = "run"
        try:
            value = getattr(_load(path), function)(rank, world_size, *args)
            # Every rank leaves together. Best effort: a group that a test broke on purpose (a
            # stalled or dead peer) fails the barrier, and the value stands.
            try:
                torch.distributed.barrier()
            except Exception:
                pass
        finally:
            # A gloo group is left to the process's exit: on torch 2.6 a rank's
            # destroy_process_group could wait forever once its peer had destroyed its own and gone.
            if backend == "nccl":
                torch.distributed.destroy_process_group()
        # Plain pickle: tensors travel by value. (The queue's own pickler would pass them as
        # shared-memory handles, which die with this process.)
        results.put((rank, True, "run", pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, phase, traceback.format_exc()))


# What gloo says when its TCP mesh does not come up: a transient of the machine, not of the test.
_TRANSIENT_START = ("connectFullMesh", "Connection closed by peer", "Connection reset by peer")


def _transient_start(failures: dict, phases: dict) -> bool:
    """Whether every failure is a rank that could not join the group for a transient reason."""
    reported = [r for r in failures if r in phases]
    return bool(reported) and all(
        phases[r] == "init" and any(m in failures[r] for m in _TRANSIENT_START) for r in reported
    )


def run_ranks(
    path: str | os.PathLike,
    function: str,
    world_size: int,
    backend: str = "gloo",
    args: tuple = (),
    timeout: float = 120.0,
    collective_timeout: float | None = None,
) -> list:
    """Run ``function(rank, world_size, *args)`` from the file ``path`` on ``world_size`` ranks."""
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"run_ranks: backend nccl needs {world_size} GPUs, found {torch.cuda.device_count()}")
    collective_timeout = collective_timeout if collective_timeout is not None else timeout
    for attempt in range(3):
        values, failures, phases = _run_once(path, function, world_size, backend, args, timeout, collective_timeout)
        if not (failures and _transient_start(failures, phases)) or attempt == 2:
            break
        print(f"run_ranks: the process group did not come up (attempt {attempt + 1}); retrying", file=sys.stderr)
    if failures:
        raise RankFailed("\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures)))
    missing = [r for r in range(world_size) if r not in values]
    if missing:
        raise RankTimeout(f"ranks {missing} did not finish within {timeout:.0f} s")
    return [values[r] for r in range(world_size)]


def _rank_context(backend: str):
    """The multiprocessing context of the ranks: for gloo a forkserver with torch imported, else spawn.

    nccl ranks (GPU machines, where a start costs little beside the test) keep spawn: a process whose
    CUDA driver is initialized cannot fork children that use CUDA, and whether importing torch
    initializes it is torch's business. The one GPU run with every rank forked (session 42, an H100:
    apex-parallel's, peer-memory's and nccl-allocator's tests) had one failure and timed out before
    naming it, so whether forking was the cause is not known."""
    if backend != "gloo" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    # Only before the server's first start; later calls reuse the server.
    context.set_forkserver_preload(["torch", "torch.distributed"])
    return context


def _run_once(path, function, world_size, backend, args, timeout, collective_timeout):
    context = _rank_context(backend)
    results = context.Queue()
    rendezvous = tempfile.mkdtemp(prefix="apex-ranks-")
    procs = [
        context.Process(
            target=_child,
            args=(
                rank,
                world_size,
                backend,
                os.path.join(rendezvous, "store"),
                str(path),
                function,
                args,
                results,
                collective_timeout,
                dict(os.environ),
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values, failures, phases = {}, {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, phase, value = results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in failures]
                for r in dead:
                    if r not in values:
                        failures[r] = f"rank {r} exited with code {procs[r].exitcode} without reporting"
                        deadline = min(deadline, time.monotonic() + 10.0)
                continue
            if ok:
                values[rank] = pickle.loads(value)
            else:
                failures[rank], phases[rank] = value, phase
            if failures:
                # The others are likely blocked on the failed rank: give them a moment, no more.
                deadline = min(deadline, time.monotonic() + 10.0)
    finally:
        for p in procs:
            p.join(timeout=5 if not failures and len(values) == world_size else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(rendezvous, ignore_errors=True)
    return values, failures, phases
