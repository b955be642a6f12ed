"""DistributedFusedLAMB on real gloo process groups (two ranks; four for the hierarchical reduction)
against single-process float64 LAMB on the averaged gradients; the distributed_lamb_cuda legacy functions
and their ops."""

from __future__ import annotations

import math
from pathlib import Path

import distributed_lamb_cuda
import pytest
import torch

from apex.contrib.optimizers import _ops
from apex.core.testing import run_ranks

from ._dlamb_workers import HYPER, SHAPES, STEPS, initial_params, rank_grads
from ._reference import ReferenceLAMB

WORKERS = str(Path(__file__).with_name("_dlamb_workers.py"))
SIZES = [math.prod(s) for s in SHAPES]


def local_clip(grads, max_grad_norm):
    """Upstream's clipping before the reduction, on one rank's gradients: by min(1, max / (1e-6 + norm))."""
    if max_grad_norm <= 0:
        return [g.double() for g in grads]
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    return [g.double() * min(1.0, max_grad_norm / (1e-6 + norm)) for g in grads]


def reference(world_size, kwargs, skip_step=None):
    """Float64 LAMB on the gradients averaged over ``world_size`` ranks (each rank's clipped first with
    ``clip_after_ar=False``); the final parameters and the last step's expected L2_grad_norm per rank
    (before the loss scale)."""
    max_grad_norm = kwargs["max_grad_norm"]
    clip_before = kwargs.get("clip_after_ar", True) is False
    params = initial_params()
    ref = ReferenceLAMB(
        [(params[:2], 0.05), (params[2:], 0.0)], max_grad_norm=0.0 if clip_before else max_grad_norm, **HYPER
    )
    for step in range(STEPS):
        per_rank = [rank_grads(r, step) for r in range(world_size)]
        if clip_before:
            norms = [math.sqrt(sum(float(g.double().square().sum()) for g in gs)) for gs in per_rank]
            per_rank = [local_clip(gs, max_grad_norm) for gs in per_rank]
        averaged = [sum(g[i].double() for g in per_rank) / world_size for i in range(len(SHAPES))]
        if not clip_before:
            norms = [math.sqrt(sum(float(g.square().sum()) for g in averaged))] * world_size
        if step != skip_step:
            ref.step([averaged[:2], averaged[2:]])
    return ref.groups[0][0] + ref.groups[1][0], norms


def unflatten(flat):
    return list(torch.split(flat[: sum(SIZES)], SIZES))


def e5m2_rounded(t):
    return _ops.from_e5m2(_ops.to_e5m2(t)).to(t.dtype)


CONFIGS = {  # name: (kwargs, loss scale, step with an inf gradient on rank 1, how the scale is given)
    "no clipping": (dict(HYPER, max_grad_norm=0.0), 1.0, None, "set_global_scale"),
    "clipping": (dict(HYPER, max_grad_norm=1.0), 1.0, None, "set_global_scale"),
    "loss scale": (dict(HYPER, max_grad_norm=0.0), 64.0, None, "set_global_scale"),
    "loss scale and clipping, param views": (
        dict(HYPER, max_grad_norm=1.0, set_param_views_to_flat_buffer=True),
        64.0,
        None,
        "set_global_scale",
    ),
    "overflow on one rank": (dict(HYPER, max_grad_norm=1.0), 1.0, 1, "set_global_scale"),
    "GradScaler": (dict(HYPER, max_grad_norm=1.0), 64.0, None, "grad_scaler"),
    "GradScaler, overflow on one rank": (dict(HYPER, max_grad_norm=1.0), 64.0, 1, "grad_scaler"),
    "upstream's loop": (dict(HYPER, max_grad_norm=1.0, lr=0.5), 32.0, None, "upstream_loop"),
    # clip_after_ar=False: each rank clips its own gradients by their norm before the reduction.
    "clip before the reduction": (dict(HYPER, max_grad_norm=1.0, clip_after_ar=False), 1.0, None, "set_global_scale"),
    "clip before, fused_norm, loss scale": (
        dict(HYPER, max_grad_norm=1.0, clip_after_ar=False, fused_norm=True),
        64.0,
        None,
        "set_global_scale",
    ),
    "clip before, max_grad_norm=0": (
        dict(HYPER, max_grad_norm=0.0, clip_after_ar=False),
        1.0,
        None,
        "set_global_scale",
    ),
    "clip before, overflow on one rank": (
        dict(HYPER, max_grad_norm=1.0, clip_after_ar=False),
        1.0,
        1,
        "set_global_scale",
    ),
    "clip before, GradScaler": (dict(HYPER, max_grad_norm=1.0, clip_after_ar=False), 64.0, None, "grad_scaler"),
    # e5m2_allgather: the model's parameters are the masters rounded to e5m2; the masters are fp32 LAMB.
    "e5m2 all-gather": (dict(HYPER, max_grad_norm=1.0, e5m2_allgather=True), 1.0, None, "set_global_scale"),
    "e5m2, overflow at the first step": (
        dict(HYPER, max_grad_norm=1.0, e5m2_allgather=True),
        16.0,
        0,
        "set_global_scale",
    ),
    # skip_allgather: the parameters keep their values; the masters move.
    "skip all-gather": (dict(HYPER, max_grad_norm=1.0, skip_allgather=True), 1.0, None, "set_global_scale"),
    "skip all-gather, param views": (
        dict(HYPER, max_grad_norm=1.0, skip_allgather=True, set_param_views_to_flat_buffer=True),
        1.0,
        None,
        "set_global_scale",
    ),
}

# Four ranks: the hierarchical reduction (groups of two, of one) against the flat one and the reference.
HIERARCHICAL = {
    "flat": (dict(HYPER, max_grad_norm=1.0), 1.0, None, "set_global_scale"),
    "groups of 2": (dict(HYPER, max_grad_norm=1.0, dwu_group_size=2), 1.0, None, "set_global_scale"),
    "groups of 2, no clipping, loss scale, param views": (
        dict(HYPER, max_grad_norm=0.0, dwu_group_size=2, set_param_views_to_flat_buffer=True),
        64.0,
        None,
        "set_global_scale",
    ),
    "groups of 2, overflow on one rank": (
        dict(HYPER, max_grad_norm=1.0, dwu_group_size=2),
        1.0,
        1,
        "set_global_scale",
    ),
    "groups of 2, GradScaler, overflow": (dict(HYPER, max_grad_norm=1.0, dwu_group_size=2), 64.0, 1, "grad_scaler"),
    "groups of 2, upstream's loop": (
        dict(HYPER, max_grad_norm=1.0, dwu_group_size=2, lr=0.5),
        32.0,
        None,
        "upstream_loop",
    ),
    "groups of 2, clip before": (
        dict(HYPER, max_grad_norm=1.0, dwu_group_size=2, clip_after_ar=False),
        64.0,
        None,
        "set_global_scale",
    ),
    "groups of 2, e5m2": (
        dict(HYPER, max_grad_norm=1.0, dwu_group_size=2, e5m2_allgather=True),
        1.0,
        None,
        "set_global_scale",
    ),
    "groups of 1": (dict(HYPER, max_grad_norm=1.0, dwu_group_size=1), 1.0, None, "set_global_scale"),
}


def check_against_reference(results, configs, world_size):
    """Every rank's parameters, step count, loss scale, L2_grad_norm and masters against float64 LAMB."""
    initial = initial_params()
    for index, (name, (kwargs, loss_scale, bad_step, scale_by)) in enumerate(configs.items()):
        expected, norms = reference(world_size, kwargs, skip_step=bad_step)
        group_size = kwargs.get("dwu_group_size", 0) or world_size
        ranks = [rank_results[index] for rank_results in results]
        # This rank's shard of the masters: rank r holds shard r % group_size, the same in every group.
        masters = unflatten(torch.cat([ranks[r][4] for r in range(group_size)]))
        for r, (params, steps, final_scale, l2_norm, shard, after_first) in enumerate(ranks):
            # An overflow on any rank skips the step on every rank; the counter does not advance.
            assert steps == STEPS - (bad_step is not None), name
            assert torch.equal(shard, ranks[r % group_size][4]), name
            for m, e in zip(masters, expected):
                torch.testing.assert_close(m.double(), e.reshape(-1), rtol=1e-5, atol=1e-6, msg=name)
            if kwargs.get("skip_allgather"):  # nothing written into the model: rank 0's broadcast start
                assert all(torch.equal(p, i) for p, i in zip(params, initial)), name
            elif kwargs.get("e5m2_allgather"):
                for p, m in zip(params, masters):
                    assert torch.equal(p.reshape(-1), e5m2_rounded(m)), name
                    torch.testing.assert_close(p.reshape(-1), m, rtol=0.125, atol=2**-14, msg=name)
                if bad_step == 0:  # the skipped step left the parameters as they were, unrounded
                    assert all(torch.equal(p, i) for p, i in zip(after_first, initial)), name
            else:
                for p, e in zip(params, expected):
                    torch.testing.assert_close(p.double(), e, rtol=1e-5, atol=1e-6, msg=name)
            if scale_by == "grad_scaler":  # the overflow reached the scaler: it backed off once
                assert final_scale == (loss_scale / 2 if bad_step is not None else loss_scale), name
            else:  # the averaged gradients' norm, or (clip_after_ar=False) this rank's own
                assert math.isclose(l2_norm, loss_scale * norms[r], rel_tol=1e-5), (name, r, l2_norm)
        for rank_results in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(results[0][index][0], rank_results[index][0])), name


def test_two_ranks_match_single_process_lamb_on_the_averaged_gradients():
    results = run_ranks(WORKERS, "train_all", 2, backend="gloo", args=(list(CONFIGS.values()),))
    check_against_reference(results, CONFIGS, 2)
    # Clipping before the reduction is another rule than after it: the test tells them apart.
    names = list(CONFIGS)
    before, after = names.index("clip before the reduction"), names.index("clipping")
    assert not torch.allclose(results[0][before][0][1], results[0][after][0][1], rtol=1e-4, atol=0)


def test_hierarchical_reduction_matches_the_flat_one_on_four_ranks():
    results = run_ranks(WORKERS, "hierarchical", 4, backend="gloo", args=(list(HIERARCHICAL.values()),))
    for refused, _ in results:
        assert refused is not None and "dwu_group_size=3 must divide the world size (4)" in refused, refused
    results = [trained for _, trained in results]
    check_against_reference(results, HIERARCHICAL, 4)
    flat, grouped = (list(HIERARCHICAL).index(name) for name in ("flat", "groups of 2"))
    for a, b in zip(results[0][flat][0], results[0][grouped][0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.multigpu
def test_two_gpus_over_nccl_match_single_process_lamb():
    configs = list(CONFIGS.values())
    check_against_reference(run_ranks(WORKERS, "train_all", 2, backend="nccl", args=(configs, "cuda")), CONFIGS, 2)


def test_state_dict_round_trip():
    for equal in run_ranks(WORKERS, "resume", 2, backend="gloo"):
        assert all(equal)


def test_bad_arguments_raise_naming_them():
    messages = run_ranks(WORKERS, "refuse", 1, backend="gloo")[0]
    for name in ("dwu_group_size=3 must divide the world size (1)", "set_param_views_to_flat_buffer",
                 "dwu_num_blocks", "lr=-1.0"):  # fmt: skip
        assert any(name in m for m in messages), (name, messages)
    assert len(messages) == 4


# distributed_lamb_cuda ---------------------------------------------------------------------------------


def per_tensor(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def lamb_inputs(n=3, decay=(0.05, 0.0, 0.05)):
    torch.manual_seed(3)
    p = [torch.randn(s) for s in [(5,), (17,), (2, 3)][:n]]
    g = [torch.randn_like(t) for t in p]
    m = [torch.randn_like(t) * 0.1 for t in p]
    v = [torch.rand_like(t) * 0.1 for t in p]
    u = [torch.full_like(t, float("nan")) for t in p]
    betas = (per_tensor([0.9] * n), per_tensor([0.99] * n), per_tensor([0.1] * n))
    hyper = (*betas, per_tensor([1] * n, torch.int32), torch.tensor([2], dtype=torch.int32), per_tensor([1e-6] * n))
    return p, g, m, v, u, hyper, per_tensor(list(decay[:n]))


@pytest.mark.parametrize("mode", [0, 1])
def test_update_term_and_weights_match_float64(mode):
    p, g, m, v, u, hyper, decay = lamb_inputs()
    scale, norm, max_norm = 16.0, 40.0, 1.0
    p0, g0, m0, v0 = ([t.double().clone() for t in ts] for ts in (p, g, m, v))
    flag = torch.zeros(1, dtype=torch.int32)
    distributed_lamb_cuda.multi_tensor_lamb_compute_update_term(
        2048, flag, [g, p, m, v, u], *hyper, mode, decay, torch.tensor([scale]), torch.tensor([norm]), max_norm
    )
    copies = [torch.empty_like(t, dtype=torch.float16) for t in p]
    param_norms = torch.stack([t.norm() for t in p])
    update_norms = torch.stack([t.norm() for t in u])
    distributed_lamb_cuda.multi_tensor_lamb_update_weights(
        2048, flag, [u, p, copies], param_norms, update_norms, torch.arange(3), torch.tensor([0.01]), decay,
        torch.tensor([norm]), False,
    )  # fmt: skip
    divisor = scale * max(1.0, (norm / scale + 1e-6) / max_norm)
    for i in range(3):
        wd = float(decay[i])
        grad = g0[i] / divisor + (wd * p0[i] if mode == 0 else 0)
        mi = 0.9 * m0[i] + 0.1 * grad
        vi = 0.99 * v0[i] + 0.01 * grad * grad
        ui = (mi / (1 - 0.9**2)) / ((vi / (1 - 0.99**2)).sqrt() + 1e-6) + (wd * p0[i] if mode == 1 else 0)
        ratio = float(p0[i].norm() / ui.norm()) if wd else 1.0
        expected = p0[i] - 0.01 * ratio * ui
        torch.testing.assert_close(m[i].double(), mi, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(u[i].double(), ui, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p[i].double(), expected, rtol=1e-5, atol=1e-6)
        assert torch.equal(copies[i], p[i].half())


def test_noop_flag_skips_both_stages():
    p, g, m, v, u, hyper, decay = lamb_inputs()
    before = [t.clone() for t in p + m + v]
    flag = torch.ones(1, dtype=torch.int32)
    _ops.lamb_compute_update_term(flag, g, p, m, v, u, *hyper, 1, decay, torch.ones(1), torch.ones(1), 0.0)
    assert all(bool(t.isnan().all()) for t in u)
    u = [torch.randn_like(t) for t in p]
    _ops.lamb_update_weights(flag, u, p, [t.clone() for t in p], torch.ones(3), torch.ones(3), torch.arange(3),
                             torch.ones(1), decay, torch.ones(1), True)  # fmt: skip
    for a, b in zip(p + m + v, before):
        assert torch.equal(a, b)


def test_lamb_ops_bad_input_and_opcheck():
    p, g, m, v, u, hyper, decay = lamb_inputs()
    flag = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^lamb_compute_update_term: beta1 must be a 1-D"):
        _ops.lamb_compute_update_term(flag, g, p, m, v, u, torch.ones(2), *hyper[1:], 1, decay, torch.ones(1),
                                      torch.ones(1), 0.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"^lamb_compute_update_term: moment_mode must be 0"):
        _ops.lamb_compute_update_term(flag, g, p, m, v, u, *hyper, 2, decay, torch.ones(1), torch.ones(1), 0.0)
    with pytest.raises(TypeError, match=r"^lamb_update_weights: u\[0\] has dtype torch.float16"):
        _ops.lamb_update_weights(flag, [t.half() for t in u], p, p, torch.ones(3), torch.ones(3), torch.arange(3),
                                 torch.ones(1), decay, torch.ones(1), False)  # fmt: skip
    torch.library.opcheck(
        _ops.lamb_compute_update_term, (flag, g, p, m, v, u, *hyper, 1, decay, torch.ones(1) * 4, torch.ones(1), 1.0)
    )
    copies = [torch.empty_like(t, dtype=torch.uint8) for t in p]
    torch.library.opcheck(
        _ops.lamb_update_weights,
        (flag, [t.nan_to_num() for t in u], p, copies, torch.ones(3), torch.ones(3), torch.arange(3), torch.ones(1),
         decay, torch.ones(1), True),
    )  # fmt: skip
