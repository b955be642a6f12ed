"""Start one process per GPU running a training script: ``python -m apex.parallel.multiproc``.

    python -m apex.parallel.multiproc [--nproc N] [--master-addr A] [--master-port P]
                                      [--pass-rank] [--log-dir DIR] script.py [script args ...]

Each of the N processes (default: one per visible GPU, at least one) runs ``python script.py
args`` with the environment that ``torch.distributed.init_process_group(backend)`` reads with its
default ``env://`` rendezvous: ``RANK`` and ``LOCAL_RANK`` (0..N-1), ``WORLD_SIZE`` and
``LOCAL_WORLD_SIZE`` (N), ``MASTER_ADDR`` (default 127.0.0.1) and ``MASTER_PORT`` (default a free
port). The script is expected to call ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))``.

Upstream Apex's launcher passed ``--world-size N --rank i`` on the command line instead; with
``--pass-rank`` these arguments are appended (or, where the script's arguments already hold
``--rank``/``--world-size``, their values replaced), for scripts written for it.

Rank 0 writes to this terminal; rank i > 0 writes its output to ``DIR/GPU_i.log`` (upstream's
names; ``DIR`` defaults to the current directory). When a process fails, the others are
terminated and the launcher exits with its status, so a crash never leaves the job hanging.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

GRACE_SECONDS = 10.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_nproc() -> int:
    import torch  # only when needed: the launcher itself starts fast

    return max(1, torch.cuda.device_count())


def _with_option(args: list[str], name: str, value: str) -> list[str]:
    args = list(args)
    if name in args:
        position = args.index(name)
        if position + 1 < len(args):
            args[position + 1] = value
            return args
        return [*args, value]
    return [*args, name, value]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m apex.parallel.multiproc",
        description="Run a training script on N processes with torch.distributed's env:// variables set.",
    )
    p.add_argument("--nproc", type=int, default=None, help="number of processes (default: visible GPUs, at least 1)")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=None, help="default: a free local port")
    p.add_argument("--pass-rank", action="store_true", help="also append --rank i --world-size N (upstream style)")
    p.add_argument("--log-dir", type=Path, default=Path("."), help="where ranks > 0 write GPU_<rank>.log")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    args = p.parse_args(argv)
    if args.nproc is not None and args.nproc < 1:
        p.error(f"--nproc must be at least 1, got {args.nproc}")
    return args


def _stop(workers: list[subprocess.Popen]) -> None:
    for w in workers:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for w in workers:
        try:
            w.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()


def main(argv=None) -> int:
    args = parse_args(argv)
    nproc = args.nproc if args.nproc is not None else _default_nproc()
    port = args.master_port if args.master_port is not None else _free_port()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    workers, logs = [], []
    try:
        for rank in range(nproc):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR=args.master_addr,
                MASTER_PORT=str(port),
            )
            script_args = args.script_args
            if args.pass_rank:
                script_args = _with_option(_with_option(script_args, "--world-size", str(nproc)), "--rank", str(rank))
            stdout = None
            if rank > 0:
                stdout = open(args.log_dir / f"GPU_{rank}.log", "w")  # closed in the finally below
                logs.append(stdout)
            cmd = [sys.executable, "-u", args.script, *script_args]
            workers.append(subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None))
        status = 0
        while True:
            codes = [w.poll() for w in workers]
            status = next((code for code in codes if code not in (None, 0)), 0)
            if status != 0 or all(code is not None for code in codes):
                break
            time.sleep(0.2)
        if status != 0:
            bad = [rank for rank, w in enumerate(workers) if w.returncode not in (None, 0)]
            print(f"multiproc: rank(s) {bad} failed with status {status}; stopping the others", file=sys.stderr)
        return status
    except KeyboardInterrupt:
        return 130
    finally:
        _stop(workers)
        for log in logs:
            log.close()


if __name__ == "__main__":
    sys.exit(main())
