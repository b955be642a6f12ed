"""DistributedFusedAdam on real gloo process groups (1, 2 and 3 ranks) against float64 torch.optim,
its ops against float64 references and opcheck, and the distributed_adam_cuda legacy module.

The workers and references are in ``_dfa_ranks.py`` (see its docstring for the two models).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from apex.contrib.optimizers import _distributed_adam_ops as ops
from apex.core.testing import once_per_run, run_ranks

from . import _dfa_ranks as R

RANKS = Path(R.__file__)
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
BF16_TOL = dict(rtol=1.6e-2, atol=1e-5)
FP16_TOL = dict(rtol=1e-3, atol=1e-5)
TIMEOUT = 240


def _run_suite():
    results = {2: run_ranks(RANKS, "suite_worker", 2, timeout=TIMEOUT)}
    save = results[2][0]["save"]
    for world in (1, 3):
        args = ((save["saved"], save["saved_params"], 2),)
        results[world] = run_ranks(RANKS, "suite_worker", world, args=args, timeout=TIMEOUT)
    return results


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """Per world size (1, 2, 3), every rank's results of ``_dfa_ranks.suite_worker``: one set of
    processes per world size, once per run (about 20 s on two CPU cores, a minute on a machine shared
    by 14 xdist workers). The state dict saved at 2 ranks is loaded at 1 and 3."""
    return once_per_run("distributed_fused_adam_suite", tmp_path_factory, _run_suite)


@pytest.fixture(scope="module")
def probes(suite):
    return {world: [r["probes"] for r in per_rank] for world, per_rank in suite.items()}


def _tol(cfg):
    if "tol" in cfg:
        return dict(rtol=cfg["tol"], atol=cfg["tol"])
    if cfg.get("grad_dtype") is not None:
        return dict(rtol=1e-2, atol=1e-3)
    return {torch.float32: FP32_TOL, torch.bfloat16: BF16_TOL, torch.float16: FP16_TOL}[cfg["param_dtype"]]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", list(R.PROBES))
def test_probe_matches_torch_adam_on_averaged_gradients(probes, name, world):
    check_probe(name, world, [per_rank[name] for per_rank in probes[world]])


def check_probe(name, world, results):
    cfg = R.PROBES[name]
    ref = R.reference_probe(cfg, world, steps=cfg.get("steps", 3))
    initial = R.initial_values()
    for rank, out in enumerate(results):
        state = out["state"]
        assert state["format"] == 2 and state["state"]["step"] == ref["step"]
        assert out["grads_none"], "gradients must live in the optimizer's shards, not in param.grad"
        contiguous = cfg.get("options", {}).get("contiguous_param_buffer", False)
        assert out["layout"]["params_in_buffer"] is (True if contiguous else None)
        for i, (p, master) in enumerate(zip(out["params"], ref["masters"])):
            where = f"{name} world {world} rank {rank} param {i}"
            if i == R.FROZEN:
                frozen = initial[i].to(cfg["param_dtype"]).double()
                torch.testing.assert_close(p, frozen, rtol=0, atol=0, msg=where + " (frozen) changed")
                assert i not in state["state"]
                continue
            if p.numel() == 0:
                continue
            assert not torch.equal(p, initial[i].to(cfg["param_dtype"]).double()), where + " did not move"
            saved = state["state"][i]
            if cfg.get("master"):
                # the fp32 masters follow fp32 AdamW; the parameters are the masters rounded
                torch.testing.assert_close(saved["param"].double(), master, **FP32_TOL, msg=where)
                if cfg.get("remainders"):
                    rounded, _ = ops.fp32_to_bf16_and_remainder(saved["param"].float())
                    torch.testing.assert_close(p, rounded.double(), rtol=0, atol=0, msg=where)
                else:
                    torch.testing.assert_close(p, saved["param"].to(cfg["param_dtype"]).double(), rtol=0, atol=0)
            else:
                torch.testing.assert_close(p, master, **_tol(cfg), msg=where)
            # in units of the gradients' scale (grad_mult), so that the tolerances mean the same
            mult = cfg.get("grad_mult", 1.0)
            for key, unit in (("exp_avg", mult), ("exp_avg_sq", mult * mult)):
                torch.testing.assert_close(
                    saved[key].double() / unit, ref[key][i] / unit, **_tol_state(cfg), msg=f"{where} {key}"
                )
        for rank_params in results[1:]:
            for a, b in zip(results[0]["params"], rank_params["params"]):
                assert torch.equal(a, b), f"{name}: ranks disagree"


def _tol_state(cfg):
    # moments of about 0.5: a bf16 ulp of them (rounded state), or of the gradients (bf16 sums)
    if cfg.get("emulate") in ("round_state", "round_scaled"):
        return dict(rtol=2e-2, atol=8e-3)
    if cfg.get("grad_dtype") is not None:
        return dict(rtol=1e-2, atol=4e-3)
    return dict(rtol=1e-5, atol=1e-7)


def test_tiny_gradients_need_the_scaled_state():
    """The tiny-gradient probe means something: fp16 state without scaling loses exp_avg_sq entirely
    there (the reference emulating it holds zeros), while the scaled state's reference does not."""
    cfg = R.PROBES["fp16_scaled_states_tiny_grads"]
    scaled = R.reference_probe(cfg, 2)
    plain = R.reference_probe(dict(cfg, emulate="round_state"), 2)
    for i, (a, b) in enumerate(zip(scaled["exp_avg_sq"], plain["exp_avg_sq"])):
        if a is None or a.numel() == 0:
            continue
        assert torch.count_nonzero(b) == 0 and torch.count_nonzero(a) == a.numel(), i


@pytest.mark.parametrize("world", [1, 2, 3])
def test_scaled_state_is_stored_in_its_dtype_with_a_factor_per_fragment(probes, world):
    for per_rank in probes[world]:
        layout = per_rank["bf16_scaled_states"]["layout"]
        assert layout["state_dtypes"] == {"torch.bfloat16"}
        # a factor for each of master, exp_avg, exp_avg_sq per local fragment, plus the gaps' zero
        assert layout["scale_shapes"] == [(3, n + 1) for n in layout["local_fragments"]]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_state_is_sharded_over_buckets_and_ranks(probes, world):
    """The documented layout: trainable non-empty parameters in reverse order, each starting at a
    multiple of 32 fp32 elements (128 bytes), cut into buckets of shard * world elements."""
    cfg = R.PROBES["fp32_small_buckets_overlap"]
    bucket = cfg["shard"] * world
    offset, ranges = 0, {}
    for i in reversed(range(len(R.SHAPES))):
        n = math.prod(R.SHAPES[i])
        if i == R.FROZEN or n == 0:
            continue
        offset = -(-offset // 32) * 32
        ranges[i] = (offset, offset + n)
        offset += n
    buckets = -(-offset // bucket)
    start, end = ranges[2]
    for per_rank in probes[world]:
        layout = per_rank["fp32_small_buckets_overlap"]["layout"]
        assert layout["shard"] == cfg["shard"] and layout["buckets"] == buckets
        assert layout["state_elements"] == buckets * cfg["shard"], "a rank keeps state for its shards only"
        assert layout["buckets_of_param_2"] == (end - 1) // bucket - start // bucket + 1 > 1


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("overlap_param_sync", [False, True])
def test_mlp_matches_whole_batch_adamw(suite, world, overlap_param_sync):
    results = [r["mlp"][overlap_param_sync] for r in suite[world]]
    ref = R.mlp_reference()
    for rank, params in enumerate(results):
        for name, p in params.items():
            torch.testing.assert_close(p, ref[name], rtol=2e-5, atol=2e-6, msg=f"rank {rank} {name}")


@pytest.mark.parametrize("case", list(R.SCALER_CASES))
def test_grad_scaler_skips_the_step_with_an_inf_on_one_rank(suite, case):
    check_scaler(case, 2, [r["scaler"][case] for r in suite[2]])


def check_scaler(case, world, results):
    cfg = R.SCALER_CASES[case]
    ref = R.reference_probe(cfg, world, steps=4, skip_steps=(R.INF_STEP,))
    for rank, out in enumerate(results):
        # the skipped step halves the scale; the others keep it (growth_interval is long)
        assert out["scales"] == [2.0**10, 2.0**9, 2.0**9, 2.0**9]
        assert out["state"]["state"]["step"] == ref["step"] == 3
        assert out["skipped_step_changed"] == [], "the skipped step changed parameters"
        for i, (p, master) in enumerate(zip(out["params"], ref["masters"])):
            where = f"{case} rank {rank} param {i}"
            if i == R.FROZEN or p.numel() == 0:
                continue
            if cfg.get("master"):
                torch.testing.assert_close(out["state"]["state"][i]["param"].double(), master, **FP32_TOL, msg=where)
                torch.testing.assert_close(p, master, **BF16_TOL, msg=where)
            else:
                torch.testing.assert_close(p, master, **_tol(cfg), msg=where)
            # Adam hardly depends on the gradients' scale; its moments do: they prove the unscaling
            saved = out["state"]["state"][i]
            torch.testing.assert_close(saved["exp_avg"].double(), ref["exp_avg"][i], **_tol_state(cfg), msg=where)
            torch.testing.assert_close(saved["exp_avg_sq"].double(), ref["exp_avg_sq"][i], **_tol_state(cfg), msg=where)
        assert out["grads_left"] == [], "after backward, gradients must live in the optimizer's shards only"
        assert out["refused"] is not None and "unscale_grads" in out["refused"]


def test_clip_grad_norm_matches_torch(suite):
    world = 2
    results = [r["clip"] for r in suite[world]]
    ref = R.reference_probe(R.CLIP_CFG, world, steps=3, clip=R.CLIP_NORM)
    inf_norms = [max(g.abs().max().item() for g in R.averaged_grads(step, world) if g.numel()) for step in range(3)]
    subset_norms = [sum(R.averaged_grads(step, world)[i].abs().sum().item() for i in (0, 2)) for step in range(3)]
    for rank, out in enumerate(results):
        assert all(n > R.CLIP_NORM for n in out["norms"]), "the test needs every step to clip"
        torch.testing.assert_close(torch.tensor(out["norms"]), torch.stack(ref["norms"]).float(), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(out["inf_norms"]), torch.tensor(inf_norms), rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.tensor(out["subset_norms"]), torch.tensor(subset_norms), rtol=1e-5, atol=0)
        for i, (p, master) in enumerate(zip(out["params"], ref["masters"])):
            torch.testing.assert_close(p, master, **FP32_TOL, msg=f"rank {rank} param {i}")


@pytest.mark.parametrize("world", [1, 3])
def test_state_dict_saved_at_two_ranks_continues_at_another_world_size(suite, world):
    saved_at_two = [r["save"] for r in suite[2]]
    saved = saved_at_two[0]
    for other in saved_at_two[1:]:  # the same state dict on every rank
        for index, entry in saved["saved"]["state"].items():
            if index != "step":
                for key, value in entry.items():
                    assert torch.equal(value, other["saved"]["state"][index][key])
    results = [r["load"] for r in suite[world]]
    for rank, params in enumerate(results):
        for i, (p, expected) in enumerate(zip(params, saved["final"])):
            torch.testing.assert_close(p, expected, rtol=1e-6, atol=1e-7, msg=f"world {world} rank {rank} param {i}")


def test_scaled_state_dict_is_fp32_and_resumes_at_another_bucket_size(suite):
    for rank, out in enumerate(r["scaled_save_load"] for r in suite[2]):
        assert out["saved_dtypes"] == {"torch.float32"}
        for i, (a, b) in enumerate(zip(out["resumed"], out["final"])):
            # the factors are recomputed from the loaded values: the same up to the fp16 rounding
            torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=f"rank {rank} param {i}")


def test_capturable_keeps_lr_in_device_tensors_updated_in_place(suite):
    for out in (r["capturable"] for r in suite[2]):
        assert out["kinds"] == [("Tensor", "torch.float32", "cpu", 0)] * 2
        assert out["values"] == [pytest.approx([5e-3, 1.5e-2]), pytest.approx([2.5e-3, 7.5e-3])]
        assert out["same_after_scheduler"] and out["same_after_load"]
        assert out["loaded"] == [0.125, 0.125]


def test_hybrid_sharding_matches_plain_data_parallel(suite):
    world = 2
    results = [r["hybrid"] for r in suite[world]]
    ref = R.reference_probe(dict(param_dtype=torch.float32, shard=32), world, steps=3)
    for rank, params in enumerate(results):
        for i, (p, master) in enumerate(zip(params, ref["masters"])):
            torch.testing.assert_close(p, master, **FP32_TOL, msg=f"rank {rank} param {i}")


def test_overlap_starts_reduce_scatters_during_backward_and_zero_grad_drops_gradients(suite):
    def norm(micro):
        grads = [g for i, g in enumerate(R.averaged_grads(0, 2, micro)) if i != R.FROZEN]
        return math.sqrt(sum(float((g * g).sum()) for g in grads))

    for out in (r["overlap"] for r in suite[2]):
        assert out["overlap"]["started"] == out["overlap"]["buckets"] > 1
        assert out["no_overlap"]["started"] == 0 and out["no_sync"]["started"] == 0
        assert sorted(out.pop("after_no_sync_launches")) == list(range(out["no_sync"]["buckets"]))
        for case in out.values():
            # grad_norm reduces whatever is pending; zero_grad drops it all
            assert case["norm"] == pytest.approx(norm(2 if case is out["no_sync"] else 1), rel=1e-5)
            assert case["norm_after_zero_grad"] == 0.0


def test_tensor_lr_closure_and_changed_lr(suite):
    world = 2
    ref = R.reference_probe(dict(param_dtype=torch.float32, shard=32), world, steps=3)
    initial = R.initial_values()
    for rank, out in enumerate(r["misc"] for r in suite[world]):
        for form in ("float", "tensor"):
            for i, (p, master) in enumerate(zip(out[form]["params"], ref["masters"])):
                torch.testing.assert_close(p, master, **FP32_TOL, msg=f"{form} lr, rank {rank} param {i}")
            # the closure's loss: this rank's sum(p * G) before each step
            assert len(out[form]["losses"]) == 3 and out[form]["losses"][0] == pytest.approx(
                sum(float((v.float().double() * g).sum()) for v, g in zip(initial, R.probe_grads(0, 0, rank))), rel=1e-5
            )
        assert out["unchanged_with_lr_0"]


def test_bad_arguments_raise_naming_the_argument(suite):
    for out in (r["bad"] for r in suite[2]):
        for name, (_, kind, words) in R.BAD_ARGUMENTS.items():
            got, message = out[name]
            if got == "skipped":
                continue
            assert got == kind.__name__, (name, got, message)
            assert words in message, (name, message)
        expected = {
            "grad_buffer_view": ("RuntimeError", "contiguous_grad_buffer"),
            "state_dict_format": ("ValueError", "state_dict_format"),
            "load_format": ("ValueError", "format"),
            "grad_norm": ("ValueError", "norm_type"),
            "grad_norm_foreign_parameter": ("RuntimeError", "parameters"),
            "init_param_buffer": ("RuntimeError", "contiguous_param_buffer"),
            "add_param_group": ("NotImplementedError", "add_param_group"),
        }
        for name, (kind, words) in expected.items():
            got, message = out[name]
            assert got == kind and words in message, (name, got, message)


# the ops and the legacy module -----------------------------------------------------------------

SIZES = [1, 7, 33, 200]


def _upstream_adam(p, m, v, g, scale, lr, beta1, beta2, eps, step, mode, bias_correction, wd):
    """Upstream's kernel math in float64."""
    p, m, v, g = (t.double() for t in (p, m, v, g))
    g = g * scale
    if mode == 0:
        g = g + wd * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = (1 - beta1**step, 1 - beta2**step) if bias_correction else (1.0, 1.0)
    update = (m / bc1) / ((v / bc2).sqrt() + eps)
    if mode == 1:
        update = update + wd * p
    return p - lr * update, m, v


def _lists(state_dtype, grad_dtype, out_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = [torch.randn(n, generator=g).to(state_dtype) for n in SIZES]
    m = [(torch.randn(n, generator=g) * 0.1).to(state_dtype) for n in SIZES]
    v = [torch.rand(n, generator=g).to(state_dtype) * 0.01 for n in SIZES]
    grads = [torch.randn(n, generator=g).to(grad_dtype) for n in SIZES]
    out = [torch.full((n,), float("nan")).to(out_dtype) for n in SIZES]  # poisoned
    return p, m, v, grads, out


HYPER = dict(lr=1e-2, beta1=0.85, beta2=0.99, eps=1e-6, step=3, bias_correction=True, weight_decay=0.05)


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize(
    "state_dtype,grad_dtype,out_dtype",
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32, torch.float16),
        (torch.float16, torch.float16, torch.float32),
    ],
)
def test_legacy_multi_tensor_fused_adam_matches_float64(mode, state_dtype, grad_dtype, out_dtype):
    import distributed_adam_cuda

    p, m, v, g, out = _lists(state_dtype, grad_dtype, out_dtype)
    expected = [_upstream_adam(*t, 0.5, mode=mode, **_positional()) for t in zip(p, m, v, g)]
    noop = torch.zeros(1, dtype=torch.int32)
    scale = torch.tensor([0.5])
    h = HYPER
    distributed_adam_cuda.multi_tensor_fused_adam(
        2048,
        noop,
        [p, m, v, g, out],
        scale,
        h["lr"],
        h["beta1"],
        h["beta2"],
        h["eps"],
        h["step"],
        mode,
        1,
        h["weight_decay"],
    )
    tol = FP32_TOL if state_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    for i, (new_p, new_m, new_v) in enumerate(expected):
        torch.testing.assert_close(p[i].double(), new_p.to(state_dtype).double(), **tol)
        torch.testing.assert_close(m[i].double(), new_m.to(state_dtype).double(), **tol)
        torch.testing.assert_close(v[i].double(), new_v.to(state_dtype).double(), **tol)
        torch.testing.assert_close(out[i], p[i].to(out_dtype), rtol=0, atol=0)


def _positional():
    h = dict(HYPER)
    return dict(
        lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"], step=h["step"],
        bias_correction=h["bias_correction"], wd=h["weight_decay"],
    )  # fmt: skip


def test_legacy_capturable_takes_device_lr_and_step_and_skips_on_noop():
    import distributed_adam_cuda

    p, m, v, g, out = _lists(torch.float32, torch.float32, torch.float32)
    p2, m2, v2, g2, out2 = (list(map(torch.clone, x)) for x in (p, m, v, g, out))
    h = HYPER
    args = (torch.tensor([1.0]), h["beta1"], h["beta2"], h["eps"])
    distributed_adam_cuda.multi_tensor_fused_adam_capturable(
        512, torch.zeros(1, dtype=torch.int32), [p, m, v, g, out], *args[:1], torch.tensor([h["lr"]]), *args[1:],
        torch.tensor([float(h["step"])]), 1, 1, h["weight_decay"],
    )  # fmt: skip
    distributed_adam_cuda.multi_tensor_fused_adam(
        512, torch.zeros(1, dtype=torch.int32), [p2, m2, v2, g2, out2], torch.tensor([1.0]), h["lr"], h["beta1"],
        h["beta2"], h["eps"], h["step"], 1, 1, h["weight_decay"],
    )  # fmt: skip
    for a, b in zip(p + m + v + out, p2 + m2 + v2 + out2):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    before = [t.clone() for t in p + m + v]
    distributed_adam_cuda.multi_tensor_fused_adam_capturable(
        512, torch.ones(1, dtype=torch.int32), [p, m, v, g, out], torch.tensor([1.0]), torch.tensor([h["lr"]]),
        h["beta1"], h["beta2"], h["eps"], torch.tensor([4.0]), 1, 1, h["weight_decay"],
    )  # fmt: skip
    for a, b in zip(p + m + v, before):
        assert torch.equal(a, b), "a non-zero noop_flag must leave everything unchanged"


def test_bf16_remainder_split_round_trips_every_bit():
    bits = torch.randint(-(2**31), 2**31 - 1, (100_000,), dtype=torch.int64).to(torch.int32)
    fp32 = bits.view(torch.float32)
    fp32 = fp32[torch.isfinite(fp32)]
    bf16, rem = ops.fp32_to_bf16_and_remainder(fp32)
    back = ops.bf16_and_remainder_to_fp32(bf16, rem)
    assert torch.equal(back.view(torch.int32), fp32.view(torch.int32))
    # bf16 is the fp32 value rounded to 8 mantissa bits (halfway cases away from zero in magnitude)
    err = (bf16.double() - fp32.double()).abs()
    ulp = (bf16.double().abs() * 2.0**-7).clamp_min(2.0**-133)
    finite = torch.isfinite(bf16.double())
    assert bool((err[finite] <= ulp[finite] / 2 * (1 + 1e-9)).all())


def test_legacy_param_remainders_match_float64():
    import distributed_adam_cuda

    g0 = torch.Generator().manual_seed(3)
    masters = [torch.randn(n, generator=g0) for n in SIZES]
    split = [ops.fp32_to_bf16_and_remainder(t) for t in masters]
    p = [s[0].clone() for s in split]
    rem = [s[1].clone() for s in split]
    m = [torch.randn(n, generator=g0) * 0.1 for n in SIZES]
    v = [torch.rand(n, generator=g0) * 0.01 for n in SIZES]
    g = [torch.randn(n, generator=g0) for n in SIZES]
    out = [torch.full((n,), float("nan"), dtype=torch.bfloat16) for n in SIZES]
    expected = [_upstream_adam(*t, 1.0, mode=1, **_positional()) for t in zip(masters, m, v, g)]
    h = HYPER
    distributed_adam_cuda.multi_tensor_fused_adam_with_param_remainders(
        512, torch.zeros(1, dtype=torch.int32), [p, rem, m, v, g, out], torch.tensor([1.0]), h["lr"], h["beta1"],
        h["beta2"], h["eps"], h["step"], 1, 1, h["weight_decay"],
    )  # fmt: skip
    for i, (new_p, new_m, new_v) in enumerate(expected):
        master = ops.bf16_and_remainder_to_fp32(out[i], rem[i])
        torch.testing.assert_close(master.double(), new_p, **FP32_TOL)
        torch.testing.assert_close(m[i].double(), new_m, **FP32_TOL)
        torch.testing.assert_close(v[i].double(), new_v, **FP32_TOL)
        assert torch.equal(p[i], split[i][0]), "params (p_in) are read only"


def test_legacy_functions_refuse_bad_input():
    import distributed_adam_cuda

    p, m, v, g, out = _lists(torch.float32, torch.float32, torch.float32)
    noop, scale = torch.zeros(1, dtype=torch.int32), torch.ones(1)
    h = (1e-3, 0.9, 0.99, 1e-8, 1, 1, 1, 0.0)
    with pytest.raises(ValueError, match="expected 5 tensor lists"):
        distributed_adam_cuda.multi_tensor_fused_adam(512, noop, [p, m, v, g], scale, *h)
    with pytest.raises(ValueError, match=r"exp_avgs\[1\] has"):
        distributed_adam_cuda.multi_tensor_fused_adam(512, noop, [p, [m[0], m[2], m[2], m[3]], v, g, out], scale, *h)
    with pytest.raises(ValueError, match="mode"):
        distributed_adam_cuda.multi_tensor_fused_adam(
            512, noop, [p, m, v, g, out], scale, 1e-3, 0.9, 0.99, 1e-8, 1, 2, 1, 0.0
        )
    with pytest.raises(TypeError, match="noop_flag"):
        distributed_adam_cuda.multi_tensor_fused_adam(512, torch.zeros(1), [p, m, v, g, out], scale, *h)
    with pytest.raises(TypeError, match="exp_avgs"):
        distributed_adam_cuda.multi_tensor_fused_adam(512, noop, [p, [t.half() for t in m], v, g, out], scale, *h)
    with pytest.raises(ValueError, match="step"):
        distributed_adam_cuda.multi_tensor_fused_adam(
            512, noop, [p, m, v, g, out], scale, 1e-3, 0.9, 0.99, 1e-8, 0, 1, 1, 0.0
        )
    with pytest.raises(TypeError, match="param_remainders"):
        bf = [t.bfloat16() for t in p]
        distributed_adam_cuda.multi_tensor_fused_adam_with_param_remainders(512, noop, [bf, p, m, v, g, bf], scale, *h)


def _op_inputs(remainders: bool):
    p, m, v, g, out = _lists(torch.float32, torch.bfloat16, torch.bfloat16)
    common = dict(
        chunk_size=512, noop_flag=torch.zeros(1, dtype=torch.int32), exp_avgs=m, exp_avg_sqs=v, grads=g,
        grad_scale=torch.tensor([0.5]), lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, step=2, adam_mode=1,
        bias_correction=True, weight_decay=0.01, step_tensor=torch.tensor([2.0]),
    )  # fmt: skip
    if remainders:
        split = [ops.fp32_to_bf16_and_remainder(t) for t in p]
        return dict(common, params=[s[0] for s in split], param_remainders=[s[1] for s in split], params_out=out)
    return dict(common, params=p, params_out=out, lr_tensor=torch.tensor([1e-3]))


@pytest.mark.parametrize("remainders", [False, True])
def test_opcheck(remainders):
    name = "distributed_adam_with_param_remainders" if remainders else "distributed_adam"
    op = getattr(torch.ops.apex_contrib_optimizers, name).default
    torch.library.opcheck(op, (), _op_inputs(remainders))


# GPU (NCCL) -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("remainders", [False, True])
def test_ops_on_cuda_match_cpu(remainders):
    name = "distributed_adam_with_param_remainders" if remainders else "distributed_adam"
    op = getattr(torch.ops.apex_contrib_optimizers, name)
    cpu = _op_inputs(remainders)
    cuda = {k: ([t.cuda() for t in v] if isinstance(v, list) else v.cuda() if isinstance(v, torch.Tensor) else v)
            for k, v in cpu.items()}  # fmt: skip
    op(**cpu)
    op(**cuda)
    for key in ("params", "exp_avgs", "exp_avg_sqs", "params_out"):
        for a, b in zip(cpu[key], cuda[key]):
            torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=pytest.mark.multigpu)], ids=["1gpu", "2gpus"])
def nccl_suite(request, tmp_path_factory):
    world = request.param

    def run():
        return run_ranks(RANKS, "nccl_suite_worker", world, backend="nccl", timeout=TIMEOUT)

    return world, once_per_run(f"distributed_fused_adam_nccl_suite_{world}", tmp_path_factory, run)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(R.PROBES))
def test_probe_on_nccl(nccl_suite, name):
    world, results = nccl_suite
    check_probe(name, world, [r["probes"][name] for r in results])


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(R.SCALER_CASES))
def test_grad_scaler_on_nccl(nccl_suite, case):
    world, results = nccl_suite
    check_scaler(case, world, [r["scaler"][case] for r in results])


@pytest.mark.gpu
def test_mlp_on_nccl_matches_whole_batch_adamw(nccl_suite):
    _, results = nccl_suite
    ref = R.mlp_reference()
    for rank, params in enumerate(results):
        for name, p in params["mlp"].items():
            torch.testing.assert_close(p, ref[name], rtol=2e-5, atol=2e-6, msg=f"rank {rank} {name}")


@pytest.mark.gpu
def test_capturable_step_replays_in_a_cuda_graph(nccl_suite):
    """zero_grad, forward, backward (with the reduce-scatter) and step captured in one CUDA graph
    and replayed on new gradients end where the same steps run eagerly end."""
    _, results = nccl_suite
    for rank, r in enumerate(results):
        graphed, eager, steps = r["graph"]
        assert steps == 6.0, "the step count lives on the device: each replay adds one"
        for i, (a, b) in enumerate(zip(graphed, eager)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"rank {rank} param {i}")


@pytest.mark.gpu
def test_nccl_user_buffers_match_torch_adam_or_say_why_not(nccl_suite):
    """nccl_ub=True where PyTorch's NCCL backend offers ncclMemAlloc: the Probe as every other layout;
    elsewhere (the H200 machine of 2026-12-05 offered none) construction says so."""
    world, results = nccl_suite
    kinds = {r["nccl_ub"][0] for r in results}
    assert len(kinds) == 1
    if kinds == {"unavailable"}:
        for r in results:
            assert "ncclMemAlloc" in r["nccl_ub"][1] or "mem_allocator" in r["nccl_ub"][1]
        pytest.skip("PyTorch's NCCL backend offers no ncclMemAlloc allocator here: " + results[0]["nccl_ub"][1])
    ref = R.reference_probe(R.NCCL_UB_CFG, world)
    for rank, r in enumerate(results):
        out = r["nccl_ub"][1]
        assert out["in_pool"]
        for i, (p, master) in enumerate(zip(out["params"], ref["masters"])):
            if i != R.FROZEN and p.numel():
                torch.testing.assert_close(p, master, **FP32_TOL, msg=f"rank {rank} param {i}")
