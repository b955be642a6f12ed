"""amp.init: O1's function casts by upstream Apex's lists, the handle, the cache, banned and in-place
functions, registries and decorators, disable_casts, recurrent networks, and O1 through amp.initialize.

Before this module's code existed, ``amp.init``, ``amp.AmpHandle`` and ``amp.NoOpHandle`` did not
exist (every test here failed at the first call), and O1 cast only inside a model's forward, by
torch.autocast's lists: a bare ``F.linear`` outside a forward stayed fp32, and ``F.gelu``,
``F.softmin``, ``F.normalize`` and ``Tensor.sum`` of a half input stayed half (the list test below).

Upstream casts CUDA tensors only; the tests pass ``device_types`` (or widen ``CAST_DEVICE_TYPES``)
to the device under test, so that the CPU runs check the same machinery. The package conftest
undoes every test's patches.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from apex import amp
from apex.amp.lists import functional_overrides, tensor_overrides, torch_overrides

FP32 = torch.float32
HALVES = pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])


def init_on(device, half=torch.float16, **kwargs) -> amp.AmpHandle:
    """amp.init casting tensors of ``device``'s type."""
    return amp.init(dtype=half, device_types=(torch.device(device).type,), **kwargs)


def snapshot() -> dict:
    """Every attribute amp.init may replace: (owner, name) -> (value, whether the owner has its own)."""
    found = {}
    for lists in (functional_overrides, torch_overrides, tensor_overrides):
        owner = lists.MODULE
        names = lists.FP16_FUNCS + lists.FP32_FUNCS + lists.CASTS + lists.SEQUENCE_CASTS
        # in-place forms: of the fp32 list (refused on reduced precision); of every list for methods
        inplace = lists.FP32_FUNCS + (lists.FP16_FUNCS + lists.CASTS if lists is tensor_overrides else [])
        names += [name + "_" for name in inplace]
        names += [name for name, _ in getattr(lists, "BANNED_FUNCS", [])]
        for name in names:
            if hasattr(owner, name):
                found[(owner, name)] = (getattr(owner, name), name in vars(owner))
    rnn = torch.nn.modules.rnn
    found[(rnn, "_VF")] = (rnn._VF, True)
    found[(rnn, "_rnn_impls")] = (dict(rnn._rnn_impls), True)
    found[(nn.RNNBase, "check_input")] = (nn.RNNBase.check_input, True)
    return found


def current(previous: dict) -> dict:
    now = {}
    for owner, name in previous:
        value = getattr(owner, name)
        now[(owner, name)] = (dict(value) if isinstance(value, dict) else value, name in vars(owner))
    return now


# --- the handle and the patching ------------------------------------------------------------


def test_init_returns_a_handle_kept_in_amp_state():
    handle = amp.init()
    assert isinstance(handle, amp.AmpHandle) and amp._amp_state.handle is handle
    assert handle.is_active() and handle.has_cache and handle.dtype == torch.float16
    assert handle.device_types == ("cuda",)  # upstream's rule: CUDA tensors only
    assert amp.init is amp.amp.init
    assert amp.init(device_types="cpu").device_types == ("cpu",)


def test_every_listed_function_is_patched_and_deactivate_restores_all():
    before = snapshot()
    handle = amp.init()
    during = current(before)
    changed = {key for key in before if during[key][0] is not before[key][0] and during[key][0] != before[key][0]}
    assert changed == set(before)  # everything on the lists that this torch has, RNN hooks included
    assert torch.mm.__wrapped__ is before[(torch, "mm")][0]  # wrapped once, around the original
    handle._deactivate()
    assert current(before) == before
    assert not handle.is_active()


def test_init_again_undoes_the_previous_patches_first():
    before = snapshot()
    first = amp.init()
    second = amp.init(dtype=torch.bfloat16)
    assert not first.is_active() and second.is_active() and amp._amp_state.handle is second
    assert torch.mm.__wrapped__ is before[(torch, "mm")][0]  # not a wrapper of a wrapper
    second._deactivate()
    assert current(before) == before


def test_disabled_init_is_a_noop_handle():
    before = snapshot()
    amp.init()
    handle = amp.init(enabled=False)  # also undoes the active one
    assert isinstance(handle, amp.NoOpHandle) and amp._amp_state.handle is handle
    assert current(before) == before
    assert not handle.is_active() and not handle.has_cache and not handle.verbose
    handle._clear_cache()
    handle._deactivate()
    with handle.scale_loss(torch.ones(()), None) as loss:
        assert loss.item() == 1.0
    x = torch.randn(2, 3)
    assert F.linear(x, torch.randn(4, 3)).dtype == FP32


def test_bad_dtype_and_old_api():
    with pytest.raises(TypeError, match=r"float16 or torch\.bfloat16"):
        amp.init(dtype=torch.float64)
    handle = amp.init()
    with pytest.raises(RuntimeError, match="no longer supported"):
        with handle.scale_loss(torch.ones(()), None):
            pass


def test_tensors_of_other_devices_pass_through():
    amp.init(dtype=torch.bfloat16)  # CUDA only
    x, w = torch.randn(2, 3), nn.Parameter(torch.randn(4, 3))
    assert F.linear(x, w).dtype == FP32
    h = x.to(torch.bfloat16)
    assert F.softmax(h, -1).dtype == torch.bfloat16 and (h + x).dtype == FP32  # torch's own promotion
    assert not amp._amp_state.handle.cache


# --- the lists -----------------------------------------------------------------------------------

# Upstream's lists, as the inventory (section 12.6) gives them.
SPEC_FUNCTIONAL_HALF = {*(f"conv{d}d" for d in (1, 2, 3)), *(f"conv_transpose{d}d" for d in (1, 2, 3)), "conv_tbc"}
SPEC_FUNCTIONAL_HALF |= {"linear"}
SPEC_TORCH_HALF = SPEC_FUNCTIONAL_HALF - {"linear"} | {"prelu", "addmm", "addmv", "addr", "matmul", "mm", "mv"}
SPEC_TORCH_HALF |= {"addbmm", "baddbmm", "bmm"}
SPEC_TORCH_FLOAT = set(
    "acos asin cosh erfinv exp expm1 log log10 log2 reciprocal rsqrt sinh tan pow cumprod cumsum dist norm prod std "
    "sum var renorm".split()
)
SPEC_FUNCTIONAL_FLOAT = set(
    "interpolate grid_sample softplus softmin log_softmax softmax gelu layer_norm group_norm local_response_norm "
    "normalize cosine_similarity poisson_nll_loss cosine_embedding_loss cross_entropy hinge_embedding_loss kl_div "
    "l1_loss mse_loss margin_ranking_loss multilabel_margin_loss multilabel_soft_margin_loss multi_margin_loss "
    "nll_loss binary_cross_entropy_with_logits smooth_l1_loss soft_margin_loss triplet_margin_loss ctc_loss".split()
)
SPEC_TORCH_PROMOTE = set("addcdiv addcmul atan2 cross bilinear dot add div mul eq equal ge gt le lt ne".split())
SPEC_TENSOR_OPERATORS = {
    f"__{prefix}{op}__" for op in ("add", "sub", "mul", "truediv") for prefix in ("", "r", "i")
} | {f"__{op}__" for op in ("eq", "ne", "lt", "le", "gt", "ge")}


def test_lists_are_upstreams():
    assert set(functional_overrides.FP16_FUNCS) == SPEC_FUNCTIONAL_HALF
    assert set(functional_overrides.FP32_FUNCS) == SPEC_FUNCTIONAL_FLOAT
    assert [name for name, _ in functional_overrides.BANNED_FUNCS] == ["binary_cross_entropy"]
    assert set(torch_overrides.FP16_FUNCS) == SPEC_TORCH_HALF
    assert set(torch_overrides.FP32_FUNCS) == SPEC_TORCH_FLOAT
    assert set(torch_overrides.CASTS) == SPEC_TORCH_PROMOTE
    assert torch_overrides.SEQUENCE_CASTS == ["cat", "stack"]
    on_tensor = {name for name in SPEC_TORCH_HALF if hasattr(torch.Tensor, name)}
    assert set(tensor_overrides.FP16_FUNCS) == {"__matmul__"} | on_tensor
    on_tensor = {name for name in SPEC_TORCH_FLOAT if hasattr(torch.Tensor, name)}
    assert set(tensor_overrides.FP32_FUNCS) == {"__pow__", "__rpow__", "__ipow__", "cpu"} | on_tensor
    assert SPEC_TENSOR_OPERATORS <= set(tensor_overrides.CASTS)
    assert {"add", "mul", "eq", "addcmul"} <= set(tensor_overrides.CASTS)
    # Every function name is real in this torch (a typo would silently patch nothing).
    for lists in (functional_overrides, torch_overrides):
        for name in lists.FP16_FUNCS + lists.FP32_FUNCS + lists.CASTS + lists.SEQUENCE_CASTS:
            assert hasattr(lists.MODULE, name), name


def _inputs(device, half):
    gen = torch.Generator().manual_seed(3)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    return randn


def half_calls(randn):
    """name -> a call that takes an fp32 tensor ``x`` (shape 2x4) and returns a tensor."""
    w = nn.Parameter(randn(3, 4))
    return {
        "F.linear": lambda x: F.linear(x, w),
        "F.conv1d": lambda x: F.conv1d(x.view(1, 2, 4), randn(3, 2, 3)),
        "F.conv2d": lambda x: F.conv2d(x.view(1, 2, 2, 2), randn(3, 2, 1, 1)),
        "torch.conv_transpose1d": lambda x: torch.conv_transpose1d(x.view(1, 2, 4), randn(2, 3, 2)),
        "torch.matmul": lambda x: torch.matmul(x, w.t()),
        "torch.mm": lambda x: torch.mm(x, w.t()),
        "Tensor.mm": lambda x: x.mm(w.t()),
        "@": lambda x: x @ w.t(),
        "torch.mv": lambda x: torch.mv(x, randn(4)),
        "torch.addmm": lambda x: torch.addmm(randn(2, 3), x, w.t()),
        "torch.bmm": lambda x: torch.bmm(x.view(1, 2, 4), randn(1, 4, 5)),
        "torch.baddbmm": lambda x: torch.baddbmm(randn(1, 2, 5), x.view(1, 2, 4), randn(1, 4, 5)),
        "torch.prelu": lambda x: torch.prelu(x, randn(1)),
    }


def float_calls(randn):
    """name -> a call that takes a reduced-precision tensor ``h`` (shape 2x4, positive) and returns a tensor.

    Each looks its function up at call time (a function object taken before amp.init is the original)."""
    target = torch.tensor([1, 3], device=randn(1).device)
    return {
        "F.softmax": lambda h: F.softmax(h, -1),
        "F.log_softmax": lambda h: F.log_softmax(h, -1),
        "F.softmin": lambda h: F.softmin(h, -1),
        "F.gelu": lambda h: F.gelu(h),
        "F.normalize": lambda h: F.normalize(h, dim=-1),
        "F.layer_norm": lambda h: F.layer_norm(h, (4,)),
        "F.group_norm": lambda h: F.group_norm(h, 2),
        "F.mse_loss": lambda h: F.mse_loss(h, randn(2, 4)),
        "F.cross_entropy": lambda h: F.cross_entropy(h, target),
        "F.nll_loss": lambda h: F.nll_loss(h, target),
        "F.bce_with_logits": lambda h: F.binary_cross_entropy_with_logits(h, randn(2, 4).sigmoid()),
        "torch.sum": lambda h: torch.sum(h),
        "Tensor.sum": lambda h: h.sum(),
        "torch.exp": lambda h: torch.exp(h),
        "torch.log": lambda h: torch.log(h),
        "torch.cumsum": lambda h: torch.cumsum(h, 0),
        "torch.norm": lambda h: torch.norm(h),
        "Tensor.pow": lambda h: h.pow(2),
        "**": lambda h: h**2,
        "r**": lambda h: 2**h,
        "torch.prod": lambda h: torch.prod(h),
        "Tensor.var": lambda h: h.var(),
    }


@HALVES
def test_reduced_precision_list(half, device):
    calls = half_calls(_inputs(device, half))
    init_on(device, half)
    for name, call in calls.items():
        x = torch.randn(2, 4, device=device, requires_grad=True)
        out = call(x)
        assert out.dtype == half, name
        out.float().sum().backward()
        assert x.grad.dtype == FP32 and torch.isfinite(x.grad).all(), name


@HALVES
def test_fp32_list(half, device):
    calls = float_calls(_inputs(device, half))
    init_on(device, half)
    for name, call in calls.items():
        h = (torch.rand(2, 4, device=device) + 0.5).to(half).requires_grad_()
        out = call(h)
        assert out.dtype == FP32, name
        out.sum().backward()
        assert h.grad.dtype == half, name
    # float64 goes to fp32 as well, as upstream.
    assert F.softmax(torch.randn(3, device=device, dtype=torch.float64), 0).dtype == FP32


@HALVES
def test_promote_list(half, device):
    init_on(device, half)
    f = torch.randn(2, 4, device=device)
    h = f.to(half)
    mixed = {
        "torch.add": torch.add(h, f),
        "+": h + f,
        "r+": f + h,
        "-": h - f,
        "*": h * f,
        "/": h / f,
        "torch.mul": torch.mul(f, h),
        "Tensor.add": h.add(f),
        "torch.atan2": torch.atan2(h, f),
        "torch.addcmul": torch.addcmul(f, h, h),
        "torch.cat": torch.cat([h, f]),
        "torch.cat(tensors=)": torch.cat(tensors=[f, h], dim=1),
        "torch.stack": torch.stack([h, f, h]),
    }
    for name, out in mixed.items():
        assert out.dtype == FP32, name
    assert (h + h).dtype == half and torch.cat([h, h]).dtype == half  # one dtype: untouched
    assert (h + f.double()).dtype == torch.float64  # the widest
    assert torch.equal((h == f), (h.float() == f)) and torch.eq(h, f).dtype == torch.bool
    # The promoted call computes in fp32: the same as casting by hand.
    assert torch.equal(h * f, h.float() * f)


@HALVES
def test_inplace_fp32_functions_refuse_reduced_precision(half, device):
    init_on(device, half)
    h = torch.rand(3, device=device).to(half)
    short = {torch.float16: "fp16", torch.bfloat16: "bf16"}[half]
    with pytest.raises(NotImplementedError, match=f"Cannot call in-place method exp_ on {short} Tensors"):
        h.exp_()
    with pytest.raises(NotImplementedError, match=f"Cannot call in-place function exp_ with {short} arguments"):
        torch.exp_(h)
    f = torch.rand(3, device=device)
    expected = f.pow(h.float())
    f.pow_(h)  # an fp32 tensor takes it: the argument is cast to fp32
    assert torch.equal(f, expected)
    # Other in-place methods cast their arguments to self's dtype.
    f = torch.rand(3, device=device)
    before = h.clone()
    h.add_(f)
    assert h.dtype == half and torch.equal(h, before + f.to(half))
    f2 = f.clone()
    f2.mul_(h)
    assert f2.dtype == FP32 and torch.equal(f2, f * h.float())
    with amp.disable_casts():
        h.exp_()  # allowed while casts are off


@HALVES
def test_banned_function(half, device):
    p = torch.rand(4, device=device).clamp(0.05, 0.95)
    y = torch.rand(4, device=device)
    init_on(device, half)
    with pytest.raises(NotImplementedError) as raised:
        F.binary_cross_entropy(p.to(half), y)
    message = str(raised.value)
    assert "BCEWithLogitsLoss" in message and "register_float_function(torch, 'sigmoid')" in message
    assert "allow_banned=True" in message
    assert F.binary_cross_entropy(p, y).dtype == FP32  # fp32 inputs are fine
    with pytest.raises(NotImplementedError):
        nn.BCELoss()(p.to(half), y)
    init_on(device, half, allow_banned=True)
    out = F.binary_cross_entropy(p.to(half), y)
    assert out.dtype == FP32
    torch.testing.assert_close(out, F.binary_cross_entropy(p.to(half).float(), y))


@HALVES
def test_upstreams_lists_win_over_autocasts(half, device):
    """torch.autocast leaves these in reduced precision; upstream's O1 lists run them in fp32."""
    init_on(device, half)
    h = torch.rand(2, 4, device=device).to(half)
    for name, out in {
        "gelu": F.gelu(h),
        "softmin": F.softmin(h, -1),
        "normalize": F.normalize(h, dim=-1),
        "sum": h.sum(),
        "cumsum": h.cumsum(0),
    }.items():
        assert out.dtype == FP32, name


@pytest.mark.gpu
def test_cpu_transfer_is_fp32_cuda():
    amp.init()
    h = torch.randn(3, device="cuda", dtype=torch.float16)
    out = h.cpu()
    assert out.device.type == "cpu" and out.dtype == FP32 and torch.equal(out, h.float().cpu())


# --- the cache -----------------------------------------------------------------------------------


def test_cache_of_parameter_casts(device):
    ns = torch.nn.Module()  # any namespace with a function on it
    ns.passthrough = lambda t: t
    amp.register_half_function(ns, "passthrough")
    handle = init_on(device)
    w = nn.Parameter(torch.randn(3, 4, device=device))
    first = ns.passthrough(w)
    assert first.dtype == torch.float16 and ns.passthrough(w) is first  # one cast for the iteration
    plain = torch.randn(3, device=device)  # not a parameter: never cached
    assert ns.passthrough(plain) is not ns.passthrough(plain)
    assert list(handle.cache) == [id(w)]
    handle._clear_cache()
    assert ns.passthrough(w) is not first
    # A copy made without grad does not stand in for one that needs the parameter's graph ...
    handle._clear_cache()
    with torch.no_grad():
        eval_copy = ns.passthrough(w)
    train_copy = ns.passthrough(w)
    assert not eval_copy.requires_grad and train_copy.requires_grad and train_copy is not eval_copy
    # ... but under no_grad any copy does.
    with torch.no_grad():
        assert ns.passthrough(w) is train_copy
    handle.remove_cache(w)
    assert not handle.cache


def test_no_cache_when_disabled(device):
    handle = init_on(device, enable_caching=False)
    w = nn.Parameter(torch.randn(3, 4, device=device))
    x = torch.randn(2, 4, device=device)
    F.linear(x, w)
    assert not handle.has_cache and not handle.cache


def test_cache_lives_for_one_iteration_of_initialize(device, make_net, monkeypatch):
    monkeypatch.setattr(amp.amp, "CAST_DEVICE_TYPES", ("cuda", torch.device(device).type))
    net = make_net(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level="O1", autocast_dtype=torch.bfloat16, verbosity=0)
    handle = amp._amp_state.handle
    x = torch.randn(6, 8, device=device)
    out = net(x)
    cached = handle.cache[id(net.fc1.weight)][1]
    net(x)
    assert handle.cache[id(net.fc1.weight)][1] is cached  # the second forward reuses it
    with amp.scale_loss(out.float().square().mean(), opt) as scaled:
        scaled.backward()
    assert not handle.cache  # the iteration ended with scale_loss
    assert net.fc1.weight.grad.dtype == FP32
    net(x)
    assert handle.cache[id(net.fc1.weight)][1] is not cached
    opt.step()  # the step changed the parameters: their casts are dropped
    assert not handle.cache


# --- registries, decorators, disable_casts, verbose ----------------------------------------------


def test_registries(device):
    ns = torch.nn.Module()
    ns.f = lambda t: t.dtype
    ns.g = lambda t: t.dtype
    ns.p = lambda a, b: (a.dtype, b.dtype)
    original_f = ns.f
    amp.register_float_function(ns, "f")
    amp.register_half_function(ns, "g")
    amp.register_promote_function(ns, "p")
    x = torch.randn(2, device=device)
    h = x.half()
    assert (ns.f(h), ns.g(x), ns.p(h, x)) == (torch.float16, FP32, (torch.float16, FP32))  # before init
    handle = init_on(device)
    assert (ns.f(h), ns.g(x), ns.p(h, x)) == (FP32, torch.float16, (FP32, FP32))
    # Registering after init waits for the next init; re-init keeps the earlier registrations.
    ns.late = lambda t: t.dtype
    amp.register_half_function(ns, "late")
    assert ns.late(x) == FP32
    init_on(device)
    assert ns.late(x) == torch.float16 and ns.f(h) == FP32
    assert not handle.is_active()
    amp._amp_state.handle._deactivate()
    assert ns.f is original_f and ns.f(h) == torch.float16


def test_decorators_follow_the_handle(device):
    @amp.half_function
    def g(t):
        return t.dtype

    @amp.float_function
    def f(t):
        return t.dtype

    @amp.promote_function
    def p(a, b):
        return a.dtype, b.dtype

    x = torch.randn(2, device=device)
    h = x.to(torch.bfloat16)
    assert (g(x), f(h), p(h, x)) == (FP32, torch.bfloat16, (torch.bfloat16, FP32))
    handle = init_on(device, torch.bfloat16)
    assert (g(x), f(h), p(h, x)) == (torch.bfloat16, FP32, (FP32, FP32))
    assert amp.float_function(g)(x) == FP32  # re-decorating replaces the kind
    handle._deactivate()
    assert g(x) == FP32


def test_disable_casts_is_per_thread_and_nests(device):
    init_on(device)
    x, w = torch.randn(2, 4, device=device), torch.randn(3, 4, device=device)
    seen = {}

    def other_thread():
        seen["other"] = F.linear(x, w).dtype

    with amp.disable_casts():
        with amp.disable_casts():
            assert F.linear(x, w).dtype == FP32
        assert F.linear(x, w).dtype == FP32 and not amp._amp_state.handle.is_active()
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen["other"] == torch.float16
    assert F.linear(x, w).dtype == torch.float16
    with amp._amp_state.handle._disable_casts():
        assert F.linear(x, w).dtype == FP32


def test_verbose_prints_the_casts(device, capsys):
    init_on(device, verbose=True)
    F.linear(torch.randn(2, 4, device=device), torch.randn(3, 4, device=device))
    printed = capsys.readouterr().out
    assert "fp32 -> fp16 (linear)" in printed


# --- recurrent networks ---------------------------------------------------------------------------


def _rnn_cases(device):
    torch.manual_seed(5)
    return {
        "LSTM": nn.LSTM(4, 6, num_layers=2),
        "GRU": nn.GRU(4, 6, bidirectional=True),
        "RNN": nn.RNN(4, 6, nonlinearity="relu"),
        "LSTMCell": nn.LSTMCell(4, 6),
        "GRUCell": nn.GRUCell(4, 6),
        "RNNCell": nn.RNNCell(4, 6),
    }


def _first(output):
    while isinstance(output, tuple):
        output = output[0]
    return output


@HALVES
def test_rnns_run_in_reduced_precision(half, device):
    modules = {name: m.to(device) for name, m in _rnn_cases(device).items()}
    seq = torch.randn(5, 3, 4, device=device)
    references = {}
    for name, module in modules.items():
        x = seq[0] if name.endswith("Cell") else seq
        out = _first(module(x))
        references[name] = (out, torch.autograd.grad(out.sum(), list(module.parameters())))
    init_on(device, half)
    for name, module in modules.items():
        x = seq[0] if name.endswith("Cell") else seq
        for given in (x, x.to(half)):  # an fp32 or an already reduced-precision input
            out = _first(module(given))
            assert out.dtype == half, name
            grads = torch.autograd.grad(out.float().sum(), list(module.parameters()))
            ref_out, ref_grads = references[name]
            tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1}[half]
            torch.testing.assert_close(out.float(), ref_out, rtol=tol, atol=tol)
            for g, r in zip(grads, ref_grads):
                assert g.dtype == FP32
                torch.testing.assert_close(g, r, rtol=tol, atol=tol * r.abs().max().item())


@HALVES
def test_packed_sequence_and_hidden_state(half, device):
    lstm = nn.LSTM(4, 6).to(device)
    seq = torch.randn(5, 3, 4, device=device)
    packed = pack_padded_sequence(seq, [5, 4, 2])
    h0 = (torch.randn(1, 3, 6, device=device), torch.randn(1, 3, 6, device=device))
    ref, _ = lstm(packed, h0)
    init_on(device, half)
    out, (h, c) = lstm(packed, h0)
    assert out.data.dtype == half and h.dtype == half and c.dtype == half
    torch.testing.assert_close(out.data.float(), ref.data, rtol=0.1, atol=0.1)
    out.data.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == FP32 for p in lstm.parameters())


def test_rnn_without_init_refuses_mixed_dtypes(device):
    """What the check_input hook is for: torch itself refuses a half input to an fp32 LSTM."""
    lstm = nn.LSTM(4, 6).to(device)
    x = torch.randn(5, 3, 4, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="type"):
        lstm(x, (torch.zeros(1, 3, 6, device=device),) * 2)
    init_on(device)
    assert lstm(x, (torch.zeros(1, 3, 6, device=device),) * 2)[0].dtype == torch.float16


# --- O1 through amp.initialize -----------------------------------------------------------------------


def test_o1_trains(device, monkeypatch):
    """A small classifier at O1: half activations, fp32 weights and loss, falling loss, clean steps."""
    half = torch.float16 if device == "cuda" else torch.bfloat16
    monkeypatch.setattr(amp.amp, "CAST_DEVICE_TYPES", ("cuda", torch.device(device).type))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O1", autocast_dtype=half, verbosity=0)
    x = torch.randn(64, 16, device=device)
    y = (x[:, :4].argmax(1)).to(device)
    losses = []
    for _ in range(30):
        logits = model(x)
        assert logits.dtype == half
        loss = F.cross_entropy(logits, y)
        assert loss.dtype == FP32
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.dtype == FP32 for p in model.parameters())
    assert losses[-1] < 0.5 * losses[0], losses
    if half == torch.float16:  # dynamic scaling (bf16 defaults to a static 1.0), no overflow on the way
        assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**16
