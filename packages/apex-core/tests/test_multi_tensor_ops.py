"""apex_core multi-tensor ops against float64 references, on the CPU and (marked gpu) on CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from apex.core import _ops, amp_C
from apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Sizes: empty, one, odd, not a multiple of any vector width, several chunks of CHUNK.
SIZES = [0, 1, 7, 33, 130, 1000, 4099]
CHUNK = 128
RTOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def make(sizes, dtype, device, scale=1.0):
    return [(torch.randn(n, dtype=torch.float64) * scale).to(dtype=dtype, device=device) for n in sizes]


def poisoned_like(tensors, dtype):
    return [torch.full_like(t, float("nan"), dtype=dtype) for t in tensors]


def flag(device, value=0):
    return torch.full((1,), value, dtype=torch.int32, device=device)


def assert_matches(actual, expected64, dtype):
    expected = expected64.to(dtype)
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(), rtol=RTOL[dtype], atol=1e-6)


# scale ------------------------------------------------------------------------------------


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_scale_matches_reference(device, in_dtype, out_dtype):
    inputs = make(SIZES, in_dtype, device)
    outputs = poisoned_like(inputs, out_dtype)
    noop = flag(device)
    _ops.multi_tensor_scale(CHUNK, noop, inputs, outputs, 0.37)
    for x, out in zip(inputs, outputs):
        assert out.dtype == out_dtype
        assert_matches(out, x.double() * 0.37, out_dtype)
    assert noop.item() == 0


def test_scale_tensor_factor_in_place_and_many_launches(device):
    # Thousands of small tensors: more than one launch table, with chunk boundaries inside tensors.
    sizes = [(i * 37) % 301 for i in range(5000)]
    tensors = make(sizes, torch.float32, device)
    expected = [t.double() * 0.5 * 3.0 for t in tensors]
    noop = flag(device)
    factor = torch.tensor([3.0], device=device)
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [tensors, tensors], factor * 0.5)
    for t, e in zip(tensors, expected):
        assert_matches(t, e, torch.float32)
    assert noop.item() == 0


@pytest.mark.parametrize("bad_value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_sets_flag_on_nonfinite(device, bad_value, dtype):
    inputs = make([5, 3000, 17], dtype, device)
    inputs[1][2999] = bad_value  # the last element of a multi-chunk tensor
    outputs = poisoned_like(inputs, torch.float32)
    noop = flag(device)
    _ops.multi_tensor_scale(CHUNK, noop, inputs, outputs, 2.0)
    assert noop.item() == 1
    # the flag only ever goes up: a clean call leaves it set
    _ops.multi_tensor_scale(CHUNK, noop, inputs[:1], outputs[:1], 2.0)
    assert noop.item() == 1


def test_scale_empty_list_is_a_no_op(device):
    noop = flag(device)
    _ops.multi_tensor_scale(CHUNK, noop, [], [], 2.0)
    assert noop.item() == 0


# axpby ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_axpby_matches_reference(device, dtype, out_dtype):
    x = make(SIZES, dtype, device)
    y = make(SIZES, dtype, device)
    out = poisoned_like(x, out_dtype)
    noop = flag(device)
    MultiTensorApply(CHUNK)(amp_C.multi_tensor_axpby, noop, [x, y, out], 1.5, -0.25, -1)
    for xi, yi, oi in zip(x, y, out):
        assert_matches(oi, 1.5 * xi.double() - 0.25 * yi.double(), out_dtype)
    assert noop.item() == 0


@pytest.mark.parametrize(("arg_to_check", "expected"), [(-1, 1), (0, 0), (1, 1)])
def test_axpby_checks_only_the_requested_argument(device, arg_to_check, expected):
    x = make([100], torch.float32, device)
    y = make([100], torch.float32, device)
    y[0][50] = float("nan")
    out = poisoned_like(x, torch.float32)
    noop = flag(device)
    _ops.multi_tensor_axpby(CHUNK, noop, x, y, out, 1.0, 1.0, arg_to_check)
    assert noop.item() == expected


# l2norm -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_tensor", [False, True])
def test_l2norm_matches_reference(device, dtype, per_tensor):
    inputs = make(SIZES, dtype, device, scale=3.0)
    total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag(device), [inputs], per_tensor)
    expected_per = torch.stack([t.double().norm() for t in inputs]).cpu()
    assert total.shape == (1,) and total.dtype == torch.float32
    torch.testing.assert_close(total.cpu().double(), expected_per.norm().reshape(1), rtol=1e-5, atol=0)
    if per_tensor:
        assert per.shape == (len(inputs),)
        torch.testing.assert_close(per.cpu().double(), expected_per, rtol=1e-5, atol=0)
    else:
        assert per.numel() == 0


def test_l2norm_many_tensors_and_large(device):
    inputs = make([(i * 53) % 1000 + 1 for i in range(3000)] + [1 << 20], torch.float32, device)
    total, per = _ops.multi_tensor_l2norm(2048, flag(device), inputs, True)
    expected_per = torch.stack([t.double().norm() for t in inputs]).cpu()
    torch.testing.assert_close(per.cpu().double(), expected_per, rtol=1e-5, atol=0)
    torch.testing.assert_close(total.cpu().double(), expected_per.norm().reshape(1), rtol=1e-5, atol=0)


def test_l2norm_empty(device):
    total, per = _ops.multi_tensor_l2norm(CHUNK, flag(device), [], True)
    assert total.item() == 0.0 and per.numel() == 0


# unscale + l2norm -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("write", [False, True])
def test_unscale_l2norm(device, dtype, write):
    grads = make(SIZES, dtype, device, scale=1024.0)
    original = [g.clone() for g in grads]
    outputs = poisoned_like(grads, torch.float32) if write else []
    inv_scale = torch.tensor([1.0 / 1024.0], device=device)
    noop = flag(device)
    lists = [grads, outputs] if write else [grads]
    total, per = multi_tensor_applier(amp_C.multi_tensor_unscale_l2norm, noop, lists, inv_scale, True)
    expected = [g.double() / 1024.0 for g in original]
    expected_per = torch.stack([e.norm() for e in expected]).cpu()
    torch.testing.assert_close(per.cpu().double(), expected_per, rtol=1e-5, atol=0)
    torch.testing.assert_close(total.cpu().double(), expected_per.norm().reshape(1), rtol=1e-5, atol=0)
    for g, o in zip(grads, original):
        assert torch.equal(g, o), "inputs must not be modified"
    for out, e in zip(outputs, expected):
        assert_matches(out, e, torch.float32)
    assert noop.item() == 0


def test_unscale_l2norm_flags_overflow(device):
    grads = make([10, 500], torch.float16, device)
    grads[1][499] = float("inf")
    noop = flag(device)
    total, _ = _ops.multi_tensor_unscale_l2norm(CHUNK, noop, grads, [], torch.tensor([0.5], device=device), False)
    assert noop.item() == 1
    assert not math.isfinite(total.item())


# update_scale_hysteresis ------------------------------------------------------------------


class ScalarScaler:
    """The loss-scale rule written out on Python floats, as an independent model."""

    def __init__(self, scale, growth_factor, backoff_factor, interval, hysteresis):
        self.scale, self.growth, self.backoff = scale, growth_factor, backoff_factor
        self.interval, self.hysteresis = interval, hysteresis
        self.clean_steps, self.hysteresis_left = 0, hysteresis

    def update(self, overflow: bool):
        if overflow:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = float(torch.tensor(self.scale * self.backoff, dtype=torch.float32))
            return
        self.hysteresis_left = self.hysteresis
        self.clean_steps += 1
        if self.clean_steps == self.interval:
            self.clean_steps = 0
            grown = float(torch.tensor(self.scale * self.growth, dtype=torch.float32))
            if math.isfinite(grown):
                self.scale = grown


@pytest.mark.parametrize(("interval", "hysteresis"), [(1, 1), (3, 2), (7, 4)])
def test_update_scale_hysteresis_long_run(device, interval, hysteresis):
    generator = torch.Generator().manual_seed(interval * 10 + hysteresis)
    overflows = (torch.rand(600, generator=generator) < 0.2).tolist()
    model = ScalarScaler(2.0**16, 2.0, 0.5, interval, hysteresis)
    scale = torch.tensor([2.0**16], device=device)
    growth = torch.zeros(1, dtype=torch.int32, device=device)
    hyst = torch.full((1,), hysteresis, dtype=torch.int32, device=device)
    for step, overflow in enumerate(overflows):
        found = torch.tensor([1.0 if overflow else 0.0], device=device)
        amp_C.update_scale_hysteresis(scale, growth, hyst, found, 2.0, 0.5, interval, hysteresis)
        model.update(overflow)
        assert scale.item() == model.scale, f"step {step}"
        assert growth.item() == model.clean_steps, f"step {step}"
        assert hyst.item() == model.hysteresis_left, f"step {step}"


def test_update_scale_never_grows_to_inf(device):
    scale = torch.tensor([3.0e38], device=device)
    growth = torch.zeros(1, dtype=torch.int32, device=device)
    hyst = torch.ones(1, dtype=torch.int32, device=device)
    _ops.update_scale_hysteresis(scale, growth, hyst, torch.zeros(1, device=device), 2.0, 0.5, 1, 1)
    assert scale.item() == pytest.approx(3.0e38, rel=1e-6)
    assert growth.item() == 0


# bad input --------------------------------------------------------------------------------


def test_bad_inputs_name_the_argument(device):
    good = make([10, 20], torch.float32, device)
    outs = poisoned_like(good, torch.float32)
    noop = flag(device)
    with pytest.raises(TypeError, match=r"multi_tensor_scale: inputs\[1\] has dtype torch.float64"):
        _ops.multi_tensor_scale(CHUNK, noop, [good[0], good[1].double()], outs, 1.0)
    with pytest.raises(TypeError, match=r"outputs\[1\] has dtype torch.float16 but outputs\[0\] has torch.float32"):
        _ops.multi_tensor_scale(CHUNK, noop, good, [outs[0], outs[1].half()], 1.0)
    with pytest.raises(ValueError, match=r"tensor lists must have the same length"):
        _ops.multi_tensor_scale(CHUNK, noop, good, outs[:1], 1.0)
    with pytest.raises(ValueError, match=r"outputs\[1\] has 5 elements but inputs\[1\] has 20"):
        _ops.multi_tensor_scale(CHUNK, noop, good, [outs[0], outs[1][:5]], 1.0)
    with pytest.raises(ValueError, match=r"inputs\[0\] is not contiguous"):
        _ops.multi_tensor_scale(CHUNK, noop, [torch.randn(4, 6, device=device).t(), good[1]], outs, 1.0)
    with pytest.raises(TypeError, match=r"noop_flag has dtype torch.float32"):
        _ops.multi_tensor_scale(CHUNK, noop.float(), good, outs, 1.0)
    with pytest.raises(ValueError, match=r"noop_flag must have exactly one element"):
        _ops.multi_tensor_scale(CHUNK, torch.zeros(2, dtype=torch.int32, device=device), good, outs, 1.0)
    with pytest.raises(ValueError, match=r"chunk_size must be positive"):
        _ops.multi_tensor_scale(0, noop, good, outs, 1.0)
    with pytest.raises(TypeError, match=r"scale_tensor has dtype torch.float16"):
        _ops.multi_tensor_scale(CHUNK, noop, good, outs, 1.0, torch.ones(1, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match=r"arg_to_check must be -1"):
        _ops.multi_tensor_axpby(CHUNK, noop, good, good, outs, 1.0, 1.0, 2)
    with pytest.raises(ValueError, match=r"x\[0\], y\[0\] and out\[0\] must have the same number of elements"):
        _ops.multi_tensor_axpby(CHUNK, noop, good, good[::-1], outs, 1.0, 1.0, -1)
    with pytest.raises(TypeError, match=r"inv_scale has dtype torch.float64"):
        bad_scale = torch.ones(1, dtype=torch.float64, device=device)
        _ops.multi_tensor_unscale_l2norm(CHUNK, noop, good, [], bad_scale, False)
    with pytest.raises(TypeError, match=r"growth_tracker has dtype torch.int64"):
        _ops.update_scale_hysteresis(
            torch.ones(1, device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
            torch.ones(1, dtype=torch.int32, device=device),
            torch.zeros(1, device=device),
            2.0,
            0.5,
            10,
            1,
        )
    with pytest.raises(ValueError, match=r"tensor_lists must hold 2 lists, got 1"):
        multi_tensor_applier(amp_C.multi_tensor_scale, noop, [good], 1.0)


@pytest.mark.gpu
def test_wrong_device_is_named():
    good = make([10], torch.float32, "cuda")
    with pytest.raises(ValueError, match=r"outputs\[0\] is on cpu, expected cuda:0"):
        _ops.multi_tensor_scale(CHUNK, flag("cuda"), good, [torch.empty(10)], 1.0)
    with pytest.raises(ValueError, match=r"inputs\[0\] is on cuda:0, expected cpu"):
        _ops.multi_tensor_l2norm(CHUNK, flag("cpu"), good, False)


# dispatcher integration -------------------------------------------------------------------


def _opcheck_cases(device):
    noop = flag(device)
    xs = make([3, 130], torch.float32, device)
    ys = make([3, 130], torch.float16, device)
    outs = poisoned_like(xs, torch.float32)
    inv = torch.tensor([0.5], device=device)
    return [
        (_ops.multi_tensor_scale, (CHUNK, noop, ys, outs, 2.0, inv)),
        (_ops.multi_tensor_axpby, (CHUNK, noop, xs, xs, outs, 2.0, 3.0, -1)),
        (_ops.multi_tensor_l2norm, (CHUNK, noop, ys, True)),
        (_ops.multi_tensor_unscale_l2norm, (CHUNK, noop, ys, outs, inv, True)),
        (
            _ops.update_scale_hysteresis,
            (
                torch.ones(1, device=device),
                torch.zeros(1, dtype=torch.int32, device=device),
                torch.ones(1, dtype=torch.int32, device=device),
                torch.ones(1, device=device),
                2.0,
                0.5,
                3,
                1,
            ),
        ),
    ]


@pytest.mark.parametrize("case", range(5))
def test_opcheck(device, case):
    op, args = _opcheck_cases(device)[case]
    torch.library.opcheck(op, args)


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    params = make([64, 1000], torch.float32, device)
    grads = make([64, 1000], torch.float32, device)

    def clip(grads, max_norm: float):
        noop = torch.zeros(1, dtype=torch.int32, device=grads[0].device)
        total, _ = torch.ops.apex_core.multi_tensor_l2norm(CHUNK, noop, grads, False)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch.ops.apex_core.multi_tensor_scale(CHUNK, noop, grads, grads, 1.0, coef)
        return total

    eager_grads = [g.clone() for g in grads]
    expected = clip(eager_grads, 1.0)
    compiled = torch.compile(clip, fullgraph=True)
    got = compiled(grads, 1.0)
    torch.testing.assert_close(got, expected)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b)
    del params


# sizes and devices the kernels must get right ---------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
def test_more_than_2_pow_31_elements():
    n = (1 << 31) + 5
    x = torch.randn(n, dtype=torch.float16, device="cuda")
    out = torch.full_like(x, float("nan"))
    noop = flag("cuda")
    _ops.multi_tensor_scale(2048 * 32, noop, [x], [out], 2.0)
    assert noop.item() == 0
    tail = slice(n - 70000, n)
    torch.testing.assert_close(out[tail].float(), x[tail].float() * 2.0, rtol=1e-3, atol=0)
    assert not torch.isnan(out).any().item()
    total, _ = _ops.multi_tensor_l2norm(2048 * 32, noop, [x], False)
    expected = math.sqrt(sum(float(c.double().square().sum()) for c in x.split(1 << 28)))
    assert total.item() == pytest.approx(expected, rel=1e-4)


@pytest.mark.multigpu
def test_second_device_runs_there():
    with torch.cuda.device(0):
        xs = make([1000, 3], torch.float32, "cuda:1")
        outs = poisoned_like(xs, torch.float16)
        noop = flag("cuda:1")
        _ops.multi_tensor_scale(CHUNK, noop, xs, outs, 4.0)
        total, per = _ops.multi_tensor_l2norm(CHUNK, noop, xs, True)
    assert total.device == torch.device("cuda:1") and per.device == torch.device("cuda:1")
    for x, out in zip(xs, outs):
        assert_matches(out, x.double() * 4.0, torch.float16)
    expected = torch.stack([x.double().norm() for x in xs]).cpu()
    torch.testing.assert_close(per.cpu().double(), expected, rtol=1e-5, atol=0)


# dense non-contiguous layouts ---------------------------------------------------------------


def _channels_last(device, dtype=torch.float32, count=2):
    # 2*5*3*13 = 390 elements: channels-last is not contiguous, and spans several CHUNKs
    return [
        torch.randn(2, 5, 3, 13, device=device).to(dtype).contiguous(memory_format=torch.channels_last)
        for _ in range(count)
    ]


def test_channels_last_lists_are_accepted(device):
    """Upstream's multi-tensor apply takes channels-last tensors: same shape and strides at one
    index of every list, an element-wise pass over the storage."""
    x, y = _channels_last(device), _channels_last(device)
    out = [torch.full_like(t, float("nan")) for t in x]
    assert not x[0].is_contiguous() and out[0].stride() == x[0].stride()
    _ops.multi_tensor_scale(CHUNK, flag(device), x, out, 0.5)
    for xi, oi in zip(x, out):
        torch.testing.assert_close(oi, xi * 0.5)
    _ops.multi_tensor_axpby(CHUNK, flag(device), x, y, out, 2.0, -1.0, -1)
    for xi, yi, oi in zip(x, y, out):
        torch.testing.assert_close(oi, 2.0 * xi - yi)
    total, per = _ops.multi_tensor_l2norm(CHUNK, flag(device), x, True)
    torch.testing.assert_close(per, torch.stack([t.norm() for t in x]))
    torch.testing.assert_close(total.reshape(()), per.norm())
    inv = torch.tensor([0.25], device=device)
    _ops.multi_tensor_unscale_l2norm(CHUNK, flag(device), x, out, inv, True)
    for xi, oi in zip(x, out):
        torch.testing.assert_close(oi, xi * 0.25)


def test_other_layouts_at_one_index_and_strided_views_are_refused(device):
    x = _channels_last(device)
    contiguous_out = [torch.empty(t.shape, device=device) for t in x]
    with pytest.raises(ValueError, match=r"inputs\[0\] is not contiguous and outputs\[0\] has another layout"):
        _ops.multi_tensor_scale(CHUNK, flag(device), x, contiguous_out, 1.0)
    with pytest.raises(ValueError, match=r"x\[0\] is not contiguous and y\[0\] has another layout"):
        _ops.multi_tensor_axpby(CHUNK, flag(device), x, contiguous_out, contiguous_out, 1.0, 1.0, -1)
    view = torch.randn(8, 6, device=device)[:, ::2]
    with pytest.raises(ValueError, match=r"inputs\[1\] is not contiguous and not dense"):
        _ops.multi_tensor_l2norm(CHUNK, flag(device), [x[0], view], False)
