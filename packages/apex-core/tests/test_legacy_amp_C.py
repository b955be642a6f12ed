"""Upstream's top-level ``amp_C`` and ``apex_C`` modules and ``apex._autocast_utils``.

Each ``amp_C`` function is called as upstream's is, through ``multi_tensor_applier``, against a
float64 reference of upstream's arithmetic written here (on the CPU, and marked gpu on CUDA).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import amp_C
import apex_C
import pytest
import torch

from apex.multi_tensor_apply import multi_tensor_applier


def _has_optimizers() -> bool:
    try:
        import apex.optimizers  # noqa: F401
    except ImportError:
        return False
    return True


HAS_OPTIMIZERS = _has_optimizers()
needs_optimizers = pytest.mark.skipif(not HAS_OPTIMIZERS, reason="apex-optimizers is not installed")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 130, 1000]
TOL = {torch.float64: 1e-6, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

UPSTREAM_FUNCTIONS = [
    "multi_tensor_scale",
    "multi_tensor_sgd",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_l2norm_mp",
    "multi_tensor_l2norm_scale",
    "multi_tensor_unscale_l2norm",
    "multi_tensor_lamb_stage1_cuda",
    "multi_tensor_lamb_stage2_cuda",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_adagrad",
    "multi_tensor_novograd",
    "multi_tensor_lamb",
    "multi_tensor_lamb_mp",
    "update_scale_hysteresis",
]


def rand(sizes, dtype, device, scale=1.0, positive=False):
    out = []
    for n in sizes:
        t = torch.randn(n, dtype=torch.float64) * scale
        out.append((t.abs() if positive else t).to(dtype=dtype, device=device))
    return out


def flag(device, value=0):
    return torch.full((1,), value, dtype=torch.int32, device=device)


def close(actual, expected, dtype, scale=1.0):
    tol = TOL[dtype] * scale
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(), rtol=tol, atol=tol)


def f64(tensors):
    return [t.detach().cpu().double() for t in tensors]


# the modules ------------------------------------------------------------------------------


def _imports(module: str) -> dict:
    code = (
        f"import json, sys; import {module}; "
        "print(json.dumps({'mods': sorted(m for m in sys.modules if m.split('.')[0] in ('apex', 'amp_C', 'apex_C')), "
        f"'names': sorted(n for n in dir({module}) if not n.startswith('_'))}}))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_amp_C_imports_in_a_fresh_interpreter():
    found = _imports("amp_C")
    assert set(UPSTREAM_FUNCTIONS) <= set(found["names"])
    assert "apex.core" in found["mods"]
    # the optimizer kernels are looked up when first called, not at import
    assert not any(m.startswith("apex.optimizers") for m in found["mods"]), found["mods"]


def test_apex_C_imports_in_a_fresh_interpreter():
    found = _imports("apex_C")
    assert {"flatten", "unflatten"} <= set(found["names"])
    assert found["mods"] == ["apex_C"]  # torch only: no apex package is imported


def test_apex_core_amp_C_is_the_top_level_module():
    from apex.core import amp_C as legacy

    assert legacy is amp_C
    import apex.core.amp_C

    assert apex.core.amp_C is amp_C


def test_plugin_provides_the_legacy_modules():
    from apex.core._plugin import PLUGIN

    assert PLUGIN.provides[0] == "apex.core"
    assert {"amp_C", "apex_C"} <= set(PLUGIN.provides)


def test_missing_apex_optimizers_names_the_distribution(monkeypatch):
    monkeypatch.setitem(sys.modules, "apex.optimizers", None)
    monkeypatch.setitem(sys.modules, "apex.optimizers._ops", None)
    g, p, m, v = ([torch.zeros(3)] for _ in range(4))
    with pytest.raises(ImportError, match="apex-optimizers"):
        multi_tensor_applier(amp_C.multi_tensor_adam, flag("cpu"), [g, p, m, v], 1e-3, 0.9, 0.99, 1e-8, 1, 1, 1, 0.0)


# apex_C -----------------------------------------------------------------------------------


def test_apex_C_flatten_unflatten_as_torch(device):
    tensors = [torch.randn(2, 3, device=device), torch.randn(5, device=device), torch.randn(1, 1, device=device)]
    flat = apex_C.flatten(tensors)
    torch.testing.assert_close(flat, torch.cat([t.reshape(-1) for t in tensors]))
    views = apex_C.unflatten(flat, tensors)
    assert [v.shape for v in views] == [t.shape for t in tensors]
    for v, t in zip(views, tensors):
        torch.testing.assert_close(v, t)
    flat.zero_()
    assert all((v == 0).all() for v in views)  # views into flat, as upstream's


# scale, axpby and the norms ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale(device, dtype):
    x = rand(SIZES, dtype, device)
    out = [torch.empty_like(t, dtype=torch.float32) for t in x]
    noop = flag(device)
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [x, out], 0.25)
    for o, e in zip(out, f64(x)):
        close(o, e * 0.25, torch.float32)
    assert noop.item() == 0
    x[1][3] = float("inf")
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [x, out], 0.25)
    assert noop.item() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_axpby(device, dtype):
    x, y = rand(SIZES, dtype, device), rand(SIZES, dtype, device)
    out = [torch.empty_like(t) for t in x]
    noop = flag(device)
    multi_tensor_applier(amp_C.multi_tensor_axpby, noop, [x, y, out], 2.0, -0.5, -1)
    for o, a, b in zip(out, f64(x), f64(y)):
        close(o, 2.0 * a - 0.5 * b, dtype)
    y[0][0] = float("nan")
    multi_tensor_applier(amp_C.multi_tensor_axpby, noop, [x, y, out], 2.0, -0.5, 0)
    assert noop.item() == 0  # only x is checked
    multi_tensor_applier(amp_C.multi_tensor_axpby, noop, [x, y, out], 2.0, -0.5, 1)
    assert noop.item() == 1


def _norms(tensors, factor=1.0):
    per = torch.stack([(t * factor).norm() for t in f64(tensors)])
    return per.norm().reshape(1), per


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["multi_tensor_l2norm", "multi_tensor_l2norm_mp"])
def test_l2norm(device, dtype, name):
    x = rand(SIZES, dtype, device)
    noop = flag(device)
    fn = getattr(amp_C, name)
    total, per = multi_tensor_applier(fn, noop, [x], True)
    e_total, e_per = _norms(x)
    assert total.shape == (1,) and per.shape == (len(x),) and total.dtype == per.dtype == torch.float32
    close(total, e_total, torch.float32)
    close(per, e_per, torch.float32)
    total, per = multi_tensor_applier(fn, noop, [x])  # per_tensor defaults to False
    assert total.shape == (1,) and per.shape == (0,)
    assert noop.item() == 0
    x[0][0] = float("inf")
    total, _ = multi_tensor_applier(fn, noop, [x], False)
    assert noop.item() == 1  # a non-finite norm sets the flag


def test_l2norm_mp_returns_zeros_when_noop_is_set(device):
    x = rand(SIZES, torch.float32, device)
    total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm_mp, flag(device, 1), [x], True)
    assert total.tolist() == [0.0] and per.tolist() == [0.0] * len(x)
    # the plain l2norm computes whatever the flag says
    total, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag(device, 1), [x], True)
    close(total, _norms(x)[0], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_scale(device, dtype):
    x = rand(SIZES, dtype, device)
    out = [torch.empty_like(t) for t in x]
    noop = flag(device)
    total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm_scale, noop, [x, out], 0.5, True)
    e_total, e_per = _norms(x)  # the norm of the input, before scaling
    close(total, e_total, torch.float32)
    close(per, e_per, torch.float32)
    for o, e in zip(out, f64(x)):
        close(o, e * 0.5, dtype)
    assert noop.item() == 0
    x[2][5] = float("nan")
    multi_tensor_applier(amp_C.multi_tensor_l2norm_scale, noop, [x, out], 0.5, False)
    assert noop.item() == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_unscale_l2norm(device, dtype):
    x = rand(SIZES, dtype, device, scale=64.0)
    before = [t.clone() for t in x]
    inv = torch.full((1,), 1 / 64, device=device)
    total, per = multi_tensor_applier(amp_C.multi_tensor_unscale_l2norm, flag(device), [x], inv, True)
    e_total, e_per = _norms(x, 1 / 64)
    assert total.shape == (1,)
    close(total, e_total, torch.float32)
    close(per, e_per, torch.float32)
    for t, b in zip(x, before):
        assert torch.equal(t, b)  # x is not modified


# update_scale_hysteresis ------------------------------------------------------------------


def _scaler_state(device, scale=4.0):
    return (
        torch.full((1,), scale, device=device),
        torch.zeros(1, dtype=torch.int32, device=device),
        torch.full((1,), 2, dtype=torch.int32, device=device),
    )


def test_update_scale_hysteresis_growth_factor_one_never_grows(device):
    scale, growth, hyst = _scaler_state(device)
    no_inf = torch.zeros(1, device=device)
    for _ in range(5):
        out = amp_C.update_scale_hysteresis(scale, growth, hyst, no_inf, 1.0, 0.5, 2, 2)
    assert out is scale
    assert scale.item() == 4.0
    assert growth.item() == 1  # 5 successes with an interval of 2: reset at 2 and 4
    inf = torch.ones(1, device=device)
    amp_C.update_scale_hysteresis(scale, growth, hyst, inf, 1.0, 0.5, 2, 2)
    amp_C.update_scale_hysteresis(scale, growth, hyst, inf, 1.0, 0.5, 2, 2)
    assert scale.item() == 2.0  # backs off after `hysteresis` overflows


@pytest.mark.parametrize("bad", [0.5, 0.0, -2.0, math.inf, math.nan])
def test_update_scale_hysteresis_rejects_bad_growth_factor(device, bad):
    scale, growth, hyst = _scaler_state(device)
    with pytest.raises(ValueError, match="growth_factor"):
        amp_C.update_scale_hysteresis(scale, growth, hyst, torch.zeros(1, device=device), bad, 0.5, 2, 2)


# optimizers: float64 references of upstream's arithmetic ------------------------------------


def ref_adam(g, p, m, v, lr, b1, b2, eps, step, mode, bias_correction, wd):
    bc1, bc2 = (1 - b1**step, 1 - b2**step) if bias_correction else (1.0, 1.0)
    if mode == 0:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    update = (m / bc1) / ((v / bc2).sqrt() + eps)
    if mode == 1:
        update = update + wd * p
    return g, p - lr * update, m, v


def _adam_inputs(dtype, device, state_dtype=None):
    g = rand(SIZES, dtype, device)
    p = rand(SIZES, dtype, device)
    m = rand(SIZES, state_dtype or dtype, device, 0.1)
    v = rand(SIZES, state_dtype or dtype, device, 0.1, positive=True)
    return g, p, m, v


@needs_optimizers
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mode", [0, 1])
def test_adam(device, dtype, mode):
    g, p, m, v = _adam_inputs(dtype, device)
    e = [ref_adam(*args, 1e-2, 0.9, 0.99, 1e-8, 3, mode, 1, 0.1) for args in zip(*map(f64, (g, p, m, v)))]
    grads_before = [t.clone() for t in g]
    noop = flag(device, 1)  # upstream's adam ignores the flag
    multi_tensor_applier(amp_C.multi_tensor_adam, noop, [g, p, m, v], 1e-2, 0.9, 0.99, 1e-8, 3, mode, 1, 0.1)
    for i, (_, ep, em, ev) in enumerate(e):
        close(p[i], ep, dtype)
        close(m[i], em, dtype)
        close(v[i], ev, dtype)
        assert torch.equal(g[i], grads_before[i])


@needs_optimizers
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("master", [False, True])
def test_adam_capturable(device, dtype, mode, master):
    state_dtype = torch.float32 if master else dtype
    g, p, m, v = _adam_inputs(dtype, device, state_dtype)
    g = [t * 128 for t in g]
    pm = [t.float() for t in p] if master else None
    lr = torch.full((1,), 1e-2, device=device)
    step = torch.full((1,), 2, dtype=torch.int32, device=device)
    inv = torch.full((1,), 1 / 128, device=device)
    lists = [g, p, m, v] + ([pm] if master else [])
    fn = amp_C.multi_tensor_adam_capturable_master if master else amp_C.multi_tensor_adam_capturable
    src = pm if master else p
    e = [
        ref_adam(gi / 128, *rest, 1e-2, 0.9, 0.99, 1e-8, 2, mode, 1, 0.1)
        for gi, *rest in zip(*map(f64, (g, src, m, v)))
    ]
    before = [[t.clone() for t in lst] for lst in lists]
    # noop set: nothing is written
    multi_tensor_applier(fn, flag(device, 1), lists, lr, 0.9, 0.99, 1e-8, step, mode, 1, 0.1, inv)
    for lst, b in zip(lists, before):
        assert all(torch.equal(x, y) for x, y in zip(lst, b))
    multi_tensor_applier(fn, flag(device), lists, lr, 0.9, 0.99, 1e-8, step, mode, 1, 0.1, inv)
    for i, (eg, ep, em, ev) in enumerate(e):
        close(g[i], eg, dtype)  # the unscaled gradient (plus the L2 term in mode 0) is written back
        close(p[i], ep, dtype)
        close(m[i], em, state_dtype)
        close(v[i], ev, state_dtype)
        if master:
            close(pm[i], ep, torch.float32)
            assert torch.equal(p[i], pm[i].to(dtype))


def ref_sgd(g, w, mom, wd, momentum, dampening, lr, nesterov, first_run, wd_after, scale):
    g = g * scale
    if wd != 0 and not wd_after:
        g = g + wd * w
    if momentum != 0:
        mom = g if first_run else momentum * mom + (1 - dampening) * g
        g = g + momentum * mom if nesterov else mom
    if wd != 0 and wd_after:
        g = g + wd * w
    return w - lr * g, mom


@needs_optimizers
@pytest.mark.parametrize(
    "combo",
    [
        (torch.float32, torch.float32, 3),
        (torch.float16, torch.float16, 3),
        (torch.float16, torch.float32, 4),
        (torch.float32, torch.float32, 4),
    ],
)
@pytest.mark.parametrize("first_run", [True, False])
@pytest.mark.parametrize("nesterov,wd_after", [(False, False), (True, False), (False, True)])
def test_sgd(device, combo, first_run, nesterov, wd_after):
    gdtype, wdtype, depth = combo
    g = rand(SIZES, gdtype, device, 4.0)
    w = rand(SIZES, wdtype, device)
    mom = rand(SIZES, wdtype, device, 0.1)
    lists = [g, w, mom] + ([[t.half() for t in w]] if depth == 4 else [])
    args = (0.01, 0.9, 0.0, 0.1, nesterov, first_run, wd_after, 0.25)
    e = [ref_sgd(gi, wi, mi, *args) for gi, wi, mi in zip(*map(f64, (g, w, mom)))]
    before = [[t.clone() for t in lst] for lst in lists]
    multi_tensor_applier(amp_C.multi_tensor_sgd, flag(device, 1), lists, *args)  # skipped
    for lst, b in zip(lists, before):
        assert all(torch.equal(x, y) for x, y in zip(lst, b))
    multi_tensor_applier(amp_C.multi_tensor_sgd, flag(device), lists, *args)
    for i, (ew, em) in enumerate(e):
        close(w[i], ew, wdtype)
        close(mom[i], em, wdtype)
        if depth == 4:
            close(lists[3][i], ew, torch.float16)


@needs_optimizers
def test_sgd_without_momentum_leaves_the_buffers(device):
    g, w, mom = (
        rand(SIZES, torch.float32, device),
        rand(SIZES, torch.float32, device),
        rand(SIZES, torch.float32, device),
    )
    before = [t.clone() for t in mom]
    e = [
        ref_sgd(gi, wi, mi, 0.1, 0.0, 0.0, 0.5, False, False, False, 1.0)[0]
        for gi, wi, mi in zip(*map(f64, (g, w, mom)))
    ]
    multi_tensor_applier(
        amp_C.multi_tensor_sgd, flag(device), [g, w, mom], 0.1, 0.0, 0.0, 0.5, False, False, False, 1.0
    )
    for wi, ei, mi, bi in zip(w, e, mom, before):
        close(wi, ei, torch.float32)
        assert torch.equal(mi, bi)


@needs_optimizers
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("mode", [0, 1])
def test_adagrad(device, dtype, mode):
    g, p = rand(SIZES, dtype, device), rand(SIZES, dtype, device)
    h = rand(SIZES, dtype, device, positive=True)
    e = []
    for gi, pi, hi in zip(*map(f64, (g, p, h))):
        if mode == 0:
            gi = gi + 0.1 * pi
        hi = hi + gi * gi
        update = gi / (hi.sqrt() + 1e-8) + (0.1 * pi if mode == 1 else 0)
        e.append((pi - 0.05 * update, hi))
    multi_tensor_applier(amp_C.multi_tensor_adagrad, flag(device), [g, p, h], 0.05, 1e-8, mode, 0.1)
    for i, (ep, eh) in enumerate(e):
        close(p[i], ep, dtype)
        close(h[i], eh, dtype)


@needs_optimizers
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("norm_type", [2, 0])
def test_novograd(device, dtype, mode, norm_type):
    g, p, m = rand(SIZES, dtype, device), rand(SIZES, dtype, device), rand(SIZES, dtype, device, 0.1)
    grad_norms = torch.rand(len(SIZES), device=device) + 0.5
    lr, b1, b2, eps, step, wd = 0.01, 0.9, 0.99, 1e-8, 3, 0.1
    bc1, bc2 = 1 - b1**step, math.sqrt(1 - b2**step)
    e, e_norms = [], []
    for gi, pi, mi, ni in zip(*map(f64, (g, p, m)), grad_norms.double().cpu()):
        if norm_type == 2:
            n = (b2 * ni * ni + (1 - b2) * gi.norm() ** 2).sqrt()
        else:
            n = b2 * ni + (1 - b2) * gi.abs().max()
        denom = n / bc2 + eps
        if mode == 0:
            gi = gi / denom + wd * pi
            mi = b1 * mi + (1 - b1) * gi
            pi = pi - lr * mi / bc1
        else:
            mi = b1 * mi + (1 - b1) * gi
            pi = pi - lr * ((mi / bc1) / denom + wd * pi)
        e.append((pi, mi))
        e_norms.append(n)
    args = (grad_norms, lr, b1, b2, eps, step, 1, wd, 1, mode, norm_type)
    multi_tensor_applier(amp_C.multi_tensor_novograd, flag(device), [g, p, m], *args)
    close(grad_norms, torch.stack(e_norms), torch.float32)  # blended in place
    for i, (ep, em) in enumerate(e):
        close(p[i], ep, dtype)
        close(m[i], em, dtype)


def ref_lamb(g, p, m, v, lr, b1, b2, eps, step, bias_correction, wd, grad_averaging, mode, clip, use_nvlamb):
    bc1, bc2 = (1 - b1**step, 1 - b2**step) if bias_correction else (1.0, 1.0)
    b3 = 1 - b1 if grad_averaging else 1.0
    g = g / clip
    if mode == 0:
        g = g + wd * p
    m = b1 * m + b3 * g
    v = b2 * v + (1 - b2) * g * g
    update = (m / bc1) / ((v / bc2).sqrt() + eps)
    if mode == 1:
        update = update + wd * p
    ratio = lr
    if use_nvlamb or wd != 0:
        pn, un = p.norm(), update.norm()
        ratio = lr * pn / un if pn != 0 and un != 0 else lr
    return update, p - ratio * update, m, v


@needs_optimizers
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("wd,use_nvlamb", [(0.1, False), (0.0, False), (0.0, True)])
@pytest.mark.parametrize("clipped", [False, True])
def test_lamb(device, dtype, mode, wd, use_nvlamb, clipped):
    g, p, m, v = _adam_inputs(dtype, device)
    gnorm = torch.stack([t.norm() for t in f64(g)]).norm()
    max_norm = float(gnorm) / 2 if clipped else float(gnorm) * 2
    clip = 2.0 if clipped else 1.0
    e = [ref_lamb(*a, 0.01, 0.9, 0.99, 1e-6, 3, 1, wd, 1, mode, clip, use_nvlamb) for a in zip(*map(f64, (g, p, m, v)))]
    args = (0.01, 0.9, 0.99, 1e-6, 3, 1, wd, 1, mode, gnorm.float().reshape(1).to(device), max_norm, use_nvlamb)
    multi_tensor_applier(amp_C.multi_tensor_lamb, flag(device), [g, p, m, v], *args)
    for i, (eu, ep, em, ev) in enumerate(e):
        close(p[i], ep, dtype)
        close(m[i], em, dtype)
        close(v[i], ev, dtype)
        close(g[i], eu, dtype, scale=4)  # upstream leaves the update in the gradients


@needs_optimizers
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [0, 1])
def test_lamb_mp(device, dtype, mode):
    master = dtype != torch.float32
    g = [t * 64 for t in rand(SIZES, dtype, device)]
    pm = rand(SIZES, torch.float32, device)
    m, v = rand(SIZES, torch.float32, device, 0.1), rand(SIZES, torch.float32, device, 0.1, positive=True)
    low = [t.to(dtype) for t in pm] if master else None
    gnorm = torch.stack([(t / 64).norm() for t in f64(g)]).norm()
    to = dict(device=device)
    lr, step = torch.full((1,), 0.01, **to), torch.full((1,), 3, dtype=torch.int32, **to)
    max_norm, inv = torch.full((1,), float(gnorm) / 2, **to), torch.full((1,), 1 / 64, **to)
    found_inf = torch.zeros(1, **to)
    e = [
        ref_lamb(gi / 64, *rest, 0.01, 0.9, 0.99, 1e-6, 3, 1, 0.1, 1, mode, 2.0, False)
        for gi, *rest in zip(*map(f64, (g, pm, m, v)))
    ]
    lists = [g, pm, m, v] + ([low] if master else [])
    args = (lr, 0.9, 0.99, 1e-6, step, 1, 0.1, 1, mode, gnorm.float().reshape(1).to(device), max_norm, False)
    before = [[t.clone() for t in lst] for lst in lists]
    multi_tensor_applier(amp_C.multi_tensor_lamb_mp, flag(device, 1), lists, *args, found_inf, inv)
    for lst, b in zip(lists, before):
        assert all(torch.equal(x, y) for x, y in zip(lst, b))
    multi_tensor_applier(amp_C.multi_tensor_lamb_mp, flag(device), lists, *args, found_inf, inv)
    for i, (eu, ep, em, ev) in enumerate(e):
        close(pm[i], ep, torch.float32)
        close(m[i], em, torch.float32)
        close(v[i], ev, torch.float32)
        close(g[i], eu, dtype, scale=4)
        if master:
            assert torch.equal(low[i], pm[i].to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lamb_stage1_and_stage2(device, dtype):
    g, p, m, v = _adam_inputs(dtype, device)
    m, v = [t.float() for t in m], [t.float() for t in v]
    p = [t.float() for t in p]
    update = [torch.empty_like(t, dtype=dtype) for t in g]
    decay = torch.tensor([0.1, 0.0, 0.2, 0.05], device=device)
    gnorm = torch.stack([t.norm() for t in f64(g)]).norm()
    b1, b2, eps, step = 0.9, 0.99, 1e-6, 2
    e = []
    for i, (gi, pi, mi, vi) in enumerate(zip(*map(f64, (g, p, m, v)))):
        gi = gi / 2.0  # max_global_grad_norm is half the norm
        mi = b1 * mi + (1 - b1) * gi
        vi = b2 * vi + (1 - b2) * gi * gi
        # upstream's stage 1 corrects the bias for step + 1
        ui = (mi / (1 - b1 ** (step + 1))) / ((vi / (1 - b2 ** (step + 1))).sqrt() + eps) + float(decay[i]) * pi
        e.append((ui, mi, vi))
    noop = flag(device)
    gn = gnorm.float().reshape(1).to(device)
    multi_tensor_applier(
        amp_C.multi_tensor_lamb_stage1_cuda, noop, [g, p, m, v, update], decay, step, b1, b2, eps, gn, float(gnorm) / 2
    )
    for i, (eu, em, ev) in enumerate(e):
        close(update[i], eu, dtype, scale=4)
        close(m[i], em, torch.float32)
        close(v[i], ev, torch.float32)
    p_norms = torch.stack([t.norm() for t in p]).float()
    u_norms = torch.stack([t.float().norm() for t in update])
    u_norms[1] = 0.0  # a zero norm falls back to the plain learning rate
    expected = []
    for i, (pi, ui) in enumerate(zip(f64(p), f64(update))):
        ratio = 0.01 if i == 1 else 0.01 * float(p_norms[i]) / float(u_norms[i])
        expected.append(pi - ratio * ui)
    multi_tensor_applier(amp_C.multi_tensor_lamb_stage2_cuda, noop, [p, update], p_norms, u_norms, 0.01, 0.1, False)
    for pi, ei in zip(p, expected):
        close(pi, ei, torch.float32)


# apex._autocast_utils -----------------------------------------------------------------------


def test_autocast_utils_disabled_returns_args_unchanged():
    from apex import _autocast_utils

    x, y = torch.randn(3), torch.randn(2, dtype=torch.float64)
    args = (x, 3, [y], None)
    out = _autocast_utils._cast_if_autocast_enabled(*args)
    assert out == args or all(a is b for a, b in zip(out, args))
    assert out[0] is x and out[2][0] is y
    assert _autocast_utils._get_current_dtype() == torch.float32
    assert _autocast_utils._get_current_dtype(torch.float16) == torch.float32  # as upstream's
    assert torch.float16 in _autocast_utils._get_autocast_dtypes()


def test_autocast_utils_ignores_cpu_autocast():
    """As upstream's, only CUDA autocast counts: CPU autocast leaves the arguments as they are."""
    from apex._autocast_utils import _cast_if_autocast_enabled

    x = torch.randn(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out,) = _cast_if_autocast_enabled(x)
    assert out is x


def test_autocast_utils_through_the_namespace():
    import apex

    assert callable(apex._autocast_utils._cast_if_autocast_enabled)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_utils_casts_under_cuda_autocast(dtype):
    from apex._autocast_utils import _cast_if_autocast_enabled, _get_current_dtype

    x, d = torch.randn(3, device="cuda"), torch.randn(3, device="cuda", dtype=torch.float64)
    i, c = torch.ones(3, device="cuda", dtype=torch.int64), torch.randn(3)
    with torch.autocast("cuda", dtype=dtype):
        out = _cast_if_autocast_enabled(x, (x, [x]), d, i, c, 2.0)
        assert _get_current_dtype() == dtype
    assert out[0].dtype == dtype and out[1][0].dtype == dtype and out[1][1][0].dtype == dtype
    assert out[2] is d and out[3] is i and out[4] is c and out[5] == 2.0  # fp64, ints and CPU tensors stay
