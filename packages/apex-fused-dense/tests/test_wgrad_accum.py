"""wgrad_gemm_accum_fp32 / _fp16 (Megatron's gradient-accumulation fusion) against float64, on the
CPU and (marked gpu) on CUDA: in place, Megatron's [s, b, h] tensors, odd sizes, bad input,
opcheck, torch.compile."""

from __future__ import annotations

import pytest
import torch

from apex.fused_dense import _ops

# Relative to the largest magnitude of the float64 result.
TOL = {torch.float32: 3e-5, torch.float16: 6e-3, torch.bfloat16: 5e-2}
# (leading shape, in_features, out_features): Megatron's [s, b, h]; 2-D; ones; odd; aligned.
SHAPES = [((3, 2), 5, 7), ((1,), 1, 1), ((33,), 17, 9), ((16, 4), 64, 96), ((128,), 256, 128)]
FP32_CASES = [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float32)]
FP16_CASES = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def randn(shape, dtype, device, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device, dtype)


def run_case(device, input_dtype, grad_dtype, lead, k, n, op):
    x = randn((*lead, k), input_dtype, device, 1)
    dy = randn((*lead, n), input_dtype, device, 2)
    main_grad = randn((n, k), grad_dtype, device, 3) * 10
    before = main_grad.double().cpu()
    pointer = main_grad.data_ptr()
    assert op(x, dy, main_grad) is None
    assert main_grad.data_ptr() == pointer
    rows = x.double().reshape(-1, k).cpu(), dy.double().reshape(-1, n).cpu()
    expected = before + rows[1].t() @ rows[0]
    tol = TOL[grad_dtype]
    torch.testing.assert_close(main_grad.double().cpu(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("dtypes", FP32_CASES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_accumulator_matches_float64(device, dtypes, shape):
    run_case(device, *dtypes, *shape, _ops.wgrad_gemm_accum_fp32)


@pytest.mark.parametrize("dtypes", FP16_CASES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_16_bit_accumulator_matches_float64(device, dtypes, shape):
    run_case(device, *dtypes, *shape, _ops.wgrad_gemm_accum_fp16)


def test_accumulates_over_calls_and_reads_strided_inputs(device):
    # Megatron's activations may arrive as a transposed view ([b, s, h] -> [s, b, h]).
    x = randn((4, 6, 16), torch.bfloat16, device, 1).transpose(0, 1)
    dy = randn((4, 6, 8), torch.bfloat16, device, 2).transpose(0, 1)
    main_grad = torch.zeros(8, 16, device=device)
    for _ in range(3):
        _ops.wgrad_gemm_accum_fp32(x, dy, main_grad)
    expected = 3 * dy.double().reshape(-1, 8).t() @ x.double().reshape(-1, 16)
    torch.testing.assert_close(main_grad.double(), expected, rtol=3e-5, atol=3e-5 * expected.abs().max().item())


def test_empty_rows_leave_main_grad_unchanged(device):
    main_grad = randn((3, 4), torch.float32, device, 3)
    before = main_grad.clone()
    _ops.wgrad_gemm_accum_fp32(torch.empty(0, 2, 4, device=device), torch.empty(0, 2, 3, device=device), main_grad)
    assert torch.equal(main_grad, before)


def _t(shape, dtype=torch.bfloat16):
    return lambda d: torch.randn(shape, device=d).to(dtype)


BAD_INPUT = {  # case: (op, input, d_output, main_grad, error, message)
    "fp32: 16-bit main_grad": (
        "wgrad_gemm_accum_fp32",
        _t((6, 4)),
        _t((6, 3)),
        _t((3, 4)),
        TypeError,
        "main_grad has dtype torch.bfloat16; expected torch.float32",
    ),
    "fp16: float32 input": (
        "wgrad_gemm_accum_fp16",
        _t((6, 4), torch.float32),
        _t((6, 3), torch.float32),
        _t((3, 4), torch.float32),
        TypeError,
        "input has dtype torch.float32; expected one of float16, bfloat16",
    ),
    "fp16: main_grad of another dtype": (
        "wgrad_gemm_accum_fp16",
        _t((6, 4)),
        _t((6, 3)),
        _t((3, 4), torch.float16),
        TypeError,
        "main_grad has dtype torch.float16 but input has torch.bfloat16",
    ),
    "d_output dtype": (
        "wgrad_gemm_accum_fp32",
        _t((6, 4)),
        _t((6, 3), torch.float16),
        _t((3, 4), torch.float32),
        TypeError,
        "d_output has dtype torch.float16 but input has torch.bfloat16",
    ),
    "rows": (
        "wgrad_gemm_accum_fp32",
        _t((2, 3, 4)),
        _t((5, 3)),
        _t((3, 4), torch.float32),
        ValueError,
        r"d_output has shape \(5, 3\) and input has \(2, 3, 4\); their leading dimensions must hold as many rows",
    ),
    "1-d input": (
        "wgrad_gemm_accum_fp32",
        _t((4,)),
        _t((6, 3)),
        _t((3, 4), torch.float32),
        ValueError,
        r"input must have at least 2 dimensions, got shape \(4,\)",
    ),
    "main_grad shape": (
        "wgrad_gemm_accum_fp32",
        _t((6, 4)),
        _t((6, 3)),
        _t((4, 3), torch.float32),
        ValueError,
        r"main_grad has shape \(4, 3\), expected \(3, 4\) \(d_output.size\(-1\), input.size\(-1\)\)",
    ),
    "non-contiguous main_grad": (
        "wgrad_gemm_accum_fp32",
        _t((6, 4)),
        _t((6, 3)),
        lambda d: torch.zeros(4, 3, device=d).t(),
        ValueError,
        "main_grad is not contiguous",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_raises_naming_the_argument(device, case):
    name, make_x, make_dy, make_grad, error, message = BAD_INPUT[case]
    with pytest.raises(error, match=f"^{name}: {message}"):
        getattr(_ops, name)(make_x(device), make_dy(device), make_grad(device))


def test_opcheck(device):
    x, dy = randn((3, 2, 16), torch.bfloat16, device, 1), randn((3, 2, 8), torch.bfloat16, device, 2)
    torch.library.opcheck(_ops.wgrad_gemm_accum_fp32, (x, dy, torch.zeros(8, 16, device=device)))
    torch.library.opcheck(_ops.wgrad_gemm_accum_fp16, (x, dy, torch.zeros(8, 16, device=device, dtype=x.dtype)))


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    def step(x, dy, main_grad):
        _ops.wgrad_gemm_accum_fp32(x * 2, dy, main_grad)
        return main_grad.sum()

    compiled = torch.compile(step, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    x, dy = randn((5, 2, 16), torch.bfloat16, device, 1), randn((5, 2, 8), torch.bfloat16, device, 2)
    eager_grad, compiled_grad = torch.ones(8, 16, device=device), torch.ones(8, 16, device=device)
    torch.testing.assert_close(compiled(x, dy, compiled_grad), step(x, dy, eager_grad))
    torch.testing.assert_close(compiled_grad, eager_grad)
