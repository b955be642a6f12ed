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


def test_upstreams_test_oracles_agree_with_the_modules():
    import torch

    from apex.contrib.transducer import TransducerJoint, TransducerLoss
    from apex.contrib.transducer._transducer_ref import transducer_joint_reference, transducer_loss_reference

    B, T, U, H, V = 2, 5, 4, 8, 6
    f = torch.randn(B, T, H, dtype=torch.float64, requires_grad=True)
    g = torch.randn(B, U, H, dtype=torch.float64, requires_grad=True)
    f_len = torch.tensor([5, 3], dtype=torch.int32)
    g_len = torch.tensor([4, 2], dtype=torch.int32)
    h_grad = torch.randn(B, T, U, H, dtype=torch.float64)
    h, f_grad, _ = transducer_joint_reference(f, g, h_grad, f_len, g_len, False, True, False)
    torch.testing.assert_close(h, TransducerJoint(relu=True)(f, g, f_len, g_len).detach())
    # upstream's oracle back-propagates the padded rows too
    torch.testing.assert_close(f_grad, ((f[:, :, None] + g[:, None]) > 0).double().mul(h_grad).sum(2))

    x = torch.randn(B, T, U, V, dtype=torch.float64, requires_grad=True)
    label = torch.randint(1, V, (B, U - 1), dtype=torch.int32)
    y_len = torch.tensor([3, 1], dtype=torch.int32)
    loss_grad = torch.tensor([1.0, 0.5], dtype=torch.float64)
    alpha, beta, x_grad, loss = transducer_loss_reference(x, label, f_len, y_len, 0, loss_grad)
    x2 = x.detach().requires_grad_()
    debug = []
    ours = TransducerLoss()(x2, label, f_len, y_len, 0, debug_list=debug)
    (ours_grad,) = torch.autograd.grad(ours, x2, loss_grad)
    torch.testing.assert_close(loss, ours.detach())
    torch.testing.assert_close(x_grad, ours_grad)
    torch.testing.assert_close(alpha, debug[0])
    torch.testing.assert_close(beta, debug[1])
