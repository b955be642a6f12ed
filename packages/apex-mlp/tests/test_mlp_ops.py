"""apex_mlp's two ops against float64, on the CPU and (marked gpu) on CUDA: the output and every
gradient, each activation, with and without bias, sizes of 1, odd and not a multiple of 8 (where
cuBLASLt's alignment rules send a GEMM to the fallback), the relu masks' bit layout, bad input,
opcheck and torch.compile."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from apex.core import loader
from apex.core.testing import assert_first_use_in_graph_capture, with_and_without_side_stream
from apex.mlp import _ops
from apex.mlp._plugin import KERNELS

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
ACTIVATIONS = {"none": 0, "relu": 1, "sigmoid": 2}
# (batch, mlp_sizes): ones, odd, not a multiple of 8, a feature count of 1 in the middle, and
# aligned shapes that take cuBLASLt with its epilogues.
SHAPES = [
    (1, [1, 1]),
    (7, [5, 3, 9]),
    (33, [17, 1, 31]),
    (3, [16, 8]),
    (64, [64, 128, 32]),
    (130, [72, 40, 24, 8]),
]


@pytest.fixture(autouse=True)
def no_tf32():
    """A float32 comparison against float64 needs float32 products, not TF32's."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def make_layers(batch, sizes, dtype, device, bias=True, input_offset=0):
    """Input (``input_offset`` elements into its storage), weights and biases, scaled as the module's
    initialisation does so that activations stay of order one."""
    storage = torch.randn(batch * sizes[0] + input_offset, dtype=torch.float64)
    x = storage[input_offset:].view(batch, sizes[0])
    weights = [torch.randn(o, i, dtype=torch.float64) * math.sqrt(2 / (i + o)) for i, o in itertools.pairwise(sizes)]
    biases = [torch.randn(o, dtype=torch.float64) * math.sqrt(1 / o) for o in sizes[1:]] if bias else []
    return [t.to(dtype=dtype, device=device) for t in (x, *weights, *biases)], len(weights)


def float64_mlp(x, weights, biases, activation):
    """The MLP by autograd on float64 copies: output and gradients of (output * grad_output).sum()."""
    x = x.detach().double().cpu().requires_grad_()
    params = [p.detach().double().cpu().requires_grad_() for p in (*weights, *biases)]
    y = x
    for i, w in enumerate(params[: len(weights)]):
        y = y @ w.t()
        if biases:
            y = y + params[len(weights) + i]
        y = {0: lambda z: z, 1: torch.relu, 2: torch.sigmoid}[activation](y)
    return y, x, params


def mask_bits(mask, features):
    """A relu mask's bits as bool ``[rows, features]`` (feature f: bit f % 8 of byte f // 8)."""
    place = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8, device=mask.device)
    bits = (mask.unsqueeze(-1) & place) != 0
    return bits.flatten(1)[:, :features]


def poison_allocator(like_shapes, dtype, device):
    """Leave NaNs in freed blocks of the outputs' sizes: elements the op does not write show up."""
    for shape in like_shapes:
        torch.full(shape, float("nan"), dtype=dtype, device=device)


def relative_error(actual, expected):
    scale = expected.abs().max().clamp_min(1e-30)
    return ((actual.cpu().double() - expected).abs().max() / scale).item()


def tolerance(dtype, depth):
    """A few rounding units per layer the error passes through (16-bit products accumulate in float32)."""
    eps = torch.finfo(dtype).eps
    if dtype == torch.float64:
        return 1e3 * eps
    return 8 * eps * depth + (1e-6 if dtype == torch.float32 else 0)


def run_ops(tensors, layers, bias, activation, input_grad=True, grad_output=None):
    x, weights, biases = tensors[0], tensors[1 : 1 + layers], tensors[1 + layers :]
    outputs = _ops.mlp_forward(x, weights, biases, activation)
    outputs, masks = outputs[:layers], outputs[layers:]
    if grad_output is None:
        grad_output = torch.randn(outputs[-1].shape, dtype=torch.float64).to(x.dtype).to(x.device)
    poison_allocator([x.shape, *(w.shape for w in weights)], x.dtype, x.device)
    grads = _ops.mlp_backward(grad_output, x, weights, outputs, masks, bias, activation, input_grad)
    return outputs, grad_output, grads, masks


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{'-'.join(map(str, s[1]))}")
def test_forward_and_every_gradient_match_float64(device, dtype, activation, bias, shape):
    check_against_float64(device, dtype, activation, bias, shape)


def check_against_float64(device, dtype, activation, bias, shape):
    batch, sizes = shape
    tensors, layers = make_layers(batch, sizes, dtype, device, bias)
    code = ACTIVATIONS[activation]
    outputs, grad_output, grads, masks = run_ops(tensors, layers, bias, code)
    assert len(outputs) == layers and len(grads) == 1 + layers * (2 if bias else 1)
    assert len(masks) == (layers - 1 if activation == "relu" else 0)
    for y, mask in zip(outputs, masks):  # on CUDA: cuBLASLt's RELU_AUX layout is the documented one
        assert torch.equal(mask_bits(mask, y.shape[1]), y > 0)

    x, weights, biases = tensors[0], tensors[1 : 1 + layers], tensors[1 + layers :]
    expected, x64, params64 = float64_mlp(x, weights, biases, code)
    expected_grads = torch.autograd.grad(expected, [x64, *params64], grad_output.double().cpu())
    tol = tolerance(dtype, layers)
    assert relative_error(outputs[-1], expected) <= tol
    for got, want in zip(grads, expected_grads):
        assert (got.shape, got.dtype, got.device) == (want.shape, dtype, x.device)
        # The backward passes back through every layer: twice the depth of roundings.
        assert relative_error(got, want) <= 2 * tol


def float64_backward(x, weights, outputs, grad_output, activation):
    """The backward in float64 from the forward's own (rounded) outputs: relu's gate then follows
    the op's outputs, where a float64 forward would flip the sign of pre-activations near zero."""
    grads_w, grads_b = [], []
    g = grad_output.double().cpu()
    for i in reversed(range(len(weights))):
        y = outputs[i].double().cpu()
        dz = {0: g, 1: g * (y > 0), 2: g * y * (1 - y)}[activation]
        y_in = (outputs[i - 1] if i > 0 else x).double().cpu()
        grads_w.insert(0, dz.t() @ y_in)
        grads_b.insert(0, dz.sum(0))
        g = dz @ weights[i].double().cpu()
    return [g, *grads_w, *grads_b]


@pytest.mark.parametrize("dtype", DTYPES[:3], ids=str)
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("shape", [(4099, [24, 264, 40]), (515, [12, 36, 20])], ids=["4099x24-264-40", "515x12-36-20"])
@pytest.mark.parametrize("bgradb", [True, False], ids=["bgradb", "column_sum"])
def test_bias_gradients_over_many_rows(device, monkeypatch, dtype, activation, shape, bgradb):
    # Batches that split the bias gradients into many row chunks (the partial sums of apex-core's
    # bias_grad.cuh), features that are and are not a multiple of the 16-byte vector; with cuBLASLt's
    # BGRADB epilogue (off by default) turned on, and explicitly off.
    monkeypatch.delenv("APEX_CUBLASLT_ENABLE", raising=False)
    monkeypatch.delenv("APEX_CUBLASLT_DISABLE", raising=False)
    monkeypatch.setenv("APEX_CUBLASLT_ENABLE" if bgradb else "APEX_CUBLASLT_DISABLE", "bgradb")
    batch, sizes = shape
    tensors, layers = make_layers(batch, sizes, dtype, device)
    code = ACTIVATIONS[activation]
    outputs, grad_output, grads, _ = run_ops(tensors, layers, True, code)
    expected = float64_backward(tensors[0], tensors[1 : 1 + layers], outputs, grad_output, code)
    for got, want in zip(grads, expected, strict=True):
        assert relative_error(got, want) <= 2 * tolerance(dtype, layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_without_the_input_gradient(device, dtype):
    tensors, layers = make_layers(9, [24, 16, 8], dtype, device)
    outputs, grad_output, with_input, masks = run_ops(tensors, layers, True, 1)
    without = _ops.mlp_backward(grad_output, tensors[0], tensors[1:3], outputs, masks, True, 1, False)
    assert len(without) == len(with_input) - 1
    for got, want in zip(without, with_input[1:]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_without_relu_masks(device, dtype):
    # relu_masks=False: the outputs alone, none of the masks allocated or written.
    tensors, layers = make_layers(33, [40, 24, 16, 8], dtype, device)
    x, weights, biases = tensors[0], tensors[1 : 1 + layers], tensors[1 + layers :]
    assert len(_ops.mlp_forward(x, weights, biases, 1)) == 2 * layers - 1
    outputs = _ops.mlp_forward(x, weights, biases, 1, False)
    assert len(outputs) == layers
    expected, _, _ = float64_mlp(x, weights, biases, 1)
    assert relative_error(outputs[-1], expected) <= tolerance(dtype, layers)
    torch.library.opcheck(torch.ops.apex_mlp.mlp_forward.default, (x, weights, biases, 1, False))


@pytest.mark.parametrize(
    "enable, disable, on",
    [("", "", False), ("drelu", "", True), ("bias,all", "", True), ("drelu", "relu,drelu", False),
     ("all", "all", False), ("dgelu,relu", "", False), (" drelu", "", False)],
)  # fmt: skip
def test_drelu_epilogue_switch_follows_apex_cublaslt_h(monkeypatch, enable, disable, on):
    # The same rule as apex-core's apex/cublaslt.h: exact comma-separated names, DRELU off by default.
    monkeypatch.setenv("APEX_CUBLASLT_ENABLE", enable)
    monkeypatch.setenv("APEX_CUBLASLT_DISABLE", disable)
    assert _ops.drelu_epilogue_on() is on


@pytest.mark.parametrize("drelu", [False, True], ids=["drelu_off", "drelu_on"])
def test_autograd_keeps_masks_only_for_the_drelu_epilogue(device, monkeypatch, drelu):
    # With the DRELU epilogue on, the CUDA forward writes the masks and the backward reads them in
    # its GEMMs' epilogues; otherwise (the default) no mask is saved, and the backward takes relu's
    # derivative from the saved outputs. The gradients are the same either way.
    monkeypatch.setenv("APEX_CUBLASLT_ENABLE", "drelu" if drelu else "")
    monkeypatch.delenv("APEX_CUBLASLT_DISABLE", raising=False)
    tensors, layers = make_layers(64, [64, 128, 32, 16], torch.bfloat16, device)  # cuBLASLt's shapes
    x, params = tensors[0].requires_grad_(), [t.requires_grad_() for t in tensors[1:]]
    saved = []

    def pack(t):
        saved.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = _ops.mlp(True, 1, x, *params)
    assert saved.count(torch.uint8) == (layers - 1 if drelu and device == "cuda" else 0)
    grad_output = torch.randn(y.shape, dtype=torch.float64).to(y.dtype).to(device)
    grads = torch.autograd.grad(y, [x, *params], grad_output)
    expected, x64, params64 = float64_mlp(x, tensors[1 : 1 + layers], tensors[1 + layers :], 1)
    expected_grads = torch.autograd.grad(expected, [x64, *params64], grad_output.double().cpu())
    assert relative_error(y, expected) <= tolerance(torch.bfloat16, layers)
    for got, want in zip(grads, expected_grads, strict=True):
        assert relative_error(got, want) <= 2 * tolerance(torch.bfloat16, layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_unaligned_input(device, dtype):
    # The input one element into its storage: not 16-byte aligned, so cuBLASLt cannot take its GEMMs.
    tensors, layers = make_layers(40, [64, 32, 16], dtype, device, input_offset=1)
    outputs, grad_output, grads, _ = run_ops(tensors, layers, True, 1)
    expected, x64, params64 = float64_mlp(tensors[0], tensors[1:3], tensors[3:], 1)
    expected_grads = torch.autograd.grad(expected, [x64, *params64], grad_output.double().cpu())
    assert relative_error(outputs[-1], expected) <= tolerance(dtype, layers)
    for got, want in zip(grads, expected_grads):
        assert relative_error(got, want) <= 2 * tolerance(dtype, layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_empty_batch(device, dtype):
    # No rows: empty outputs and input gradient, zero parameter gradients.
    tensors, layers = make_layers(0, [64, 32, 16], dtype, device)
    outputs, _, grads, _ = run_ops(tensors, layers, True, 1)
    assert [tuple(y.shape) for y in outputs] == [(0, 32), (0, 16)]
    assert [tuple(g.shape) for g in grads] == [(0, 64), (32, 64), (16, 32), (32,), (16,)]
    assert all(bool((g == 0).all()) for g in grads[1:])


def bad_cases(device):
    w = torch.randn(4, 3, device=device)
    b = torch.randn(4, device=device)
    x = torch.randn(2, 3, device=device)
    other_w = torch.randn(5, 3, device=device)
    wide_w = torch.randn(3, 4, device=device).t()
    second_w = torch.randn(2, 4, device=device)
    long_b = torch.randn(5, device=device)
    return {  # case: (input, weights, biases, activation, error, message)
        "int input": (x.int(), [w], [b], 1, TypeError, "input has dtype torch.int32"),
        "3-d input": (x[None], [w], [b], 1, ValueError, r"input must be 2-D, got shape \(1, 2, 3\)"),
        "weight dtype": (x, [w.half()], [b], 1, TypeError, r"weights\[0\] has dtype torch.float16; expected"),
        "weight columns": (x, [w, other_w], [], 1, ValueError, r"weights\[1\] has shape \(5, 3\); expected 4 columns"),
        "non-contiguous weight": (x, [wide_w], [b], 1, ValueError, r"weights\[0\] is not contiguous"),
        "no layers": (x, [], [], 1, ValueError, "weights is empty"),
        "bias count": (x, [w, second_w], [b], 1, ValueError, "biases has 1 tensors; expected 0 or 2"),
        "bias shape": (x, [w], [long_b], 1, ValueError, r"biases\[0\] has shape \(5,\); expected \(4,\)"),
        "activation": (x, [w], [b], 3, ValueError, r"activation is 3; expected 0 \(none\), 1 \(relu\) or 2"),
    }  # fmt: skip


@pytest.mark.parametrize(
    "case",
    ["int input", "3-d input", "weight dtype", "weight columns", "non-contiguous weight", "no layers", "bias count",
     "bias shape", "activation"],
)  # fmt: skip
def test_bad_input_raises_naming_the_argument(device, case):
    x, weights, biases, activation, error, message = bad_cases(device)[case]
    with pytest.raises(error, match="^mlp_forward: " + message):
        _ops.mlp_forward(x, weights, biases, activation)


def test_backward_bad_input_names_the_argument(device):
    tensors, _ = make_layers(5, [6, 4, 3], torch.float32, device)
    x, weights = tensors[0], tensors[1:3]
    outputs = _ops.mlp_forward(x, weights, tensors[3:], 1)[:2]
    with pytest.raises(ValueError, match=r"^mlp_backward: grad_output has shape \(5, 4\); expected \(5, 3\)"):
        _ops.mlp_backward(torch.ones(5, 4, device=device), x, weights, outputs, [], True, 1, True)
    with pytest.raises(ValueError, match=r"^mlp_backward: outputs has 1 tensors; expected 2"):
        _ops.mlp_backward(outputs[-1], x, weights, outputs[1:], [], True, 1, True)
    with pytest.raises(ValueError, match=r"^mlp_backward: outputs\[0\] has shape \(5, 3\); expected \(5, 4\)"):
        _ops.mlp_backward(outputs[-1], x, weights, [outputs[1], outputs[1]], [], True, 1, True)
    bad_mask = torch.zeros(5, 2, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match=r"^mlp_backward: masks\[0\] has shape \(5, 2\); expected \(5, 16\)"):
        _ops.mlp_backward(outputs[-1], x, weights, outputs, [bad_mask], True, 1, True)
    with pytest.raises(ValueError, match=r"^mlp_backward: masks has 2 tensors; expected 0 or 1"):
        _ops.mlp_backward(outputs[-1], x, weights, outputs, [bad_mask, bad_mask], True, 1, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_opcheck(device, dtype, bias):
    tensors, layers = make_layers(6, [8, 16, 5], dtype, device, bias)
    x, weights, biases = tensors[0], tensors[1 : 1 + layers], tensors[1 + layers :]
    torch.library.opcheck(torch.ops.apex_mlp.mlp_forward.default, (x, weights, biases, 2))
    outputs = _ops.mlp_forward(x, weights, biases, 1)
    outputs, masks = outputs[:layers], outputs[layers:]
    grad_output = torch.randn_like(outputs[-1])
    torch.library.opcheck(
        torch.ops.apex_mlp.mlp_backward.default, (grad_output, x, weights, outputs, masks, bias, 1, True)
    )


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    tensors, _ = make_layers(12, [16, 24, 8], torch.float32, device)
    x, params = tensors[0], [t.requires_grad_() for t in tensors[1:]]

    def loss(x, *params):
        return _ops.mlp(True, 1, x, *params).square().sum()

    # Inductor on the GPU; on the CPU, AOT autograd without code generation (fast, same tracing).
    compiled = torch.compile(loss, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    results = []
    for fn in (loss, compiled):
        value = fn(x, *params)
        results.append((value.detach(), *torch.autograd.grad(value, params)))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_cuda_kernels_are_loaded():
    status = loader.load(KERNELS)
    assert status.has_kernels, f"{KERNELS.name}: tier {status.tier} ({status.reason})"
    assert torch._C._dispatch_has_kernel_for_dispatch_key("apex_mlp::mlp_forward", "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("apex_mlp::mlp_backward", "CUDA")


@pytest.mark.gpu
def test_tf32_follows_torch_setting():
    # With TF32 allowed, float32 products lose bits (about 1e-3 relative): the op must follow the switch.
    tensors, _ = make_layers(256, [512, 512], torch.float32, "cuda", bias=False)
    expected, _, _ = float64_mlp(tensors[0], tensors[1:2], [], 0)
    exact = _ops.mlp_forward(tensors[0], tensors[1:2], [], 0)[-1]
    assert relative_error(exact, expected) < 1e-5
    torch.backends.cuda.matmul.allow_tf32 = True
    fast = _ops.mlp_forward(tensors[0], tensors[1:2], [], 0)[-1]
    assert relative_error(fast, expected) > 1e-5


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    # Work on another stream than the caller's would race with the side stream's writes to x.
    tensors, _ = make_layers(4096, [256, 512, 256], torch.bfloat16, "cuda")
    source, params = tensors[0], tensors[1:]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = source * 1.0
        out = _ops.mlp_forward(x, params[:2], params[2:], 1)[1]
    torch.cuda.current_stream().wait_stream(side)
    expected, _, _ = float64_mlp(source, params[:2], params[2:], 1)
    assert relative_error(out, expected) <= tolerance(torch.bfloat16, 2)


@pytest.mark.multigpu
def test_second_gpu():
    # cuda:0 is current; the tensors live on cuda:1.
    tensors, layers = make_layers(64, [64, 32, 16], torch.bfloat16, "cuda:1")
    outputs, _, grads, _ = run_ops(tensors, layers, True, 1)
    assert outputs[-1].device == grads[0].device == tensors[0].device
    expected, _, _ = float64_mlp(tensors[0], tensors[1:3], tensors[3:], 1)
    assert relative_error(outputs[-1], expected) <= tolerance(torch.bfloat16, 2)


@pytest.mark.gpu
def test_cuda_graph_capture_is_the_side_streams_first_use():
    # A fresh process whose first MLP forward and backward (the side stream's first use) are inside a
    # CUDA graph capture: it captures, and the replay gives the eager result.
    assert_first_use_in_graph_capture("from apex.mlp import MLP", "MLP([64, 96, 48])", 64, 48)


@pytest.mark.gpu
def test_weight_gradients_on_the_side_stream_match_one_stream(monkeypatch):
    # The backward's weight gradients run on a second stream (apex-core's apex/side_stream.h);
    # APEX_SIDE_STREAM=0 queues the same GEMMs on the caller's stream. Both on a caller's own stream,
    # with that stream's allocations right after the call reusing what the op freed (its per-layer
    # temporaries): bitwise the same gradients, and the float64 reference's.
    tensors, layers = make_layers(4096, [256, 512, 512, 256], torch.bfloat16, "cuda")
    x, weights, biases = tensors[0], tensors[1 : 1 + layers], tensors[1 + layers :]
    outputs = _ops.mlp_forward(x, weights, biases, 1)[:layers]
    grad_output = torch.randn_like(outputs[-1])
    results = with_and_without_side_stream(
        monkeypatch, lambda: _ops.mlp_backward(grad_output, x, weights, outputs, [], True, 1, True)
    )
    for on, off in zip(results["1"], results["0"]):
        assert torch.equal(on, off)
    expected = float64_backward(x, weights, outputs, grad_output, 1)
    for got, want in zip(results["1"], expected):
        assert relative_error(got, want) <= 2 * tolerance(torch.bfloat16, layers)
