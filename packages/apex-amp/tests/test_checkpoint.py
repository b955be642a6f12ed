"""The checkpoint workflow of upstream's README, across two processes, resumes bitwise."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from apex import amp

WORKER = Path(__file__).with_name("_checkpoint_worker.py")
STEPS, RESUME_AT = 9, 4


def run_worker(phase: str, device: str, outdir: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(WORKER), phase, device, str(outdir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{phase} failed:\n{proc.stdout}\n{proc.stderr}"
    return torch.load(outdir / f"{phase}.pt", weights_only=False)


def assert_same(a, b, where: str) -> None:
    """Bitwise equality of nested dicts/lists of tensors and numbers."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.cpu(), b.cpu()), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def test_resume_in_a_new_process_is_bitwise(device, tmp_path):
    full = run_worker("full", device, tmp_path)
    resumed = run_worker("resume", device, tmp_path)
    with_fused = importlib.util.find_spec("apex.optimizers") is not None
    assert set(full) == set(resumed) and len(full) == (9 if with_fused else 6)
    for name in full:
        f, r = full[name], resumed[name]
        assert len(f["losses"]) == STEPS and len(r["losses"]) == STEPS - RESUME_AT
        assert_same(f["losses"][RESUME_AT:], r["losses"], f"{name}: losses")
        assert f["scales"][RESUME_AT:] == r["scales"], name
        assert_same(f["params"], r["params"], f"{name}: params")
        assert_same(f["model"], r["model"], f"{name}: model state")
        assert_same(f["optimizer"], r["optimizer"], f"{name}: optimizer state")
        assert_same(dict(f["amp"]), dict(r["amp"]), f"{name}: amp state")
        # The injected overflows really moved the dynamic scales (so the amp state mattered).
        if not name.endswith("-static"):
            assert f["scales"][1] == 2.0**16 and f["scales"][2] == 2.0**15 and f["scales"][6] == 2.0**14, name
        assert torch.isfinite(f["losses"]).all()


def test_optimizer_state_carries_amp_masters(make_net):
    net = make_net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net, opt = amp.initialize(net, opt, opt_level="O2", verbosity=0)
    state = opt.state_dict()
    masters = state["amp_master_params"]
    # fc1 weight and bias, fc2 weight and bias; batch norm (indices 2, 3) is fp32, its own master.
    assert sorted(masters) == [0, 1, 4, 5]
    assert all(t.dtype == torch.float32 for t in masters.values())
    with torch.no_grad():
        masters[0].add_(1.0)  # a reference to the live master, as torch's state_dict holds references
    other = make_net(seed=7)
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-3)
    other, opt2 = amp.initialize(other, opt2, opt_level="O2", verbosity=0)
    opt2.load_state_dict(state)
    assert torch.equal(opt2.param_groups[0]["params"][0], opt.param_groups[0]["params"][0])
    assert torch.equal(other.fc1.weight, opt.param_groups[0]["params"][0].half())  # the model follows
    assert "amp_master_params" in state  # the caller's dict is left whole


def test_amp_state_dict_errors(make_net, capsys):
    amp.initialize(make_net(), opt_level="O1", num_losses=2, verbosity=0)
    state = amp.state_dict()
    assert list(state) == ["loss_scaler0", "loss_scaler1"]
    with pytest.raises(RuntimeError, match='Unexpected key\\(s\\) in state_dict: "bogus"'):
        amp.load_state_dict({**state, "bogus": {}})
    amp.initialize(make_net(), opt_level="O1", num_losses=1, verbosity=0)
    amp.load_state_dict(state)
    out = capsys.readouterr().out
    assert "state_dict contains 2 entries, while 1 loss_scalers are used" in out
    assert "Skipping loss_scaler[1], since num_losses was set to 1" in out
