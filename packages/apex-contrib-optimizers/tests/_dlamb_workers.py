"""DistributedFusedLAMB's rank functions for test_distributed_fused_lamb.py, loaded by path in each
rank's process (run_ranks), so nothing here imports relatively."""

from __future__ import annotations

import math

import torch

SHAPES = [(7,), (33, 5), (101,), (1,)]
# eps large enough that the gradients' scale (averaging, loss scale, clipping) shows in the update: LAMB is
# otherwise invariant to it.
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=0.1, adam_w_mode=True, grad_averaging=True)
STEPS = 3


def initial_params():
    generator = torch.Generator().manual_seed(1234)
    return [torch.randn(s, generator=generator, dtype=torch.float64).float() for s in SHAPES]


def rank_grads(rank, step):
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(s, generator=generator, dtype=torch.float64).float() for s in SHAPES]


def _build(rank, kwargs, device="cpu"):
    from apex.contrib.optimizers.distributed_fused_lamb import DistributedFusedLAMB

    torch.manual_seed(rank)  # rank 1 starts elsewhere: the broadcast from rank 0 must fix it
    starts = [p if rank == 0 else torch.randn_like(p) for p in initial_params()]
    params = [torch.nn.Parameter(p.to(device)) for p in starts]
    groups = [{"params": params[:2], "weight_decay": 0.05}, {"params": params[2:], "weight_decay": 0.0}]
    return params, DistributedFusedLAMB(groups, **kwargs)


def train_all(rank, world_size, configs, device="cpu"):
    """Each (kwargs, loss_scale, bad_step, how the scale is given) of ``configs`` trained from the same
    start, in one process group. NCCL: rank r on cuda:r."""
    if device == "cuda":
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    return [train(rank, *config, device=device) for config in configs]


def hierarchical(rank, world_size, configs):
    """A dwu_group_size that does not divide the world size is refused on every rank (before any collective),
    then ``configs`` trained as by :func:`train_all`."""
    from apex.contrib.optimizers.distributed_fused_lamb import DistributedFusedLAMB

    try:
        DistributedFusedLAMB([torch.nn.Parameter(torch.randn(3))], dwu_group_size=world_size - 1)
        refused = None
    except ValueError as error:
        refused = str(error)
    return refused, train_all(rank, world_size, configs)


def train(rank, kwargs, loss_scale, bad_step=None, scale_by="set_global_scale", device="cpu"):
    """``scale_by``: "set_global_scale", "grad_scaler" (torch.amp.GradScaler.step) or "upstream_loop".
    Returns the final parameters, the step counter, the scaler's final scale, the last step's L2_grad_norm,
    this rank's fp32 masters and the parameters after the first step."""
    params, opt = _build(rank, kwargs, device)
    after_first = None
    scaler = None
    if scale_by == "grad_scaler":
        scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=loss_scale, growth_interval=1000)
        scaler.scale(torch.ones((), device=device))  # as scaler.scale(loss) would: the scale exists from here
    for step in range(STEPS):
        grads = rank_grads(rank, step)
        if step == bad_step and rank == 1:
            grads[2][3] = math.inf
        scale = loss_scale if scaler is None else scaler.get_scale()  # the scaler's current scale
        if scale_by == "upstream_loop":
            # Upstream's MLPerf-style loop: backward writes the gradients, zero_grad() comes before
            # complete_reductions(), the learning rate goes in as optimizer._lr.
            loss = sum((p * g.to(device)).sum() for p, g in zip(params, grads)) * scale
            opt._lazy_init_stage1()
            loss.backward()
            opt._lazy_init_stage2()
            opt.zero_grad()
            opt._lr = torch.tensor(HYPER["lr"], device=device)  # the groups say lr=0.5: _lr must win
            opt.complete_reductions()
            opt.set_global_scale(scale)
            opt.step()
            after_first = after_first or [p.detach().cpu().clone() for p in params]
            continue
        for p, g in zip(params, grads):
            p.grad = (g * scale).to(device)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            if loss_scale != 1.0:
                opt.set_global_scale(loss_scale)
            opt.complete_reductions()
            opt.step()
        opt.zero_grad()
        after_first = after_first or [p.detach().cpu().clone() for p in params]
    final_scale = None if scaler is None else float(scaler.get_scale())
    final = [p.detach().cpu().clone() for p in params]
    masters = opt.state_dict()["fp32_p"].cpu()
    return final, int(opt._step.item()), final_scale, float(opt.L2_grad_norm), masters, after_first


def resume(rank, world_size):
    kwargs = dict(HYPER, max_grad_norm=1.0)
    params, opt = _build(rank, kwargs)
    for step in range(2):
        for p, g in zip(params, rank_grads(rank, step)):
            p.grad = g
        opt.step()
    saved = opt.state_dict()
    twin, resumed = _build(rank, dict(kwargs, lr=0.5))
    for p, t in zip(params, twin):
        t.data.copy_(p.data)
    resumed.load_state_dict(saved)
    for ps, o in ((params, opt), (twin, resumed)):
        for p, g in zip(ps, rank_grads(rank, 2)):
            p.grad = g
        o.param_groups[0]["lr"] = o.param_groups[1]["lr"] = 1e-2
        o.step()
    return [torch.equal(p, t) for p, t in zip(params, twin)]


def refuse(rank, world_size):
    from apex.contrib.optimizers.distributed_fused_lamb import DistributedFusedLAMB

    messages = []
    for kwargs in (dict(dwu_group_size=3), dict(e5m2_allgather=True, set_param_views_to_flat_buffer=True),
                   dict(dwu_num_blocks=0), dict(lr=-1.0)):  # fmt: skip
        try:
            DistributedFusedLAMB([torch.nn.Parameter(torch.randn(3))], **kwargs)
        except ValueError as error:
            messages.append(str(error))
    return messages
