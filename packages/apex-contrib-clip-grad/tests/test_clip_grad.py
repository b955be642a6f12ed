"""apex.contrib.clip_grad.clip_grad_norm_ against a float64 reference and against
torch.nn.utils.clip_grad_norm_, on the CPU and (marked gpu) on CUDA: values, returned tensor,
orders, mixed dtypes, layouts, errors, opcheck of the ops it calls, torch.compile, host syncs."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from apex.contrib.clip_grad import clip_grad, clip_grad_norm_
from apex.contrib.clip_grad.clip_grad import CHUNK_SIZE
from apex.core.testing import load_example

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Empty, one element, odd, not a multiple of any vector width, more than one 65536-element chunk.
SIZES = [0, 1, 7, 33, 1000, 70_001]
ORDERS = [2.0, math.inf, 1.0, 3.0, 0.5]
NONFINITE = r"^The total norm of order {} for gradients from `parameters` is non-finite, so it cannot be clipped"


@pytest.fixture(autouse=True)
def _ops_off_cuda(monkeypatch):
    """Off CUDA the L2 path takes torch's foreach norm and multiply by default; these tests run
    apex-core's ops there (test_off_cuda_the_l2_path_is_torchs checks the default)."""
    monkeypatch.setattr(clip_grad, "_TORCH_OFF_CUDA", False)


def make_params(shapes, dtypes, device, scale=1.0):
    """Parameters with random gradients (normal values times ``scale``, exact in float64)."""
    params = []
    for shape, dtype in zip(shapes, dtypes):
        p = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        p.grad = (torch.randn(shape, dtype=torch.float64) * scale).to(dtype=dtype, device=device)
        params.append(p)
    return params


def clone_params(params):
    copies = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        copies.append(q)
    return copies


def reference(grads, max_norm, norm_type):
    """(total norm, clipped gradients), all float64, from the gradients as they were."""
    exact = [g.detach().cpu().double() for g in grads]
    per = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in exact])
    total = torch.linalg.vector_norm(per, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return total, [g * coef for g in exact]


def eps(dtype):
    return torch.finfo(dtype).eps


def assert_clipped(grads, expected, slack=1e-5):
    """Each gradient within two units in the last place of its dtype, plus ``slack`` relative for
    the norm's own float32 rounding, of the float64 expectation."""
    for g, e in zip(grads, expected):
        info = torch.finfo(g.dtype)
        torch.testing.assert_close(g.cpu().double(), e, rtol=2 * info.eps + slack, atol=info.smallest_normal * info.eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clips", [True, False], ids=["clips", "below-max"])
def test_l2_matches_float64(device, dtype, clips):
    params = make_params([(n,) for n in SIZES] + [(3, 5, 7)], [dtype] * (len(SIZES) + 1), device)
    grads = [p.grad for p in params]
    total, expected = reference(grads, 1.0, 2.0)
    max_norm = 0.25 * float(total) if clips else 4.0 * float(total)
    total, expected = reference(grads, max_norm, 2.0)
    before = [g.clone() for g in grads]
    norm = clip_grad_norm_(params, max_norm)
    assert (norm.shape, norm.dtype, norm.device) == ((), dtype, grads[0].device)
    torch.testing.assert_close(norm.cpu().double(), total, rtol=eps(dtype) + 1e-5, atol=0)
    assert all(p.grad is g for p, g in zip(params, grads))  # in place
    assert_clipped(grads, expected)
    if not clips:  # a factor of exactly 1: the gradients are unchanged
        for g, b in zip(grads, before):
            assert torch.equal(g, b)


@pytest.mark.parametrize("norm_type", ORDERS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_order_matches_float64_and_torch(device, dtype, norm_type):
    # Small values: every order's norm stays within float16's range.
    params = make_params([(1000,), (33,), (5000,), (4, 6)], [dtype] * 4, device, scale=1e-3)
    theirs = clone_params(params)
    total, _ = reference([p.grad for p in params], 1.0, norm_type)
    max_norm = 0.5 * float(total)
    total, expected = reference([p.grad for p in params], max_norm, norm_type)
    norm = clip_grad_norm_(params, max_norm, norm_type)
    their_norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert (norm.shape, norm.dtype, norm.device) == (their_norm.shape, their_norm.dtype, their_norm.device)
    # PyTorch rounds each tensor's norm to a 16-bit dtype before combining them: a few more ulps.
    torch.testing.assert_close(norm.cpu().double(), total, rtol=eps(dtype) + 1e-5, atol=0)
    torch.testing.assert_close(norm, their_norm, rtol=4 * eps(dtype), atol=0)
    # Other orders: PyTorch's norm, in the gradients' dtype, sets the factor.
    assert_clipped([p.grad for p in params], expected, slack=1e-5 + (0 if norm_type == 2.0 else eps(dtype)))
    info = torch.finfo(dtype)
    for p, q in zip(params, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=4 * info.eps, atol=info.smallest_normal * info.eps)


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=str)
def test_mixed_dtypes(device, norm_type):
    # One list of four dtypes: a group per dtype, float64 through PyTorch's norm; the returned norm
    # has the promoted dtype (float64), as PyTorch's.
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bfloat16]
    params = make_params([(70_001,), (1000,), (33,), (7, 9), (5,)], dtypes, device, scale=2.0)
    theirs = clone_params(params)
    total, expected = reference([p.grad for p in params], 10.0, norm_type)
    norm = clip_grad_norm_(params, 10.0, norm_type)
    their_norm = torch.nn.utils.clip_grad_norm_(theirs, 10.0, norm_type)
    assert norm.dtype == their_norm.dtype == torch.float64
    torch.testing.assert_close(norm.cpu(), total, rtol=1e-5, atol=0)
    assert_clipped([p.grad for p in params], expected, slack=1e-5)


def test_16_bit_dtypes_promote_to_float32(device):
    params = make_params([(100,), (100,)], [torch.float16, torch.bfloat16], device)
    theirs = clone_params(params)
    norm = clip_grad_norm_(params, 0.5)
    assert norm.dtype == torch.nn.utils.clip_grad_norm_(theirs, 0.5).dtype == torch.float32


def test_16_bit_norm_beyond_float16_range(device):
    # Squares summed in float32: a float16 norm past 65504 is inf in PyTorch's per-tensor norms,
    # finite here (the returned float16 value is inf, the clipping uses the float32 norm).
    params = make_params([(4096,)], [torch.float16], device, scale=2000.0)
    total, expected = reference([p.grad for p in params], 1.0, 2.0)
    assert total > 65504
    norm = clip_grad_norm_(params, 1.0)
    assert norm.dtype == torch.float16 and torch.isinf(norm)
    assert_clipped([params[0].grad], expected)


def test_single_tensor_and_parameters_without_gradients(device):
    (p,) = make_params([(257,)], [torch.float32], device)
    total, (expected,) = reference([p.grad], 0.5, 2.0)
    norm = clip_grad_norm_(p, 0.5)
    torch.testing.assert_close(norm.cpu().double(), total, rtol=1e-5, atol=0)
    assert_clipped([p.grad], [expected])
    no_grad = torch.nn.Parameter(torch.ones(3, device=device))
    q, r = make_params([(10,), (20,)], [torch.float32] * 2, device)
    total, expected = reference([q.grad, r.grad], 0.5, 2.0)
    norm = clip_grad_norm_([no_grad, q, r], 0.5)
    assert no_grad.grad is None
    torch.testing.assert_close(norm.cpu().double(), total, rtol=1e-5, atol=0)
    assert_clipped([q.grad, r.grad], expected)


def test_no_gradients_give_a_cpu_zero_as_torch():
    for params in ([], [torch.nn.Parameter(torch.ones(3))]):
        norm = clip_grad_norm_(params, 1.0)
        expected = torch.nn.utils.clip_grad_norm_(params, 1.0)
        assert (norm.dtype, norm.device, norm.shape) == (expected.dtype, expected.device, expected.shape)
        assert norm.item() == expected.item() == 0.0


def test_empty_generator_warns_as_torch():
    with pytest.warns(UserWarning, match="`parameters` is an empty generator, no gradient clipping will occur"):
        norm = clip_grad_norm_((p for p in []), 1.0)
    assert norm.item() == 0.0


def test_generator_of_parameters(device):
    params = make_params([(40,), (50,)], [torch.float32] * 2, device)
    total, expected = reference([p.grad for p in params], 0.1, 2.0)
    norm = clip_grad_norm_((p for p in params), 0.1)
    torch.testing.assert_close(norm.cpu().double(), total, rtol=1e-5, atol=0)
    assert_clipped([p.grad for p in params], expected)


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0], ids=str)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_gradients(device, dtype, bad, norm_type):
    params = make_params([(100,), (70_001,)], [dtype] * 2, device)
    params[1].grad[12345] = bad
    theirs = clone_params(params)
    # error_if_nonfinite: PyTorch's error, word for word, and the gradients left alone.
    before = [p.grad.clone() for p in params]
    with pytest.raises(RuntimeError) as ours_error:
        clip_grad_norm_(params, 1.0, norm_type, error_if_nonfinite=True)
    with pytest.raises(RuntimeError) as their_error:
        torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type, error_if_nonfinite=True)
    assert str(ours_error.value) == str(their_error.value)
    assert ours_error.match(NONFINITE.format(norm_type))
    for p, b in zip(params, before):
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0, equal_nan=True)
    # Without it: scaled by the non-finite norm, as PyTorch does (zeros and NaNs alike).
    norm = clip_grad_norm_(params, 1.0, norm_type)
    their_norm = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    torch.testing.assert_close(norm, their_norm, equal_nan=True)
    for p, q in zip(params, theirs):
        torch.testing.assert_close(p.grad, q.grad, equal_nan=True)


def test_layouts(device):
    # Channels-last and transposed gradients are dense (the multi-tensor path); a view with gaps
    # is not (PyTorch's norm and mul_). All are clipped in place.
    conv = torch.nn.Parameter(torch.empty(8, 3, 5, 5, device=device))
    conv.grad = torch.randn(8, 3, 5, 5, device=device).to(memory_format=torch.channels_last)
    linear = torch.nn.Parameter(torch.empty(30, 20, device=device))
    linear.grad = torch.randn(20, 30, device=device).t()
    gappy = torch.nn.Parameter(torch.empty(16, 9, device=device))
    gappy.grad = torch.randn(16, 18, device=device)[:, ::2]
    params = [conv, linear, gappy]
    grads = [p.grad for p in params]
    assert not any(g.is_contiguous() for g in grads)
    total, expected = reference(grads, 1.0, 2.0)
    norm = clip_grad_norm_(params, 1.0)
    torch.testing.assert_close(norm.cpu().double(), total, rtol=1e-5, atol=0)
    assert all(p.grad is g for p, g in zip(params, grads))
    assert conv.grad.is_contiguous(memory_format=torch.channels_last)
    assert_clipped(grads, expected)


@pytest.mark.parametrize("foreach", [None, True, False])
def test_foreach_is_accepted_as_torch(device, foreach):
    dtypes = [torch.float32, torch.float64]
    params = make_params([(300,), (400,)], dtypes, device)
    theirs = clone_params(params)
    norm = clip_grad_norm_(params, 1.0, foreach=foreach)
    their_norm = torch.nn.utils.clip_grad_norm_(theirs, 1.0, foreach=foreach)
    torch.testing.assert_close(norm, their_norm, rtol=1e-6, atol=0)
    for p, q in zip(params, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


def test_integer_norm_type_and_max_norm(device):
    params = make_params([(500,)], [torch.float32], device)
    theirs = clone_params(params)
    norm = clip_grad_norm_(params, 1, 2)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(theirs, 1, 2))
    torch.testing.assert_close(params[0].grad, theirs[0].grad)


def test_many_tensors(device):
    # More tensors than one multi-tensor launch takes, of mixed sizes.
    shapes = [((i * 37) % 3001 + 1,) for i in range(300)]
    params = make_params(shapes, [torch.bfloat16] * len(shapes), device)
    total, expected = reference([p.grad for p in params], 1.0, 2.0)
    norm = clip_grad_norm_(params, 1.0)
    torch.testing.assert_close(norm.cpu().double(), total, rtol=eps(torch.bfloat16) + 1e-5, atol=0)
    assert_clipped([p.grad for p in params], expected)


# the ops it calls, as it calls them ----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_of_the_calls(device, dtype):
    grads = [p.grad for p in make_params([(70_001,), (33,), (0,)], [dtype] * 3, device)]
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.apex_core.multi_tensor_l2norm.default, (CHUNK_SIZE, flag, grads, False))
    factor = torch.tensor([0.37], device=device)
    outputs = [torch.empty_like(g) for g in grads]
    torch.library.opcheck(
        torch.ops.apex_core.multi_tensor_scale.default, (CHUNK_SIZE, flag, grads, outputs, 1.0, factor)
    )


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    # Inductor on the GPU; on the CPU, AOT autograd without code generation (fast, same tracing).
    backend = "inductor" if device == "cuda" else "aot_eager"
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float64]
    params = make_params([(1000,), (333,), (8, 65), (12,)], dtypes, device, scale=2.0)
    theirs = clone_params(params)

    def step(params, max_norm: float):
        return clip_grad_norm_(params, max_norm)

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    norm = compiled(params, 0.5)
    expected = step(theirs, 0.5)
    torch.testing.assert_close(norm, expected)
    for p, q in zip(params, theirs):
        torch.testing.assert_close(p.grad, q.grad)


# CUDA only ---------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_no_host_sync_on_the_cuda_l2_path():
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32]
    params = make_params([(70_001,), (1000,), (33,), (4, 5, 6)], dtypes, "cuda", scale=2.0)
    warm = clone_params(params)
    clip_grad_norm_(warm, 1.0)  # loads the kernels outside the check
    total, expected = reference([p.grad for p in params], 1.0, 2.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm = clip_grad_norm_(params, 1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(norm.cpu().double(), total, rtol=1e-5, atol=0)
    assert_clipped([p.grad for p in params], expected)


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    # Work on another stream than the caller's would race with the side stream's writes.
    (p,) = make_params([(1 << 24,)], [torch.bfloat16], "cuda")
    source = p.grad.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        p.grad.copy_(source * 3.0)
        norm = clip_grad_norm_(p, 1.0)
    torch.cuda.current_stream().wait_stream(side)
    total, (expected,) = reference([source.double() * 3.0], 1.0, 2.0)
    torch.testing.assert_close(norm.cpu().double(), total, rtol=eps(torch.bfloat16) + 1e-5, atol=0)
    assert_clipped([p.grad], [expected])


@pytest.mark.gpu
def test_cpu_and_cuda_gradients_together():
    params = make_params([(1000,), (333,)], [torch.float32] * 2, "cuda") + make_params(
        [(500,), (7,)], [torch.float32, torch.float64], "cpu"
    )
    theirs = clone_params(params)
    total, expected = reference([p.grad for p in params], 1.0, 2.0)
    norm = clip_grad_norm_(params, 1.0)
    their_norm = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert (
        (norm.device, norm.dtype) == (their_norm.device, their_norm.dtype) == (torch.device("cuda", 0), torch.float64)
    )
    torch.testing.assert_close(norm.cpu(), total, rtol=1e-5, atol=0)
    assert_clipped([p.grad for p in params], expected)


@pytest.mark.multigpu
def test_gradients_on_two_gpus():
    # cuda:0 is current; the first gradient (hence the returned norm) lives on cuda:1.
    params = make_params([(70_001,), (300,)], [torch.bfloat16, torch.float32], "cuda:1") + make_params(
        [(1000,)], [torch.float32], "cuda:0"
    )
    total, expected = reference([p.grad for p in params], 1.0, 2.0)
    norm = clip_grad_norm_(params, 1.0)
    assert norm.device == torch.device("cuda", 1)
    torch.testing.assert_close(norm.cpu().double(), total, rtol=1e-5, atol=0)
    assert_clipped([p.grad for p in params], expected)


# the package as upstream's code imports it ---------------------------------------------------------


def test_upstream_import_paths_in_a_fresh_interpreter():
    code = (
        "from apex.contrib.clip_grad import clip_grad_norm_; "
        "from apex.contrib.clip_grad.clip_grad import clip_grad_norm_ as f; "
        "import sys; sys.exit(0 if f is clip_grad_norm_ else 1)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_plugin():
    from apex.contrib.clip_grad._plugin import PLUGIN

    assert (PLUGIN.name, PLUGIN.distribution, PLUGIN.kernel_library) == ("clip_grad", "apex-contrib-clip-grad", None)
    assert PLUGIN.provides == ("apex.contrib.clip_grad",)


def test_demo_clips_with_this_package(device):
    # The demo's clipping is this package's clip_grad_norm_ (the native stack's PyTorch's), and both
    # clip the same gradients to the same norm.
    demo = load_example("train_gpt", __file__)
    if demo is None:
        pytest.skip("not running from a source checkout")
    clip, choice = demo.pick_clip()
    assert clip is clip_grad_norm_ and choice.name == "apex.contrib.clip_grad.clip_grad_norm_"
    native_clip, native = demo.pick_clip("native")
    assert native.name == "torch clip_grad_norm_(foreach=True)"
    params = make_params([(7, 3), (11,), (2, 2, 5)], [torch.float32] * 3, device, scale=4.0)
    twins = clone_params(params)
    total, expected = reference([p.grad for p in params], 0.5, 2.0)
    norm = clip(params, 0.5)
    torch.testing.assert_close(norm.cpu().double(), total, rtol=1e-6, atol=0)
    torch.testing.assert_close(native_clip(twins, 0.5), norm)
    assert_clipped([p.grad for p in params], expected)
    assert_clipped([p.grad for p in twins], expected)


# the default path off CUDA --------------------------------------------------------------------


class _NoOps:
    def __getattr__(self, name):
        raise AssertionError(f"the default CPU path called apex-core's {name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clips", [True, False], ids=["clips", "below-max"])
def test_off_cuda_the_l2_path_is_torchs(monkeypatch, dtype, clips):
    """torch's foreach norm (float32 sums) and multiply, no apex-core op: as the ops' path against
    float64 and torch, the same returned dtype, 16-bit norms past float16's range finite inside."""
    monkeypatch.setattr(clip_grad, "_TORCH_OFF_CUDA", True)
    monkeypatch.setattr(clip_grad, "core_ops", _NoOps())
    shapes = [(n,) for n in SIZES] + [(3, 5, 7)]
    params = make_params(shapes, [dtype] * len(shapes), "cpu", scale=1.0)
    theirs = clone_params(params)
    grads = [p.grad for p in params]
    total, _ = reference(grads, 1.0, 2.0)
    max_norm = 0.25 * float(total) if clips else 4.0 * float(total)
    total, expected = reference(grads, max_norm, 2.0)
    before = [g.clone() for g in grads]
    norm = clip_grad_norm_(params, max_norm)
    their_norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert (norm.shape, norm.dtype, norm.device) == (their_norm.shape, their_norm.dtype, their_norm.device)
    torch.testing.assert_close(norm.double(), total, rtol=eps(dtype) + 1e-5, atol=0)
    assert all(p.grad is g for p, g in zip(params, grads))  # in place
    assert_clipped(grads, expected)
    if not clips:
        assert all(torch.equal(g, b) for g, b in zip(grads, before))
    # mixed dtypes, float64 through torch's norm
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    params = make_params([(70_001,), (1000,), (33,), (7, 9)], dtypes, "cpu", scale=2.0)
    total, expected = reference([p.grad for p in params], 10.0, 2.0)
    norm = clip_grad_norm_(params, 10.0)
    assert norm.dtype == torch.float64
    torch.testing.assert_close(norm, total, rtol=1e-5, atol=0)
    assert_clipped([p.grad for p in params], expected, slack=1e-5)
    # float32 sums: a float16 norm past 65504 clips by its finite float32 value
    params = make_params([(4096,)], [torch.float16], "cpu", scale=2000.0)
    total, expected = reference([p.grad for p in params], 1.0, 2.0)
    assert torch.isinf(clip_grad_norm_(params, 1.0))
    assert_clipped([params[0].grad], expected)


@pytest.mark.slow
def test_off_cuda_the_l2_path_compiles(monkeypatch):
    monkeypatch.setattr(clip_grad, "_TORCH_OFF_CUDA", True)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float64]
    params = make_params([(1000,), (333,), (8, 65), (12,)], dtypes, "cpu", scale=2.0)
    theirs = clone_params(params)
    compiled = torch.compile(lambda ps: clip_grad_norm_(ps, 0.5), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(params), clip_grad_norm_(theirs, 0.5))
    for p, q in zip(params, theirs):
        torch.testing.assert_close(p.grad, q.grad)
