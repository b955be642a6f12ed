"""The apex_optimizers dispatcher ops themselves: opcheck, torch.compile, bad input.

The numerics are checked through the optimizer classes in the other test files; here each op
is called directly, on the CPU and (marked gpu) on CUDA.
"""

from __future__ import annotations

import pytest
import torch

import apex.optimizers  # noqa: F401  (registers torch.ops.apex_optimizers)

OPS = ["fused_adam", "fused_sgd", "fused_adagrad", "fused_lamb", "fused_novograd"]
CHUNK = 64  # small, so that the 130-element tensors span several chunks
SIZES = (3, 130)
# the optimizer state list that each op keeps per parameter (all fp32)
STATE_LIST = {
    "fused_adam": "exp_avgs",
    "fused_sgd": "momentum_buffers",
    "fused_adagrad": "state_sums",
    "fused_lamb": "exp_avgs",
    "fused_novograd": "exp_avgs",
}
TAKES_STEP_TENSOR = {"fused_adam", "fused_lamb"}
# the scalars of Adam's schema that LAMB's and NovoGrad's take too
MOMENT_SCALARS = dict(lr=1e-3, step=3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, bias_correction=True)


def op(name):
    return getattr(torch.ops.apex_optimizers, name).default


def make(dtype, device, scale=1.0, sizes=SIZES):
    return [(torch.randn(n, dtype=torch.float64) * scale).to(dtype=dtype, device=device) for n in sizes]


def positive(device, sizes=SIZES):
    return [torch.rand(n, device=device) + 0.1 for n in sizes]


def scalar(value, device):
    return torch.tensor([value], dtype=torch.float32, device=device)


def inputs(name, device, dtype=torch.float32, masters=False, extras=False):
    """Keyword arguments of a valid call of ``name``; ``extras`` adds the optional tensors."""
    params = make(dtype, device)
    args = dict(
        chunk_size=CHUNK,
        params=params,
        grads=make(dtype, device),
        master_params=[p.float() for p in params] if masters else [],
    )
    if name in ("fused_adam", "fused_lamb"):  # LAMB takes Adam's arguments, and more
        args.update(
            MOMENT_SCALARS, exp_avgs=make(torch.float32, device, 0.1), exp_avg_sqs=positive(device), adam_w_mode=True
        )
    if name == "fused_lamb":
        args.update(
            global_grad_norm=scalar(5.0, device), eps=1e-6, grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False
        )
    elif name == "fused_sgd":
        args.update(
            momentum_buffers=make(torch.float32, device),
            lr=0.1,
            weight_decay=0.01,
            momentum=0.9,
            dampening=0.0,
            nesterov=True,
            first_run=False,
            wd_after_momentum=False,
        )
    elif name == "fused_adagrad":
        args.update(state_sums=positive(device), lr=0.1, eps=1e-10, weight_decay=0.01, adagrad_w_mode=False)
    elif name == "fused_novograd":
        args.update(
            MOMENT_SCALARS,
            exp_avgs=make(torch.float32, device, 0.1),
            exp_avg_sq_norms=torch.rand(len(SIZES), device=device),
            grad_norms=torch.stack([g.float().norm() for g in args["grads"]]),
            beta1=0.95,
            beta2=0.98,
            grad_averaging=True,
            reg_inside_moment=False,
            init_zero=False,
        )
    if extras:
        args.update(lr_tensor=scalar(2e-3, device), grad_scale=scalar(4.0, device), found_inf=scalar(0.0, device))
        if name in TAKES_STEP_TENSOR:
            args["step_tensor"] = scalar(4.0, device)
    return args


# opcheck -----------------------------------------------------------------------------------

CASES = {
    "fp32": dict(dtype=torch.float32),
    "fp16_master_weights_optional_tensors": dict(dtype=torch.float16, masters=True, extras=True),
    "bf16_optional_tensors": dict(dtype=torch.bfloat16, extras=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", OPS)
def test_opcheck(device, name, case):
    torch.library.opcheck(op(name), (), inputs(name, device, **CASES[case]))


@pytest.mark.parametrize("name", OPS)
def test_call_updates_params_and_masters(device, name):
    args = inputs(name, device, dtype=torch.bfloat16, masters=True, extras=True)
    before = [p.clone() for p in args["params"]]
    op(name)(**args)
    for p, p0, master in zip(args["params"], before, args["master_params"]):
        assert not torch.equal(master, p0.float()), "the masters were not updated"
        assert torch.equal(p, master.to(p.dtype)), "params are the updated masters rounded"


@pytest.mark.parametrize("name", OPS)
def test_found_inf_writes_nothing(device, name):
    args = inputs(name, device, dtype=torch.float16, masters=True, extras=True)
    args["found_inf"] = scalar(1.0, device)
    mutable = {
        k: [t.clone() for t in v] if isinstance(v, list) else v.clone()
        for k, v in args.items()
        if isinstance(v, (list, torch.Tensor)) and k != "grads"
    }
    op(name)(**args)
    for key, saved in mutable.items():
        current = args[key]
        for a, b in zip(
            current if isinstance(current, list) else [current], saved if isinstance(saved, list) else [saved]
        ):
            assert torch.equal(a, b), f"{key} written despite found_inf"


# torch.compile -----------------------------------------------------------------------------


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    def adam_steps(params, grads, exp_avgs, exp_avg_sqs, masters, step, lr, scale):
        for _ in range(2):
            step.add_(1.0)
            torch.ops.apex_optimizers.fused_adam(
                CHUNK,
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                masters,
                0.0,
                0,
                0.9,
                0.999,
                1e-8,
                0.01,
                True,
                True,
                lr,
                step,
                scale,
                None,
            )
        return step * 1.0

    def fresh():
        params = make(torch.float16, device, sizes=(1, 7, 130, 1000))
        return dict(
            params=params,
            grads=make(torch.float16, device, 1024.0, sizes=(1, 7, 130, 1000)),
            exp_avgs=[torch.zeros(p.numel(), device=device) for p in params],
            exp_avg_sqs=[torch.zeros(p.numel(), device=device) for p in params],
            masters=[p.float() for p in params],
            step=scalar(0.0, device),
            lr=scalar(1e-2, device),
            scale=scalar(1024.0, device),
        )

    torch.manual_seed(7)
    eager = fresh()
    torch.manual_seed(7)
    traced = fresh()
    initial_masters = [m.clone() for m in traced["masters"]]
    expected = adam_steps(**eager)
    got = torch.compile(adam_steps, fullgraph=True)(**traced)
    torch.testing.assert_close(got, expected)
    for key in ("params", "exp_avgs", "exp_avg_sqs", "masters"):
        for a, b in zip(traced[key], eager[key]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for master, initial in zip(traced["masters"], initial_masters):
        assert not torch.equal(master, initial), "the compiled steps did not update the masters"
    assert float(traced["step"]) == 2.0


# bad input ---------------------------------------------------------------------------------


def _assert_raises_and_writes_nothing(name, args, error, pattern):
    before = [p.clone() for p in args["params"]]
    with pytest.raises(error, match=pattern):
        op(name)(**args)
    for p, p0 in zip(args["params"], before):
        if p.dtype == p0.dtype and p.shape == p0.shape:
            assert torch.equal(p, p0), "a refused call must not write the parameters"


TAKES_FLOAT64 = {"fused_adam", "fused_adagrad"}  # as upstream's kernels


@pytest.mark.parametrize("name", [n for n in OPS if n not in TAKES_FLOAT64])
def test_float64_params_are_refused(device, name):
    args = inputs(name, device)
    args["params"] = [p.double() for p in args["params"]]
    _assert_raises_and_writes_nothing(name, args, TypeError, r"params\[0\] has dtype torch.float64")


@pytest.mark.parametrize("name", sorted(TAKES_FLOAT64))
def test_float64_params_take_float64_grads_and_no_masters(device, name):
    args = inputs(name, device, dtype=torch.float64)
    op(name)(**args)  # accepted
    args["grads"] = [g.float() for g in args["grads"]]
    _assert_raises_and_writes_nothing(name, args, TypeError, r"float64 params need float64 grads")
    args = inputs(name, device, dtype=torch.float64, masters=True)
    _assert_raises_and_writes_nothing(name, args, ValueError, r"float64 params take no master_params")


@pytest.mark.parametrize("name", OPS)
def test_dense_non_contiguous_layouts_are_accepted(device, name):
    """channels-last tensors in every list (same shape and strides at each index) give the
    contiguous call's results."""
    contiguous = inputs(name, device, extras=True)
    shape = (2, 5, 3, 13)  # 390 elements, channels-last is not contiguous
    for value in contiguous.values():
        if isinstance(value, list) and value and value[1].numel() == 130:
            value[1] = torch.cat([value[1]] * 3).reshape(shape)
    if name == "fused_novograd":
        contiguous["grad_norms"] = torch.stack([g.float().norm() for g in contiguous["grads"]])
    last = {
        k: [t.clone(memory_format=torch.channels_last) if t.dim() == 4 else t.clone() for t in v]
        if isinstance(v, list)
        else v.clone()
        if isinstance(v, torch.Tensor)
        else v
        for k, v in contiguous.items()
    }
    assert not last["params"][1].is_contiguous()
    op(name)(**contiguous)
    op(name)(**last)
    # Element-wise ops agree to an ulp: on CUDA the elements the scalar tail handles (and so how
    # the compiler contracts their arithmetic) differ with the layout. LAMB's per-tensor norms sum
    # in another order.
    eps = torch.finfo(torch.float32).eps
    tol = dict(rtol=1e-6, atol=1e-7) if name == "fused_lamb" else dict(rtol=2 * eps, atol=1e-12)
    for key, value in contiguous.items():
        if isinstance(value, list):
            for a, b in zip(value, last[key]):
                torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("name", OPS)
def test_mismatched_list_lengths_are_refused(device, name):
    args = inputs(name, device)
    args["grads"] = args["grads"][:1]
    _assert_raises_and_writes_nothing(name, args, ValueError, r"tensor lists must have the same length")


@pytest.mark.parametrize("name", OPS)
def test_grads_with_other_numel_are_refused(device, name):
    args = inputs(name, device)
    args["grads"][1] = args["grads"][1][:5].clone()
    _assert_raises_and_writes_nothing(name, args, ValueError, r"grads\[1\] has 5 elements but params\[1\] has 130")


@pytest.mark.parametrize("name", OPS)
def test_fp16_optimizer_state_is_refused(device, name):
    args = inputs(name, device)
    state = STATE_LIST[name]
    args[state] = [t.half() for t in args[state]]
    _assert_raises_and_writes_nothing(name, args, TypeError, rf"{state}\[0\] has dtype torch.float16")


@pytest.mark.parametrize("name", OPS)
def test_fp16_master_params_are_refused(device, name):
    args = inputs(name, device, dtype=torch.float16, masters=True)
    args["master_params"] = [m.half() for m in args["master_params"]]
    _assert_raises_and_writes_nothing(name, args, TypeError, r"master_params\[0\] has dtype torch.float16")


@pytest.mark.parametrize("name", OPS)
def test_mixed_dtypes_within_a_list_are_refused(device, name):
    args = inputs(name, device)
    args["grads"][1] = args["grads"][1].half()
    _assert_raises_and_writes_nothing(
        name, args, TypeError, r"grads\[1\] has dtype torch.float16 but grads\[0\] has torch.float32"
    )


@pytest.mark.parametrize("name", OPS)
def test_non_contiguous_params_are_refused(device, name):
    args = inputs(name, device)
    args["params"][0] = torch.randn(3, 2, device=device).t()  # 6 elements, strided
    args["grads"][0] = torch.randn(6, device=device)
    for key in ("exp_avgs", "exp_avg_sqs", "momentum_buffers", "state_sums"):
        if key in args:
            args[key][0] = torch.rand(6, device=device)
    _assert_raises_and_writes_nothing(name, args, ValueError, r"params\[0\] is not contiguous")


@pytest.mark.parametrize(
    ("name", "optional"),
    [
        (name, optional)
        for name in OPS
        for optional in ("lr_tensor", "grad_scale", "found_inf", "step_tensor")
        if optional != "step_tensor" or name in TAKES_STEP_TENSOR
    ],
)
def test_optional_tensors_must_be_fp32_scalars(device, name, optional):
    args = inputs(name, device, extras=True)
    args[optional] = torch.ones(1, dtype=torch.float64, device=device)
    _assert_raises_and_writes_nothing(name, args, TypeError, rf"{optional} has dtype torch.float64")
    args[optional] = torch.ones(2, device=device)
    _assert_raises_and_writes_nothing(name, args, ValueError, rf"{optional} must have exactly one element")


@pytest.mark.parametrize("name", OPS)
def test_chunk_size_must_be_positive(device, name):
    args = inputs(name, device)
    args["chunk_size"] = 0
    _assert_raises_and_writes_nothing(name, args, ValueError, r"chunk_size must be positive")


def test_op_specific_arguments_are_checked(device):
    args = inputs("fused_adam", device)
    args["step"] = 0
    _assert_raises_and_writes_nothing("fused_adam", args, ValueError, r"step must be >= 1 with bias_correction")

    args = inputs("fused_novograd", device)
    args["step"] = 0
    _assert_raises_and_writes_nothing("fused_novograd", args, ValueError, r"step must be >= 1")
    args = inputs("fused_novograd", device)
    args["exp_avg_sq_norms"] = torch.rand(len(SIZES) + 1, device=device)
    _assert_raises_and_writes_nothing("fused_novograd", args, ValueError, r"exp_avg_sq_norms must be a 1-D float32")
    args = inputs("fused_novograd", device)
    args["grad_norms"] = args["grad_norms"].half()
    _assert_raises_and_writes_nothing("fused_novograd", args, ValueError, r"grad_norms must be a 1-D float32")

    args = inputs("fused_lamb", device)
    args["global_grad_norm"] = args["global_grad_norm"].double()
    _assert_raises_and_writes_nothing("fused_lamb", args, TypeError, r"global_grad_norm has dtype torch.float64")

    args = inputs("fused_sgd", device)
    args["momentum"] = 0.0
    args["nesterov"] = False
    _assert_raises_and_writes_nothing("fused_sgd", args, ValueError, r"momentum_buffers must be empty")
    args = inputs("fused_sgd", device)
    args["dampening"] = 0.5
    _assert_raises_and_writes_nothing("fused_sgd", args, ValueError, r"nesterov needs momentum > 0 and dampening 0")


@pytest.mark.gpu
@pytest.mark.parametrize("name", OPS)
def test_tensors_on_the_wrong_device_are_named(name):
    args = inputs(name, "cuda")
    args["grads"][1] = args["grads"][1].cpu()
    _assert_raises_and_writes_nothing(name, args, ValueError, r"grads\[1\] is on cpu, expected cuda:0")
    args = inputs(name, "cuda", extras=True)
    args["lr_tensor"] = args["lr_tensor"].cpu()
    _assert_raises_and_writes_nothing(name, args, ValueError, r"lr_tensor is on cpu, expected cuda:0")


@pytest.mark.parametrize("name", OPS)
def test_strided_views_are_refused(device, name):
    args = inputs(name, device)
    args["params"][0] = torch.randn(3, 2, device=device)[:, 0]  # 3 elements two apart: not dense
    _assert_raises_and_writes_nothing(name, args, ValueError, r"params\[0\] is not contiguous and not dense")
