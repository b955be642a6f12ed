"""DistributedFusedAdam's multi-process workers and their single-process float64 references.

Loaded by path in each rank (``apex.core.testing.run_ranks``) and imported by the test module.

Two models:
- ``Probe``: loss = sum over parameters of ``(p * G).sum()`` with ``G`` drawn per (step, micro-batch,
  rank) from a seed, so a parameter's gradient is exactly ``G`` (values rounded to bf16, so exact in
  every dtype) and the averaged gradient is known without running the model: the optimizer's math is
  checked alone, for every dtype and layout option;
- ``Mlp``: a small nonlinear model on data split across ranks (the whole batch's mean loss is the
  mean of the ranks' losses), against a float64 copy trained on the whole batch.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

# uneven sizes; 130 spans several 32-element shards; an empty and a frozen parameter are skipped
SHAPES = [(7, 5), (7,), (130,), (3, 7), (1,), (0,), (33,)]
FROZEN = 4  # index of a parameter that does not require grad
GROUP_SPLIT = 3  # parameters [0, 3) form group 0, the rest group 1
GROUPS = [dict(lr=1e-2, weight_decay=0.1), dict(lr=3e-2, weight_decay=0.0)]
BETAS = (0.8, 0.95)
EPS = 1e-6
INIT_SEED = 100


def bucket_cap_mb(shard_elements: int, world: int, element_size: int = 4) -> float:
    """The bucket_cap_mb giving shards of ``shard_elements`` at ``world`` ranks."""
    return shard_elements * world * element_size / 2**20


def initial_values(seed: int = INIT_SEED) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]


def probe_grads(step: int, micro: int, rank: int) -> list[torch.Tensor]:
    """A rank's gradients of one micro-batch: random values exact in bf16 (and so in every dtype)."""
    g = torch.Generator().manual_seed(1_000_000 + 1000 * step + 10 * micro + rank)
    return [torch.randn(s, generator=g).bfloat16().double() for s in SHAPES]


class Probe(nn.Module):
    def __init__(self, dtype: torch.dtype, seed: int = INIT_SEED):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(v.to(dtype)) for v in initial_values(seed)])
        self.ps[FROZEN].requires_grad_(False)

    def forward(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return sum((p.float() * g.to(p.device, torch.float32)).sum() for p, g in zip(self.ps, grads))

    def groups(self, **extra):
        ps = list(self.ps)
        return [
            dict(params=ps[:GROUP_SPLIT], **{**GROUPS[0], **extra}),
            dict(params=ps[GROUP_SPLIT:], **{**GROUPS[1], **extra}),
        ]


# configurations of the Probe runs ------------------------------------------------------------
# param_dtype, shard (elements), steps, micro (micro-batches, all but the last under no_sync),
# options (DistributedFusedAdam keywords), emulate ("round_params": the parameters are the
# master values each step, rounded; "round_state": fp16/bf16 state; "round_scaled": the same, each
# tensor scaled so its largest magnitude is half of the dtype's largest value first), grad_mult (the
# gradients times this power of two), tol (of the final parameters).
SCALED_BF16 = dict(dtype=torch.bfloat16, param_sync_dtype=torch.bfloat16, with_scaled_states=True)
SCALED_FP16 = dict(dtype=torch.float16, param_sync_dtype=torch.float16, with_scaled_states=True)
PROBES = {
    "fp32_small_buckets_overlap": dict(param_dtype=torch.float32, shard=32, options=dict(overlap_grad_sync=True)),
    "fp32_one_bucket_no_overlap_adam_l2": dict(
        param_dtype=torch.float32, shard=4096, options=dict(overlap_grad_sync=False, adam_w_mode=False)
    ),
    "fp32_accumulate_no_sync": dict(param_dtype=torch.float32, shard=64, micro=3),
    "fp32_accumulate_no_overlap_contiguous_grads": dict(
        param_dtype=torch.float32,
        shard=32,
        micro=2,
        options=dict(overlap_grad_sync=False, contiguous_grad_buffer=True),
    ),
    "fp32_overlap_param_sync_pipeline_1": dict(
        param_dtype=torch.float32, shard=32, options=dict(overlap_param_sync=True, pipeline_size=1)
    ),
    "fp32_store_params_false": dict(param_dtype=torch.float32, shard=32, options=dict(store_params=False)),
    "bf16_params_fp32_master": dict(
        param_dtype=torch.bfloat16, shard=32, options=dict(param_sync_dtype=torch.bfloat16), master=True
    ),
    "bf16_params_remainders": dict(
        param_dtype=torch.bfloat16,
        shard=32,
        options=dict(store_params=False, store_param_remainders=True, param_sync_dtype=torch.bfloat16),
        master=True,
        remainders=True,
    ),
    "bf16_params_no_master": dict(
        param_dtype=torch.bfloat16,
        shard=32,
        options=dict(store_params=False, param_sync_dtype=torch.bfloat16),
        emulate="round_params",
    ),
    "fp16_params_fp32_sync": dict(param_dtype=torch.float16, shard=32, master=True),
    "fp32_contiguous_param_buffer": dict(
        param_dtype=torch.float32, shard=32, options=dict(contiguous_param_buffer=True, contiguous_grad_buffer=True)
    ),
    "bf16_contiguous_param_buffer_bf16_sync": dict(
        param_dtype=torch.bfloat16,
        shard=32,
        options=dict(contiguous_param_buffer=True, param_sync_dtype=torch.bfloat16),
        master=True,
    ),
    "fp16_contiguous_param_buffer_fp32_sync": dict(
        param_dtype=torch.float16, shard=32, options=dict(contiguous_param_buffer=True), master=True
    ),
    "bf16_state": dict(
        param_dtype=torch.float32, shard=64, options=dict(dtype=torch.bfloat16), emulate="round_state", tol=2e-2
    ),
    "bf16_grad_sync": dict(
        param_dtype=torch.float32, shard=64, options=dict(grad_sync_dtype=torch.bfloat16), grad_dtype=torch.bfloat16
    ),
    "bf16_scaled_states": dict(
        param_dtype=torch.bfloat16, shard=32, options=SCALED_BF16, emulate="round_scaled", tol=2e-2
    ),
    # gradients of about 1e-4: exp_avg_sq (about 1e-10) is below fp16's smallest subnormal, so only
    # the scaled state keeps it (the test checks that plain fp16 state would flush it to zero)
    "fp16_scaled_states_tiny_grads": dict(
        param_dtype=torch.float16, shard=32, options=SCALED_FP16, emulate="round_scaled", grad_mult=2.0**-14, tol=5e-3
    ),
    "fp32_capturable": dict(param_dtype=torch.float32, shard=32, options=dict(capturable=True)),
}


def probe_options(cfg: dict, world: int) -> dict:
    options = dict(cfg.get("options", {}))
    size = torch.finfo(options.get("grad_sync_dtype", options.get("dtype", torch.float32))).bits // 8
    options["bucket_cap_mb"] = bucket_cap_mb(cfg["shard"], world, size)
    return options


def train_probe(
    cfg: dict, world: int, rank: int, model=None, optimizer=None, start: int = 0, steps: int = 3, device="cpu"
):
    """Train ``Probe`` with DistributedFusedAdam for ``steps`` steps; return (model, optimizer)."""
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    if model is None:
        # Each rank starts from other values: the broadcast from rank 0 must win.
        model = Probe(cfg["param_dtype"], seed=INIT_SEED + rank).to(device)
        optimizer = DistributedFusedAdam(
            model.groups(), betas=BETAS, eps=EPS, device=device, **probe_options(cfg, world)
        )
    micro = cfg.get("micro", 1)
    contiguous = cfg.get("options", {}).get("contiguous_grad_buffer", False)
    for step in range(start, start + steps):
        for m in range(micro):
            grads = [g * cfg.get("grad_mult", 1.0) for g in probe_grads(step, m, rank)]
            if m < micro - 1:
                with optimizer.no_sync():
                    model(grads).backward()
                if contiguous:
                    # the local (unreduced) gradient so far: the sum of this rank's micro-batches
                    for i, p in enumerate(model.ps):
                        if p.requires_grad and p.numel():
                            expected = sum(probe_grads(step, k, rank)[i] for k in range(m + 1)).float()
                            view = optimizer.grad_buffer_view(p).cpu()
                            torch.testing.assert_close(view, expected, rtol=0, atol=0)
            else:
                model(grads).backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.param_sync()
    return model, optimizer


def probe_worker(rank: int, world: int, names: list[str], device="cpu"):
    out = {}
    for name in names:
        cfg = PROBES[name]
        model, optimizer = train_probe(cfg, world, rank, steps=cfg.get("steps", 3), device=device)
        out[name] = dict(
            params=[p.detach().double().cpu() for p in model.ps],
            state=optimizer.state_dict(),
            grads_none=all(p.grad is None for p in model.ps),
            layout=dict(
                shard=optimizer.shard_size,
                buckets=len(optimizer._buckets),
                state_elements=sum(b.exp_avg.numel() for b in optimizer._buckets),
                buckets_of_param_2=len(optimizer._param_buckets[model.ps[2]]),
                params_in_buffer=_params_in_buffer(optimizer, model),
                state_dtypes={
                    str(t.dtype)
                    for b in optimizer._buckets
                    for t in (b.exp_avg, b.exp_avg_sq, b.params_shard)
                    if t is not None
                },
                scale_shapes=[tuple(b.scales.shape) for b in optimizer._buckets if b.scales is not None],
                local_fragments=[len(optimizer._local_fragments(b)) for b in optimizer._buckets],
            ),
        )
    return out


def _params_in_buffer(optimizer, model) -> bool | None:
    """Whether every trainable parameter is a view of the optimizer's parameter buffer (None: no buffer)."""
    buffer = optimizer._param_buffer
    if buffer is None:
        return None
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    trainable = [p for p in model.ps if p.requires_grad and p.numel()]
    return all(start <= p.data_ptr() < end and p.untyped_storage().data_ptr() == start for p in trainable)


def averaged_grads(step: int, world: int, micro: int = 1, grad_dtype=None) -> list[torch.Tensor]:
    total = None
    for rank in range(world):
        summed = [sum(parts) for parts in zip(*(probe_grads(step, m, rank) for m in range(micro)))]
        if grad_dtype is not None:  # a rank's local buffer holds its gradient in grad_dtype
            summed = [g.to(grad_dtype).double() for g in summed]
        total = summed if total is None else [a + b for a, b in zip(total, summed)]
    return [t / world for t in total]


def reference_probe(cfg: dict, world: int, steps: int = 3, skip_steps=(), clip=None):
    """float64 torch.optim on the averaged gradients (emulating the rounding the config implies).

    Returns (params, masters, exp_avgs, exp_avg_sqs, step count, clip norms)."""
    values = initial_values()
    dtype = cfg["param_dtype"]
    emulate = cfg.get("emulate")
    params = [nn.Parameter(v.to(dtype).double()) for v in values]
    adam_w = cfg.get("options", {}).get("adam_w_mode", True)
    cls = torch.optim.AdamW if adam_w else torch.optim.Adam
    groups = [
        dict(params=[p for i, p in enumerate(params[:GROUP_SPLIT]) if i != FROZEN], **GROUPS[0]),
        dict(params=[p for i, p in enumerate(params) if i >= GROUP_SPLIT and i != FROZEN], **GROUPS[1]),
    ]
    optimizer = cls(groups, betas=BETAS, eps=EPS)
    state_dtype = cfg.get("options", {}).get("dtype", torch.float32)
    norms = []
    count = 0
    for step in range(steps):
        if step in skip_steps:
            continue
        grads = [
            g * cfg.get("grad_mult", 1.0)
            for g in averaged_grads(step, world, cfg.get("micro", 1), cfg.get("grad_dtype"))
        ]
        for i, (p, g) in enumerate(zip(params, grads)):
            p.grad = None if i == FROZEN else g.clone()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], clip))
        optimizer.step()
        count += 1
        if emulate == "round_params":
            for p in params:
                p.data.copy_(p.data.to(dtype).double())
        if emulate in ("round_state", "round_scaled"):
            rounded = _round_scaled if emulate == "round_scaled" else lambda t, d: t.to(d).double()
            for p in params:
                p.data.copy_(rounded(p.data, state_dtype))
                for key in ("exp_avg", "exp_avg_sq"):
                    if p in optimizer.state:
                        s = optimizer.state[p][key]
                        s.copy_(rounded(s, state_dtype))
    states = [optimizer.state.get(p, {}) for p in params]
    return dict(
        masters=[p.detach().clone() for p in params],
        exp_avg=[s.get("exp_avg") for s in states],
        exp_avg_sq=[s.get("exp_avg_sq") for s in states],
        step=count,
        norms=norms,
    )


def _round_scaled(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` stored in ``dtype`` with a per-tensor scale (the largest magnitude at half of fp16's
    largest value, or at 1 for bf16), read back."""
    peak = t.abs().max().item() if t.numel() else 0.0
    if peak == 0.0:
        return torch.zeros_like(t)
    scale = peak / (torch.finfo(torch.float16).max / 2 if dtype == torch.float16 else 1.0)
    return (t / scale).to(dtype).double() * scale


# GradScaler, clipping, state dict ---------------------------------------------------------------

INF_STEP = 1  # the step whose gradient has an inf, on the last rank only
SCALER_CFG = dict(param_dtype=torch.float32, shard=32)
CLIP_CFG = dict(param_dtype=torch.float32, shard=32)
CLIP_NORM = 3.0  # below the gradients' norm (about 14): every step clips


class UnscalingGradScaler(torch.amp.GradScaler):
    """A scaler that hands unscaling to optimizers that ask for it, as NeMo's scalers do (upstream's
    ``_custom_amp_unscale_grads`` protocol)."""

    def _unscale_grads_(self, optimizer, *args):
        if getattr(optimizer, "_custom_amp_unscale_grads", False):
            return optimizer.unscale_grads(*args)
        return super()._unscale_grads_(optimizer, *args)


SCALER_CASES = {
    "fp32": SCALER_CFG,
    "fp32_unscale_first_custom_scaler": dict(SCALER_CFG, unscale_first=True),
    "bf16_fp32_master": PROBES["bf16_params_fp32_master"],
    "bf16_remainders": PROBES["bf16_params_remainders"],
    "bf16_state": PROBES["bf16_state"],
    "bf16_scaled_states": PROBES["bf16_scaled_states"],
    "fp16_scaled_states": dict(PROBES["fp16_scaled_states_tiny_grads"], grad_mult=1.0),
}


def scaler_worker(rank: int, world: int, device="cpu"):
    return {name: scaler_case(rank, world, cfg, torch.device(device)) for name, cfg in SCALER_CASES.items()}


def scaler_case(rank: int, world: int, cfg: dict, device: torch.device):
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    model = Probe(cfg["param_dtype"]).to(device)
    optimizer = DistributedFusedAdam(model.groups(), betas=BETAS, eps=EPS, device=device, **probe_options(cfg, world))
    scaler_class = UnscalingGradScaler if cfg.get("unscale_first") else torch.amp.GradScaler
    scaler = scaler_class(device.type, init_scale=2.0**10, growth_interval=1000)
    scales = []
    skipped_step_changed = None
    for step in range(4):
        grads = probe_grads(step, 0, rank)
        if step == INF_STEP and rank == world - 1:
            grads[2][5] = math.inf
        before = [p.detach().clone() for p in model.ps]
        scaler.scale(model(grads)).backward()
        if cfg.get("unscale_first"):
            scaler.unscale_(optimizer)  # the scaler's override calls optimizer.unscale_grads
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        optimizer.zero_grad()
        if step == INF_STEP:
            skipped_step_changed = [i for i, (p, b) in enumerate(zip(model.ps, before)) if not torch.equal(p, b)]
    # torch's scaler.unscale_ cannot see the shards: the step must refuse rather than skip the inf check.
    # No parameter (the empty one included) keeps a gradient, so unscale_ finds nothing to unscale
    # (on CUDA its kernel has no bf16 variant: a bf16 gradient left there would fail inside torch).
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    scaler.scale(model(probe_grads(9, 0, rank))).backward()
    grads_left = [i for i, p in enumerate(model.ps) if p.grad is not None]
    scaler.unscale_(optimizer)
    try:
        scaler.step(optimizer)
        refused = None
    except RuntimeError as error:
        refused = str(error)
    return dict(
        params=[p.detach().double().cpu() for p in model.ps],
        scales=scales,
        skipped_step_changed=skipped_step_changed,
        state=optimizer.state_dict(),
        refused=refused,
        grads_left=grads_left,
    )


def clip_worker(rank: int, world: int):
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    model = Probe(torch.float32)
    optimizer = DistributedFusedAdam(
        model.groups(), betas=BETAS, eps=EPS, device="cpu", **probe_options(CLIP_CFG, world)
    )
    norms = []
    inf_norms = []
    subset_norms = []
    for step in range(3):
        model(probe_grads(step, 0, rank)).backward()
        inf_norms.append(optimizer.grad_norm(norm_type=math.inf).item())
        # ps[5] is empty: optimized, nothing to add
        subset_norms.append(optimizer.grad_norm([model.ps[0], model.ps[2], model.ps[5]], norm_type=1.0).item())
        norms.append(optimizer.clip_grad_norm(CLIP_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
    return dict(
        params=[p.detach().double().clone() for p in model.ps],
        norms=norms,
        inf_norms=inf_norms,
        subset_norms=subset_norms,
    )


STATE_CFG = dict(param_dtype=torch.float32, shard=32)


def save_worker(rank: int, world: int):
    """Train 2 steps, save; train 2 more: (saved state dict, parameters then, final parameters)."""
    model, optimizer = train_probe(STATE_CFG, world, rank, steps=2)
    saved = optimizer.state_dict()
    saved_params = [p.detach().clone() for p in model.ps]
    train_probe(STATE_CFG, world, rank, model, optimizer, start=2, steps=2)
    return dict(saved=saved, saved_params=saved_params, final=[p.detach().double().clone() for p in model.ps])


def load_worker(rank: int, world: int, saved: dict, saved_params: list, saved_world: int):
    """Load a state dict saved at ``saved_world`` ranks and train 2 more steps on the same gradients."""
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    model = Probe(torch.float32)
    with torch.no_grad():
        for p, v in zip(model.ps, saved_params):
            p.copy_(v)
    # another bucket size too: the format does not depend on the layout
    options = probe_options(dict(STATE_CFG, shard=64), world)
    optimizer = DistributedFusedAdam(model.groups(lr=0.5), betas=(0.5, 0.5), eps=EPS, device="cpu", **options)
    optimizer.load_state_dict(saved)
    for step in (2, 3):
        # this rank's share of the gradients the saving run averaged
        grads = [g * world for g in averaged_grads(step, saved_world)] if rank == 0 else None
        if grads is None:
            grads = [torch.zeros_like(g) for g in probe_grads(step, 0, rank)]
        model(grads).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().double().clone() for p in model.ps]


SCALED_CFG = PROBES["fp16_scaled_states_tiny_grads"]


def scaled_save_load_worker(rank: int, world: int):
    """Scaled fp16 state: train 2 steps, save, train 2 more; a fresh optimizer (other bucket size)
    that loads the saved state and trains the same 2 steps must end where the first did."""
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    model, optimizer = train_probe(SCALED_CFG, world, rank, steps=2)
    saved = optimizer.state_dict()
    saved_params = [p.detach().clone() for p in model.ps]
    train_probe(SCALED_CFG, world, rank, model, optimizer, start=2, steps=2)
    final = [p.detach().double().clone() for p in model.ps]
    again = Probe(torch.float16)
    with torch.no_grad():
        for p, v in zip(again.ps, saved_params):
            p.copy_(v)
    options = probe_options(dict(SCALED_CFG, shard=64), world)
    loaded = DistributedFusedAdam(again.groups(), betas=BETAS, eps=EPS, device="cpu", **options)
    loaded.load_state_dict(saved)
    train_probe(SCALED_CFG, world, rank, again, loaded, start=2, steps=2)
    return dict(
        final=final,
        resumed=[p.detach().double().clone() for p in again.ps],
        saved_dtypes={str(v.dtype) for k, e in saved["state"].items() if k != "step" for v in e.values()},
    )


def capturable_worker(rank: int, world: int):
    """capturable=True: every group's lr becomes a device tensor, which a torch LRScheduler and
    load_state_dict update in place (a captured graph keeps reading the same tensor)."""
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    model = Probe(torch.float32)
    cfg = dict(param_dtype=torch.float32, shard=32)
    optimizer = DistributedFusedAdam(
        model.groups(), betas=BETAS, eps=EPS, device="cpu", capturable=True, **probe_options(cfg, world)
    )
    lrs = [group["lr"] for group in optimizer.param_groups]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    values = []
    for step in range(2):
        model(probe_grads(step, 0, rank)).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        values.append([float(group["lr"]) for group in optimizer.param_groups])
    same_after_scheduler = all(group["lr"] is lr for group, lr in zip(optimizer.param_groups, lrs))
    saved = optimizer.state_dict()
    for group in saved["param_groups"]:
        group["lr"] = torch.tensor(0.125)
    optimizer.load_state_dict(saved)
    return dict(
        kinds=[(type(lr).__name__, str(lr.dtype), lr.device.type, lr.dim()) for lr in lrs],
        values=values,
        same_after_scheduler=same_after_scheduler,
        same_after_load=all(group["lr"] is lr for group, lr in zip(optimizer.param_groups, lrs)),
        loaded=[float(lr) for lr in lrs],
    )


# the MLP ------------------------------------------------------------------------------------------

BATCH = 12


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 19)
        self.fc2 = nn.Linear(19, 19)
        self.out = nn.Linear(19, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def mlp_batch(step: int):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(BATCH, 5, generator=g, dtype=torch.float64), torch.randn(
        BATCH, 3, generator=g, dtype=torch.float64
    )


def mlp_model(dtype=torch.float32):
    torch.manual_seed(7)
    return Mlp().to(dtype)


def mlp_worker(rank: int, world: int, overlap_param_sync: bool, device="cpu"):
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    model = mlp_model().to(device)
    optimizer = DistributedFusedAdam(
        model.parameters(),
        lr=1e-2,
        weight_decay=0.05,
        device=device,
        bucket_cap_mb=bucket_cap_mb(64, world),
        overlap_param_sync=overlap_param_sync,
    )
    for step in range(4):
        x, y = mlp_batch(step)
        x, y = x.float().chunk(world)[rank].to(device), y.float().chunk(world)[rank].to(device)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.param_sync()
    return {n: p.detach().double().cpu() for n, p in model.named_parameters()}


def graph_worker(rank: int, world: int, device: torch.device, warmup: int = 3, replays: int = 3):
    """capturable=True on CUDA: zero_grad, forward, backward and step captured in one CUDA graph and
    replayed on new gradients, against the same steps run eagerly. Returns (graphed, eager) params."""
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    cfg = dict(param_dtype=torch.float32, shard=32)

    def build():
        model = Probe(torch.float32).to(device)
        optimizer = DistributedFusedAdam(
            model.groups(), betas=BETAS, eps=EPS, device=device, capturable=True, **probe_options(cfg, world)
        )
        return model, optimizer

    def iteration(model, optimizer, grads):
        optimizer.zero_grad()
        model(grads).backward()
        optimizer.step()

    eager_model, eager_optimizer = build()
    for step in range(warmup + replays):
        iteration(eager_model, eager_optimizer, [g.to(device) for g in probe_grads(step, 0, rank)])
    model, optimizer = build()
    static = [g.to(device) for g in probe_grads(0, 0, rank)]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for step in range(warmup):
            for buffer, g in zip(static, probe_grads(step, 0, rank)):
                buffer.copy_(g)
            iteration(model, optimizer, static)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        iteration(model, optimizer, static)
    for step in range(warmup, warmup + replays):
        for buffer, g in zip(static, probe_grads(step, 0, rank)):
            buffer.copy_(g)
        graph.replay()
    torch.cuda.synchronize(device)
    return (
        [p.detach().double().cpu() for p in model.ps],
        [p.detach().double().cpu() for p in eager_model.ps],
        float(optimizer.state["step"]),
    )


NCCL_UB_CFG = dict(param_dtype=torch.float32, shard=32, options=dict(nccl_ub=True, contiguous_grad_buffer=True))


def nccl_ub_worker(rank: int, world: int, device: torch.device):
    """The Probe with NCCL user buffers, or ("unavailable", why) where PyTorch offers no ncclMemAlloc pool."""
    try:
        model, optimizer = train_probe(NCCL_UB_CFG, world, rank, device=device)
    except RuntimeError as error:
        if "ncclMemAlloc" in str(error) or "mem_allocator" in str(error):
            return ("unavailable", str(error))
        raise
    in_pool = optimizer._nccl_pool is not None and optimizer._grad_buffer is not None
    return (
        "ran",
        dict(params=[p.detach().double().cpu() for p in model.ps], state=optimizer.state_dict(), in_pool=in_pool),
    )


def nccl_suite_worker(rank: int, world: int):
    """The Probe configurations, GradScaler cases and the MLP on ``cuda:rank`` with NCCL; a captured step."""
    device = torch.device("cuda", rank)
    return dict(
        probes=probe_worker(rank, world, list(PROBES), device=device),
        scaler=scaler_worker(rank, world, device=device),
        mlp=mlp_worker(rank, world, False, device=device),
        graph=graph_worker(rank, world, device),
        nccl_ub=nccl_ub_worker(rank, world, device),
    )


def mlp_reference():
    model = mlp_model(torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    for step in range(4):
        x, y = mlp_batch(step)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# hybrid sharding ------------------------------------------------------------------------------------


def hybrid_worker(rank: int, world: int):
    """Shard over groups of one rank each, replicate over all ranks."""
    import torch.distributed as dist

    singles = [dist.new_group([r]) for r in range(world)]
    everyone = dist.new_group(list(range(world)))
    cfg = dict(param_dtype=torch.float32, shard=32)
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    model = Probe(torch.float32, seed=INIT_SEED + rank)
    options = probe_options(cfg, 1)
    optimizer = DistributedFusedAdam(
        model.groups(),
        betas=BETAS,
        eps=EPS,
        device="cpu",
        distributed_process_group=singles[rank],
        redundant_process_group=everyone,
        **options,
    )
    train_probe(cfg, world, rank, model, optimizer, steps=3)
    return [p.detach().double().clone() for p in model.ps]


# bad arguments ---------------------------------------------------------------------------------------

BAD_ARGUMENTS = {
    "amsgrad": (dict(amsgrad=True), RuntimeError, "amsgrad"),
    "nccl_ub_without_contiguous_grads": (dict(nccl_ub=True), RuntimeError, "contiguous_grad_buffer=True"),
    "nccl_ub_on_gloo": (
        dict(nccl_ub=True, contiguous_grad_buffer=True),
        RuntimeError,
        "NCCL distributed_process_group",
    ),
    "scaled_states_fp32_state": (dict(with_scaled_states=True), RuntimeError, "dtype=torch.float16 or"),
    "scaled_states_without_store_params": (
        dict(SCALED_BF16, store_params=False),
        RuntimeError,
        "with_scaled_states=True needs store_params=True",
    ),
    "scaled_states_fp32_param_sync": (
        dict(SCALED_BF16, param_sync_dtype=torch.float32),
        RuntimeError,
        "param_sync_dtype=torch.float32",
    ),
    "dtype": (dict(dtype=torch.float64), ValueError, "dtype"),
    "grad_sync_dtype": (dict(grad_sync_dtype=torch.int32), ValueError, "grad_sync_dtype"),
    "param_sync_dtype": (dict(param_sync_dtype=torch.float64), ValueError, "param_sync_dtype"),
    "remainders_with_store_params": (dict(store_param_remainders=True), RuntimeError, "store_params"),
    "remainders_without_bf16_sync": (
        dict(store_param_remainders=True, store_params=False),
        RuntimeError,
        "param_sync_dtype",
    ),
    "remainders_with_fp32_params": (
        dict(store_param_remainders=True, store_params=False, param_sync_dtype=torch.bfloat16),
        RuntimeError,
        "bf16 parameters",
    ),
    "bucket_cap_mb": (dict(bucket_cap_mb=0), ValueError, "bucket_cap_mb"),
    "pipeline_size": (dict(pipeline_size=0), ValueError, "pipeline_size"),
    "lr": (dict(lr=-1.0), ValueError, "lr"),
    "eps": (dict(eps=float("nan")), ValueError, "eps"),
    "weight_decay": (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    "betas": (dict(betas=(0.9, 1.0)), ValueError, "betas"),
    "device": (dict(device="meta"), ValueError, "device"),
    "cuda_device": (dict(device="cuda"), ValueError, "device"),
    "process_groups": ("redundant", RuntimeError, "redundant_process_group"),
    "contiguous_param_buffer_mixed_dtypes": ("mixed", ValueError, "contiguous_param_buffer"),
}


def bad_arguments_worker(rank: int, world: int):
    import torch.distributed as dist

    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    out = {}
    for name, (kwargs, _, _) in BAD_ARGUMENTS.items():
        model = Probe(torch.float32)
        if kwargs == "redundant":
            kwargs = dict(redundant_process_group=dist.new_group(list(range(world))))
        if kwargs == "mixed":
            kwargs = dict(contiguous_param_buffer=True)
            model.ps[0].data = model.ps[0].data.bfloat16()
        if name == "cuda_device" and torch.cuda.is_available():
            out[name] = ("skipped", "CUDA is available")
            continue
        try:
            DistributedFusedAdam(model.parameters(), **{"device": "cpu", **kwargs})
            out[name] = ("no error", "")
        except Exception as error:
            out[name] = (type(error).__name__, str(error))
    # bad input after construction
    model = Probe(torch.float32)
    optimizer = DistributedFusedAdam(model.parameters(), device="cpu")
    for name, call in (
        ("grad_buffer_view", lambda: optimizer.grad_buffer_view(model.ps[0])),
        ("state_dict_format", lambda: optimizer.state_dict(state_dict_format=1)),
        ("load_format", lambda: optimizer.load_state_dict({"state": {}, "param_groups": []})),
        ("grad_norm", lambda: optimizer.grad_norm(norm_type=0.0)),
        ("grad_norm_foreign_parameter", lambda: optimizer.grad_norm([torch.nn.Parameter(torch.ones(2))])),
        ("init_param_buffer", lambda: optimizer.init_param_buffer()),
        ("add_param_group", lambda: optimizer.add_param_group(dict(params=[torch.nn.Parameter(torch.ones(2))]))),
    ):
        try:
            call()
            out[name] = ("no error", "")
        except Exception as error:
            out[name] = (type(error).__name__, str(error))
    return out


def overlap_worker(rank: int, world: int):
    """How many buckets began their reduce-scatter during backward; the norm after zero_grad."""
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    out = {}
    for case in ("overlap", "no_overlap", "no_sync"):
        model = Probe(torch.float32)
        options = probe_options(dict(shard=32, options=dict(overlap_grad_sync=case != "no_overlap")), world)
        optimizer = DistributedFusedAdam(model.parameters(), device="cpu", **options)
        context = optimizer.no_sync() if case == "no_sync" else contextlib.nullcontext()
        with context:
            model(probe_grads(0, 0, rank)).backward()
        started = sum(b.grad_sync is not None or b.grads_shard is not None for b in optimizer._buckets)
        if case == "no_sync":  # a pass after no_sync: each bucket reduced once, as soon as it fills
            launches = []
            start = optimizer._start_grad_sync
            optimizer._start_grad_sync = functools.partial(_record_launch, launches, start)
            model(probe_grads(0, 1, rank)).backward()
            out["after_no_sync_launches"] = launches
            with pytest_raises(NotImplementedError, "add_param_group"):
                optimizer.add_param_group(dict(params=[torch.nn.Parameter(torch.ones(3))]))
        norm = optimizer.grad_norm().item()
        optimizer.zero_grad()
        out[case] = dict(
            started=started,
            buckets=len(optimizer._buckets),
            norm=norm,
            norm_after_zero_grad=optimizer.grad_norm().item(),
        )
    return out


def misc_worker(rank: int, world: int):
    """A tensor lr, a closure, and a learning rate changed between steps (as a scheduler does)."""
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    cfg = dict(param_dtype=torch.float32, shard=32)
    out = {}
    for form in ("float", "tensor"):
        model = Probe(torch.float32)
        groups = model.groups()
        if form == "tensor":
            for group in groups:
                group["lr"] = torch.tensor(group["lr"])
        optimizer = DistributedFusedAdam(groups, betas=BETAS, eps=EPS, device="cpu", **probe_options(cfg, world))
        losses = []
        for step in range(3):
            grads = probe_grads(step, 0, rank)

            def closure(grads=grads, model=model):
                loss = model(grads)
                loss.backward()
                return loss

            losses.append(float(optimizer.step(closure)))
            optimizer.zero_grad()
        out[form] = dict(params=[p.detach().double().clone() for p in model.ps], losses=losses)
    before = [p.detach().clone() for p in model.ps]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    model(probe_grads(5, 0, rank)).backward()
    optimizer.step()
    out["unchanged_with_lr_0"] = all(torch.equal(p, b) for p, b in zip(model.ps, before))
    return out


def _record_launch(launches: list, start, bucket) -> None:
    launches.append(bucket.index)
    start(bucket)


@contextlib.contextmanager
def pytest_raises(kind, words: str):
    try:
        yield
    except kind as error:
        assert words in str(error), str(error)
    else:
        raise AssertionError(f"no {kind.__name__} raised")


# everything one world size runs, in one set of processes (starting ranks is the slow part) ----------


def suite_worker(rank: int, world: int, saved=None):
    """Every check at ``world`` ranks; ``saved``: (state dict, parameters, world) to load and continue."""
    out = dict(
        probes=probe_worker(rank, world, list(PROBES)),
        mlp={flag: mlp_worker(rank, world, flag) for flag in (False, True)},
    )
    if world == 2:
        out.update(
            scaler=scaler_worker(rank, world),
            clip=clip_worker(rank, world),
            save=save_worker(rank, world),
            hybrid=hybrid_worker(rank, world),
            bad=bad_arguments_worker(rank, world),
            overlap=overlap_worker(rank, world),
            misc=misc_worker(rank, world),
            scaled_save_load=scaled_save_load_worker(rank, world),
            capturable=capturable_worker(rank, world),
        )
    if saved is not None:
        out["load"] = load_worker(rank, world, *saved)
    return out
