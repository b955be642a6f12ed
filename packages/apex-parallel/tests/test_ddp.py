"""DistributedDataParallel and Reducer on real process groups (gloo on the CPU, NCCL marked multigpu).

Training with DDP on ``world`` ranks, each on its shard of a batch, must match training one
model on the whole batch (float64, so only summation order differs): same gradients after every
backward pass, same parameters after every step, identical parameters on every rank. The worker
runs many configurations per process group, since starting the ranks is the slow part.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from apex.core.testing import RankFailed, run_ranks
from apex.parallel import DistributedDataParallel, Reducer

HERE = Path(__file__)
BATCH = 12  # divisible by 2 and 3 ranks, and by 2 micro-batches on each
STEPS = 4
LR = 0.1
INIT_SEED = 1000  # rank r initializes with INIT_SEED + r: the broadcast from rank 0 must win


class Net(nn.Module):
    """A small MLP; with ``branchy``, a branch used only where samples are flagged, and a dead layer."""

    def __init__(self, branchy: bool):
        super().__init__()
        self.embed = nn.Linear(6, 10)
        self.hidden = nn.Linear(10, 10)
        self.head = nn.Linear(10, 3)
        self.gain = nn.Parameter(torch.rand(3) + 0.5)
        self.register_buffer("offset", torch.randn(3))
        self.branch = nn.Linear(10, 10) if branchy else None
        self.dead = nn.Linear(10, 3) if branchy else None

    def forward(self, x, flag=None):
        h = torch.tanh(self.hidden(torch.tanh(self.embed(x))))
        if self.branch is not None and flag is not None and bool(flag.any()):
            rows = flag.nonzero().squeeze(1)  # the branch is in the graph only if some row is flagged
            h = h.index_add(0, rows, self.branch(h[rows]))
        return self.head(h) * self.gain + self.offset


def make_model(branchy: bool, seed: int, dtype=torch.float64, device="cpu") -> Net:
    torch.manual_seed(seed)
    return Net(branchy).to(dtype=dtype, device=device)


def make_batch(step: int, world: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 6, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randn(BATCH, 3, generator=gen, dtype=torch.float64).to(dtype)
    # The branch: step 0 only rank 0's rows, step 1 none, step 2 all, step 3 only the last rank's.
    shard = BATCH // world
    flag = torch.zeros(BATCH, dtype=torch.bool)
    if step % 4 == 0:
        flag[:shard] = True
    elif step % 4 == 2:
        flag[:] = True
    elif step % 4 == 3:
        flag[-shard:] = True
    return x, y, flag


def micro_batches(x, y, flag, ranks, world, micro):
    """The rows of ``ranks`` for each micro-batch: micro-batch j is every such rank's j-th slice of its shard."""
    shard, piece = BATCH // world, BATCH // world // micro
    for j in range(micro):
        rows = torch.cat([torch.arange(r * shard + j * piece, r * shard + (j + 1) * piece) for r in ranks])
        yield x[rows], y[rows], flag[rows]


CONFIGS = {
    "one_bucket": dict(ddp={}),
    "bucket_per_param": dict(ddp=dict(message_size=1)),
    "few_element_buckets": dict(ddp=dict(message_size=40)),
    "delay_allreduce": dict(ddp=dict(delay_allreduce=True)),
    "always_fp32": dict(ddp=dict(allreduce_always_fp32=True, message_size=40), tol=1e-6),
    "predivide": dict(ddp=dict(gradient_predivide_factor=2.0, message_size=40)),
    "sum_predivided": dict(ddp=dict(gradient_average=False, gradient_predivide_factor=2.0)),
    "accumulate": dict(ddp=dict(message_size=40), micro=2),
    "accumulate_delay": dict(ddp=dict(delay_allreduce=True), micro=2),
    "branch_tiny_buckets": dict(ddp=dict(message_size=1), branchy=True),
    "branch_few_element_buckets": dict(ddp=dict(message_size=40), branchy=True),
    "branch_delay": dict(ddp=dict(delay_allreduce=True), branchy=True),
    "branch_accumulate": dict(ddp=dict(message_size=40), branchy=True, micro=2),
    "two_streams": dict(ddp=dict(num_allreduce_streams=2, message_size=40)),
    "retain_buffers": dict(ddp=dict(retain_allreduce_buffers=True, message_size=40)),
    "triggers": dict(ddp=dict(), triggers=("hidden.bias", "gain")),
    "freeze_after_step_1": dict(ddp=dict(message_size=40), freeze=("hidden.weight", "hidden.bias")),
    "split_factor_renamed": dict(ddp=dict(gradient_average_split_factor=2.0)),
}


def grad_scale(cfg: dict, world: int) -> float:
    """DDP's gradient over the whole-batch mean gradient."""
    options = cfg["ddp"]
    factor = options.get("gradient_predivide_factor", options.get("gradient_average_split_factor", 1.0))
    return 1.0 if options.get("gradient_average", True) else world / factor


def train(cfg: dict, world: int, rank: int | None):
    """Train with DDP as ``rank`` (or, with rank None, one model on the whole batch: the reference)."""
    branchy, micro = cfg.get("branchy", False), cfg.get("micro", 1)
    model = make_model(branchy, INIT_SEED + (rank or 0))
    named = dict(model.named_parameters())
    result = {"warnings": [], "grads": []}
    net = model
    if rank is not None:
        options = dict(cfg["ddp"])
        if "triggers" in cfg:
            options["allreduce_trigger_params"] = [named[n] for n in cfg["triggers"]]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            net = DistributedDataParallel(model, **options)
        result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    ranks = [rank] if rank is not None else list(range(world))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scale = grad_scale(cfg, world)
    for step in range(STEPS):
        if step == 1:
            for name in cfg.get("freeze", ()):
                named[name].requires_grad_(False)
        optimizer.zero_grad(set_to_none=True)
        for j, (x, y, flag) in enumerate(micro_batches(*make_batch(step, world), ranks, world, micro)):
            if rank is not None and micro > 1:
                (net.enable_allreduce if j == micro - 1 else net.disable_allreduce)()
            F.mse_loss(net(x, flag=flag), y).backward()
        if rank is None and scale != 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        result["grads"].append({n: None if p.grad is None else p.grad.clone() for n, p in named.items()})
        if rank is not None and "retain_allreduce_buffers" in cfg["ddp"]:
            storages = {b.untyped_storage().data_ptr() for b in net.allreduce_buffers}
            result["grads_in_buffers"] = bool(storages) and all(
                p.grad.untyped_storage().data_ptr() in storages for p in model.parameters() if p.grad is not None
            )
        optimizer.step()
    result["params"] = {n: p.detach().clone() for n, p in named.items()}
    result["offset"] = model.offset.clone()
    return result


def train_configs(rank: int, world: int, names: list[str]) -> bytes:
    return {name: train(CONFIGS[name], world, rank) for name in names}


def reducer_worker(rank: int, world: int) -> dict:
    """Reducer(module).reduce() and Reducer(grads).reduce() average the shards' gradients."""
    out = {}
    for form in ("module", "grads"):
        model = make_model(False, INIT_SEED + rank)
        dist.broadcast(model.offset, src=0)  # Reducer broadcasts parameters only, as upstream
        reducer = Reducer(model) if form == "module" else None
        if form == "grads":  # the list form does not broadcast: sync by hand
            for p in model.parameters():
                dist.broadcast(p.detach(), src=0)
        x, y, flag = make_batch(0, world)
        (xr, yr, _) = next(micro_batches(x, y, flag, [rank], world, 1))
        F.mse_loss(model(xr), yr).backward()
        if reducer is None:
            reducer = Reducer([[p.grad for p in model.parameters()]])
        reducer.reduce()
        out[form] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out


def stalled_peer_worker(rank: int, world: int, flag_file: str):
    """Rank 1 stops answering after construction; rank 0's backward pass must fail, not hang."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    ddp = DistributedDataParallel(make_model(False, INIT_SEED, device=device))
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag_file) and time.monotonic() < deadline:
            time.sleep(0.1)
        return None
    x, y, _ = (t.to(device) for t in make_batch(0, world))
    start = time.monotonic()
    try:
        F.mse_loss(ddp(x), y).backward()
        if device.type == "cuda":  # NCCL's collectives are asynchronous to the host
            torch.cuda.synchronize(device)
        outcome = ("no error", "")
    except Exception as exc:  # the error is the result
        outcome = (type(exc).__name__, str(exc)[:500])
    elapsed = time.monotonic() - start
    Path(flag_file).write_text("done")
    return (elapsed, *outcome)


def dead_peer_worker(rank: int, world: int):
    """Rank 1 exits after construction; rank 0's backward pass raises (reported by run_ranks)."""
    ddp = DistributedDataParallel(make_model(False, INIT_SEED))
    if rank == 1:
        os._exit(3)
    x, y, _ = make_batch(0, world)
    F.mse_loss(ddp(x), y).backward()
    return "finished without error"


# Helpers for the checks -------------------------------------------------------------------


class Mismatched(nn.Module):
    """The same module on every rank except in the one place ``case`` names, on rank 1."""

    def __init__(self, case: str, rank: int):
        super().__init__()
        other = rank == 1
        self.embed = nn.Linear(4, 6, dtype=torch.float32 if case == "dtype" and other else torch.float64)
        shape = {"shape": (6, 5), "numel": (2, 12)}.get(case, (4, 6)) if other else (4, 6)
        self.mix = nn.Parameter(torch.ones(shape, dtype=torch.float64))
        if case == "count" and other:
            self.extra = nn.Parameter(torch.ones(3, dtype=torch.float64))
        self.register_buffer("scale", torch.ones(5 if case == "buffer" and other else 3, dtype=torch.float64))


MISMATCH_CASES = ("shape", "numel", "dtype", "count", "buffer")


def mismatch_worker(rank: int, world: int) -> dict:
    """Per case, the error DDP and Reducer(module) raise at construction (or that none was raised)."""
    out = {}
    for case in MISMATCH_CASES:
        for wrapper in (DistributedDataParallel, Reducer):
            try:
                wrapper(Mismatched(case, rank))
                out[case, wrapper.__name__] = ("no error", "")
            except Exception as exc:  # the error is the result
                out[case, wrapper.__name__] = (type(exc).__name__, str(exc))
    # the same model on every rank still constructs, and the ranks agree afterwards
    ddp = DistributedDataParallel(Mismatched("none", rank))
    out["same"] = [p.detach().clone() for p in ddp.parameters()]
    return out


# Per case: what differs, and its description on rank 0 and on rank 1.
MISMATCH_FACTS = {
    "shape": ("parameter 'mix'", "shape (4, 6) and dtype torch.float64", "shape (6, 5) and dtype torch.float64"),
    "numel": ("parameter 'mix'", "shape (4, 6) and dtype torch.float64", "shape (2, 12) and dtype torch.float64"),
    "dtype": (
        "parameter 'embed.weight'",
        "shape (6, 4) and dtype torch.float64",
        "shape (6, 4) and dtype torch.float32",
    ),
    "buffer": ("buffer 'scale'", "shape (3,) and dtype torch.float64", "shape (5,) and dtype torch.float64"),
}


def test_ranks_with_different_models_raise_a_clear_error_on_every_rank():
    results = run_ranks(HERE, "mismatch_worker", 2, timeout=120)
    for rank, out in enumerate(results):
        other = 1 - rank
        for case in MISMATCH_CASES:
            for wrapper in ("DistributedDataParallel", "Reducer"):
                kind, message = out[case, wrapper]
                if case == "buffer" and wrapper == "Reducer":  # Reducer broadcasts parameters only
                    assert kind == "no error", message
                    continue
                assert kind == "ValueError", (rank, case, wrapper, kind, message)
                assert message.startswith(f"{wrapper}: module differs across ranks: "), message
                if case == "count":
                    counts = ["3 parameters", "4 parameters"]
                    if wrapper == "DistributedDataParallel":
                        counts = [f"{c} and 1 buffers" for c in counts]
                    expected = f"rank {rank} has {counts[rank]} but rank {other} has {counts[other]}"
                else:
                    what, *facts = MISMATCH_FACTS[case]
                    expected = f"{what} has {facts[rank]} on rank {rank} but {facts[other]} on rank {other}"
                assert expected in message, (case, wrapper, message)
    for a, b in zip(results[0]["same"], results[1]["same"]):
        assert torch.equal(a, b)


def assert_close_to_reference(name: str, got: dict, ref: dict, tol: float) -> None:
    for step, (g_step, r_step) in enumerate(zip(got["grads"], ref["grads"])):
        for pname, g in g_step.items():
            r = r_step[pname]
            where = f"{name}: grad of {pname} after step {step}"
            if r is None:  # no gradient anywhere: DDP reduces zeros (or leaves a frozen parameter alone)
                assert g is None or torch.count_nonzero(g) == 0, where
                continue
            assert g is not None, where
            torch.testing.assert_close(g, r, rtol=tol, atol=tol, msg=where)
    for pname, p in got["params"].items():
        torch.testing.assert_close(p, ref["params"][pname], rtol=tol, atol=tol, msg=f"{name}: {pname}")
    torch.testing.assert_close(got["offset"], ref["offset"], rtol=0, atol=0, msg=f"{name}: buffer broadcast")


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_matches_whole_batch_training(world):
    names = list(CONFIGS)
    results = run_ranks(HERE, "train_configs", world, args=(names,), timeout=240)
    for name in names:
        cfg = CONFIGS[name]
        ref = train(cfg, world, None)
        for rank, per_rank in enumerate(results):
            assert_close_to_reference(f"{name} rank {rank}", per_rank[name], ref, cfg.get("tol", 1e-10))
        for pname, p in results[0][name]["params"].items():
            for rank in range(1, world):
                assert torch.equal(results[rank][name]["params"][pname], p), f"{name}: {pname} differs on rank {rank}"
    assert all(r["retain_buffers"]["grads_in_buffers"] for r in results)
    for r in results:
        assert any("gradient_predivide_factor" in w for w in r["split_factor_renamed"]["warnings"])
        assert r["one_bucket"]["warnings"] == []
        # a layer no rank ever uses ends each step with a zero gradient, not None
        assert all(torch.count_nonzero(s["dead.weight"]) == 0 for s in r["branch_delay"]["grads"])


def test_reducer_averages_gradients():
    world = 2
    results = run_ranks(HERE, "reducer_worker", world, timeout=120)
    ref_model = make_model(False, INIT_SEED)
    x, y, _ = make_batch(0, world)
    F.mse_loss(ref_model(x), y).backward()
    for rank, out in enumerate(results):
        for form, grads in out.items():
            for n, p in ref_model.named_parameters():
                torch.testing.assert_close(grads[n], p.grad, rtol=1e-12, atol=1e-12, msg=f"rank {rank} {form} {n}")


def test_stalled_peer_raises_within_the_collective_timeout(tmp_path):
    timeout = 5.0
    results = run_ranks(
        HERE, "stalled_peer_worker", 2, args=(str(tmp_path / "flag"),), timeout=90, collective_timeout=timeout
    )
    elapsed, kind, message = results[0]
    assert kind != "no error", "the backward pass finished although rank 1 never took part"
    assert elapsed < timeout + 15, f"rank 0 needed {elapsed:.1f} s to give up ({kind}: {message})"


def test_dead_peer_ends_the_survivor():
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(HERE, "dead_peer_worker", 2, timeout=90, collective_timeout=5.0)
    report = str(info.value)
    assert "--- rank 0 ---" in report, f"rank 0 did not fail by itself:\n{report}"
    assert "finished without error" not in report
    assert time.monotonic() - start < 60


# In-process checks on a one-rank group ----------------------------------------------------


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDataParallel(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="init_process_group"):
        Reducer(nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(shared_param=True), ValueError, "shared_param is no longer supported"),
        (dict(message_size=0), ValueError, "message_size"),
        (dict(num_allreduce_streams=0), ValueError, "num_allreduce_streams"),
        (dict(delay_allreduce=True, num_allreduce_streams=2), ValueError, "delay_allreduce"),
        (dict(delay_allreduce=True, allreduce_trigger_params=[]), ValueError, "allreduce_trigger_params"),
        (dict(allreduce_trigger_params=[nn.Parameter(torch.ones(1))]), ValueError, "not parameters of module"),
        (dict(gradient_predivide_factor=0.0), ValueError, "gradient_predivide_factor"),
        (dict(allreduce_communicators=([None], [None])), ValueError, "allreduce_communicators"),
    ],
)
def test_bad_arguments(one_rank_group, kwargs, error, match):
    with pytest.raises(error, match=match):
        DistributedDataParallel(nn.Linear(2, 2), **kwargs)


def test_bad_modules(one_rank_group):
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        DistributedDataParallel([nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        DistributedDataParallel(nn.ReLU())
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        DistributedDataParallel(nn.Linear(2, 2).requires_grad_(False))
    with pytest.raises(TypeError, match="iterable of tensors"):
        Reducer([torch.ones(2), 3])


def test_split_factor_warns_and_maps_to_predivide(one_rank_group):
    with pytest.warns(FutureWarning, match="gradient_predivide_factor"):
        ddp = DistributedDataParallel(nn.Linear(2, 2), gradient_average_split_factor=4.0)
    assert ddp.gradient_predivide_factor == 4.0


def test_one_rank_forward_passes_kwargs_and_state_dict(one_rank_group):
    model = make_model(True, INIT_SEED)
    ddp = DistributedDataParallel(model, message_size=16)
    x, y, flag = make_batch(2, 1)
    torch.testing.assert_close(ddp(x, flag=flag), model(x, flag=flag))
    assert set(ddp.state_dict()) == {f"module.{k}" for k in model.state_dict()}
    for step in range(3):  # learning pass, then overlapped passes; a rank alone keeps its gradients
        model.zero_grad(set_to_none=True)
        x, y, flag = make_batch(step + 2, 1)
        F.mse_loss(ddp(x, flag=flag), y).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        ddp.disable_allreduce()
        F.mse_loss(ddp(x, flag=flag), y).backward()
        ddp.enable_allreduce()
        for n, p in model.named_parameters():
            expected = p.grad if p.grad is not None else torch.zeros_like(p)
            torch.testing.assert_close(grads[n], expected, rtol=0, atol=0, msg=n)


# GPUs --------------------------------------------------------------------------------------

GPU_CONFIGS = {
    "one_bucket": dict(),
    "bucket_per_param": dict(message_size=1),
    "few_element_buckets": dict(message_size=40),
    "delay_allreduce": dict(delay_allreduce=True),
    "two_streams": dict(num_allreduce_streams=2, message_size=40),
    "retain_buffers": dict(retain_allreduce_buffers=True, message_size=40),
    "predivide_fp32": dict(allreduce_always_fp32=True, gradient_predivide_factor=2.0, message_size=40),
}
GPU_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def gpu_worker(rank: int, world: int) -> dict:
    """Per configuration and dtype: this rank's local gradients and DDP's, over a few steps."""
    device = torch.device("cuda", rank)
    out = {}
    for dtype_name, dtype in GPU_DTYPES.items():
        for name, options in GPU_CONFIGS.items():
            if dtype != torch.float32:
                options = dict(options, allreduce_always_fp32=True)
            model = make_model(True, INIT_SEED + rank, dtype=dtype, device=device)
            ddp = DistributedDataParallel(model, **options)
            steps = []
            for step in range(3):
                x, y, flag = (t.to(device) for t in make_batch(step, world, dtype))
                shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
                local = {}
                ddp.disable_allreduce()
                model.zero_grad(set_to_none=True)
                F.mse_loss(ddp(x[shard], flag=flag[shard]).float(), y[shard].float()).backward()
                local = {n: None if p.grad is None else p.grad.cpu() for n, p in model.named_parameters()}
                ddp.enable_allreduce()
                model.zero_grad(set_to_none=True)
                F.mse_loss(ddp(x[shard], flag=flag[shard]).float(), y[shard].float()).backward()
                reduced = {n: p.grad.cpu() for n, p in model.named_parameters()}
                steps.append((local, reduced))
                with torch.no_grad():
                    for p in model.parameters():
                        p.sub_(LR * p.grad)
            torch.cuda.synchronize(device)
            out[(dtype_name, name)] = dict(steps=steps, params={n: p.cpu() for n, p in model.named_parameters()})
    return out


def check_gpu_results(results: list[dict]) -> None:
    world = len(results)
    for (dtype_name, name), first in results[0].items():
        options = GPU_CONFIGS[name]
        factor = options.get("gradient_predivide_factor", 1.0)
        dtype = GPU_DTYPES[dtype_name]
        tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
        for step in range(len(first["steps"])):
            for pname, reduced in first["steps"][step][1].items():
                locals_ = [r[(dtype_name, name)]["steps"][step][0][pname] for r in results]
                # fp32 reduction: sum of the fp32 values of (g / f), times f / world, rounded once
                parts = [torch.zeros_like(reduced, dtype=torch.float64) if g is None else g.double() for g in locals_]
                expected = (sum((p / factor).float().double() for p in parts) * (factor / world)).to(dtype)
                where = f"{dtype_name} {name} step {step} {pname}"
                torch.testing.assert_close(reduced, expected, rtol=tol, atol=tol, msg=where)
                for rank in range(1, world):
                    other = results[rank][(dtype_name, name)]["steps"][step][1][pname]
                    assert torch.equal(other, reduced), f"{where}: rank {rank} differs"
        for pname, p in first["params"].items():
            for rank in range(1, world):
                assert torch.equal(results[rank][(dtype_name, name)]["params"][pname], p), (
                    f"{dtype_name} {name} {pname}"
                )


@pytest.mark.gpu
def test_ddp_one_gpu_nccl():
    check_gpu_results(run_ranks(HERE, "gpu_worker", 1, backend="nccl", timeout=300))


@pytest.mark.gpu
@pytest.mark.multigpu
def test_ddp_two_gpus_nccl():
    check_gpu_results(run_ranks(HERE, "gpu_worker", 2, backend="nccl", timeout=300))


@pytest.mark.gpu
@pytest.mark.multigpu
def test_stalled_peer_nccl(tmp_path):
    """With NCCL, a stuck collective is ended at the process group's timeout (the watchdog may abort rank 0)."""
    start = time.monotonic()
    try:
        results = run_ranks(
            HERE,
            "stalled_peer_worker",
            2,
            backend="nccl",
            args=(str(tmp_path / "flag"),),
            timeout=150,
            collective_timeout=10.0,
        )
    except RankFailed as exc:
        assert "--- rank 0 ---" in str(exc), str(exc)
    else:
        elapsed, kind, message = results[0]
        assert kind != "no error", "the backward pass finished although rank 1 never took part"
        assert elapsed < 60, (elapsed, kind, message)
    assert time.monotonic() - start < 120
