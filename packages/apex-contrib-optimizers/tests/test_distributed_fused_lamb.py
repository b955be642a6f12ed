"""DistributedFusedLAMB on real gloo process groups (two ranks) against single-process float64 LAMB
on the averaged gradients; the distributed_lamb_cuda legacy functions and their ops."""

from __future__ import annotations

from pathlib import Path

import distributed_lamb_cuda
import pytest
import torch

from apex.contrib.optimizers import _ops
from apex.core.testing import run_ranks

from ._dlamb_workers import HYPER, SHAPES, STEPS, initial_params, rank_grads
from ._reference import ReferenceLAMB

WORKERS = str(Path(__file__).with_name("_dlamb_workers.py"))


def reference(world_size, max_grad_norm, skip_step=None):
    params = initial_params()
    ref = ReferenceLAMB([(params[:2], 0.05), (params[2:], 0.0)], max_grad_norm=max_grad_norm, **HYPER)
    for step in range(STEPS):
        if step == skip_step:
            continue
        per_rank = [rank_grads(r, step) for r in range(world_size)]
        averaged = [sum(g[i].double() for g in per_rank) / world_size for i in range(len(SHAPES))]
        ref.step([averaged[:2], averaged[2:]])
    return ref.groups[0][0] + ref.groups[1][0]


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
}


def check_against_reference(results):
    for index, (name, (kwargs, loss_scale, bad_step, scale_by)) in enumerate(CONFIGS.items()):
        expected = reference(2, kwargs["max_grad_norm"], skip_step=bad_step)
        for params, steps, final_scale in (rank_results[index] for rank_results in results):
            # An overflow on any rank skips the step on every rank; the counter does not advance.
            assert steps == STEPS - (bad_step is not None), name
            for p, e in zip(params, expected):
                torch.testing.assert_close(p.double(), e, rtol=1e-5, atol=1e-6, msg=name)
            if scale_by == "grad_scaler":  # the overflow reached the scaler: it backed off once
                assert final_scale == (loss_scale / 2 if bad_step is not None else loss_scale), name
        for a, b in zip(results[0][index][0], results[1][index][0]):
            assert torch.equal(a, b), name


def test_two_ranks_match_single_process_lamb_on_the_averaged_gradients():
    check_against_reference(run_ranks(WORKERS, "train_all", 2, backend="gloo", args=(list(CONFIGS.values()),)))


@pytest.mark.multigpu
def test_two_gpus_over_nccl_match_single_process_lamb():
    configs = list(CONFIGS.values())
    check_against_reference(run_ranks(WORKERS, "train_all", 2, backend="nccl", args=(configs, "cuda")))


def test_state_dict_round_trip():
    for equal in run_ranks(WORKERS, "resume", 2, backend="gloo"):
        assert all(equal)


def test_unsupported_arguments_raise_naming_them():
    messages = run_ranks(WORKERS, "refuse", 1, backend="gloo")[0]
    for name in ("e5m2_allgather", "dwu_group_size=3", "clip_after_ar=False", "skip_allgather", "dwu_num_blocks",
                 "lr=-1.0"):  # fmt: skip
        assert any(name in m for m in messages), (name, messages)
    assert len(messages) == 6


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
