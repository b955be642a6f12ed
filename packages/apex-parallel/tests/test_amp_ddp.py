"""apex.amp with apex.parallel.DistributedDataParallel: upstream's workflow, on real process groups.

``model, optimizer = amp.initialize(model, optimizer, ...)`` first, then ``model =
DistributedDataParallel(model)``, then ``amp.scale_loss`` around each backward. Every rank must
end with the same parameters and loss scale, and the training must be that of one process on
the whole batch: the change of every parameter over the run agrees with the single-process run
to within low-precision rounding (a missing or doubled reduction changes it by tens of percent).
Needs apex-amp (skipped where only apex-parallel is installed).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

amp = pytest.importorskip("apex.amp")

from apex.core.testing import run_ranks  # noqa: E402
from apex.parallel import DistributedDataParallel  # noqa: E402

HERE = Path(__file__)
BATCH, STEPS = 8, 5

# name -> (amp.initialize keywords, optimizer); bf16, which the CPU runs.
CONFIGS = {
    "O2-bf16-dynamic-sgd": (
        dict(opt_level="O2", cast_model_type=torch.bfloat16, loss_scale="dynamic"),
        lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.5),
    ),
    "O1-bf16-sgd": (
        dict(opt_level="O1", autocast_dtype=torch.bfloat16),
        lambda params: torch.optim.SGD(params, lr=0.5),
    ),
}


def make_model() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    return [
        (torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 3, generator=generator)) for _ in range(STEPS)
    ]


def train(name: str, rank: int | None, world: int, device: torch.device) -> dict:
    """STEPS steps of config ``name``; rank None: one process on the whole batch, no DDP."""
    from apex.amp import _amp_state  # as upstream exposes it

    options, make_optimizer = CONFIGS[name]
    model = make_model().to(device)
    initial = [p.detach().clone() for p in model.parameters()]
    optimizer = make_optimizer(model.parameters())
    model, optimizer = amp.initialize(model, optimizer, verbosity=0, **options)
    net = model if rank is None else DistributedDataParallel(model, allreduce_always_fp32=True)
    shard = slice(None) if rank is None else slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for x, y in batches():
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = F.mse_loss(net(x[shard]).float(), y[shard])
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    return {
        "initial": [p.cpu() for p in initial],
        "final": [p.detach().float().cpu() for p in model.parameters()],
        "loss_scale": _amp_state.loss_scalers[0].loss_scale(),
    }


def worker(rank: int, world: int, backend: str) -> dict:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    return {name: train(name, rank, world, device) for name in CONFIGS}


@pytest.mark.parametrize(
    "backend", ["gloo", pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.multigpu])], ids=["gloo", "nccl"]
)
def test_amp_then_ddp_trains_like_one_process(backend):
    world = 2
    results = run_ranks(HERE, "worker", world, backend=backend, args=(backend,), timeout=240)
    for name in CONFIGS:
        first = results[0][name]
        for rank in range(1, world):
            other = results[rank][name]
            assert other["loss_scale"] == first["loss_scale"], name
            for a, b in zip(first["final"], other["final"]):
                assert torch.equal(a, b), f"{name}: rank {rank} ended with other parameters"
        single = train(name, None, world, torch.device("cuda" if backend == "nccl" else "cpu"))
        assert single["loss_scale"] == first["loss_scale"], name
        for i, (start, got, expected) in enumerate(zip(first["initial"], first["final"], single["final"])):
            moved, expected_move = got - start.float(), expected - start.float()
            error = (moved - expected_move).norm() / expected_move.norm()
            assert expected_move.norm() > 0, f"{name}: parameter {i} did not train"
            assert error < 0.05, f"{name}: parameter {i} moved {error:.1%} differently from one-process training"
