"""The package as code written for upstream Apex imports it: ``from apex.contrib.transducer import ...``,
the ops registered by importing apex.contrib.transducer, and the top-level legacy modules."""

from __future__ import annotations

import subprocess
import sys

LEGACY = {"transducer_joint_cuda": ["forward", "backward"], "transducer_loss_cuda": ["forward", "backward"]}
OPS = ["joint_forward", "joint_backward", "loss_forward", "loss_backward"]


def run(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_modules_as_upstream_code_imports_them():
    run(
        "import sys; from apex.contrib.transducer import TransducerJoint, TransducerLoss; "
        "from apex.contrib.transducer.transducer import TransducerJoint as J; "
        "sys.exit(0 if J is TransducerJoint and callable(TransducerLoss) else 1)"
    )


def test_importing_the_package_registers_every_op():
    run(
        "import torch, sys, apex.contrib.transducer; "
        f"missing = [n for n in {OPS!r} if not hasattr(torch.ops.apex_contrib_transducer, n)]; "
        "print(missing); sys.exit(1 if missing else 0)"
    )


def test_legacy_modules_import_in_a_fresh_interpreter_with_upstreams_functions():
    run(
        "import importlib, sys; "
        f"missing = [(m, f) for m, fs in {LEGACY!r}.items() for f in fs "
        "if not callable(getattr(importlib.import_module(m), f, None))]; "
        "print(missing); sys.exit(1 if missing else 0)"
    )


def test_plugin_provides_the_legacy_modules():
    from apex.contrib.transducer._plugin import PLUGIN

    assert set(LEGACY) <= set(PLUGIN.provides)
    assert "apex.contrib.transducer" in PLUGIN.provides
