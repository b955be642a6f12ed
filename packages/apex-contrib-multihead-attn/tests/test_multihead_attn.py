"""SelfMultiheadAttn and EncdecMultiheadAttn against float64 references written from the definition
(tests/_reference.py) and against torch.nn.MultiheadAttention: values, gradients, masks, dropout,
LayerNorm + residual, separate q/k/v parameters, bad input, torch.compile."""

from __future__ import annotations

import math

import pytest
import torch

from apex.contrib.multihead_attn import EncdecMultiheadAttn, SelfMultiheadAttn

from ._reference import encdec_attention, self_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = ["fast", "default"]
E, H = 16, 4


def tolerance(dtype):
    """A few roundings of the dtype per stage (projection, scores, softmax, context, output)."""
    eps = torch.finfo(dtype).eps
    return {"rtol": 16 * eps, "atol": 16 * eps} if dtype != torch.float32 else {"rtol": 2e-5, "atol": 2e-5}


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual.detach().double().cpu(), expected.detach().double().cpu(), **tolerance(dtype))


def make_masks(kind, tq, tk, batch, device, additive_ok=True):
    """kwargs for forward and for the reference; every query row keeps at least one key."""
    if kind == "none":
        return {}, {}
    if kind in ("padding-bool", "padding-uint8"):
        lengths = torch.randint(1, tk + 1, (batch,))
        mask = torch.arange(tk)[None, :] >= lengths[:, None]
        mask = mask if kind == "padding-bool" else mask.to(torch.uint8)
        return {"key_padding_mask": mask.to(device)}, {"key_padding_mask": mask}
    if kind == "additive":
        mask = torch.randn(batch, tk)
        mask[:, -1] = -10000.0
        return {"key_padding_mask": mask.to(device)}, {"additive": mask}
    if kind == "time":  # future positions, with the first key always allowed
        mask = torch.ones(tq, tk, dtype=torch.bool).triu(1)
        return {"attn_mask": mask.to(device)}, {"attn_mask": mask}
    raise AssertionError(kind)


def randomize(module):
    """Random parameters (not upstream's zero biases and unit LayerNorm) so every term is exercised."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() == 1 else p.shape[-1] ** -0.5))
    return module


SELF_CONFIGS = {  # name: constructor kwargs
    "plain": {},
    "bias": {"bias": True},
    "norm-add": {"include_norm_add": True},
    "separate-qkv": {"separate_qkv_params": True},
    "separate-qkv-bias": {"separate_qkv_params": True, "bias": True},
}
MASKS = ["none", "padding-bool", "padding-uint8", "additive", "time"]


def valid_self_cases():
    for impl in IMPLS:
        for config, kwargs in SELF_CONFIGS.items():
            for mask in MASKS:
                if mask == "additive" and (
                    kwargs.get("include_norm_add") or (impl == "fast" and not kwargs.get("bias"))
                ):
                    continue  # upstream's rules: tested as errors below
                yield impl, config, mask


def self_weights(module):
    """(w_in, b_in) in upstream's interleaved layout, from either parameterization."""
    if module.separate_qkv_params:
        w = torch.stack([p.view(H, E // H, E) for p in (module.q_weight, module.k_weight, module.v_weight)], 1)
        b = None
        if module.bias:
            b = torch.stack([p.view(H, E // H) for p in (module.q_bias, module.k_bias, module.v_bias)], 1).reshape(-1)
        return w.reshape(3 * E, E), b
    return module.in_proj_weight, module.in_proj_bias


def self_reference(module, x, masks):
    w_in, b_in = self_weights(module)
    norm = None
    if module.include_norm_add:
        norm = (
            (module.lyr_nrm_gamma_weights, module.lyr_nrm_beta_weights)
            if module.impl == "fast"
            else (module.lyr_nrm.weight, module.lyr_nrm.bias)
        )
        norm = tuple(p.double() for p in norm)
    return self_attention(x, w_in, b_in, module.out_proj_weight, module.out_proj_bias, H, norm=norm, **masks)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl,config,mask", list(valid_self_cases()))
def test_self_attention_matches_float64(device, dtype, impl, config, mask):
    torch.manual_seed(0)
    t, batch = 7, 3
    additive = mask == "additive"
    module = randomize(SelfMultiheadAttn(E, H, impl=impl, mask_additive=additive, **SELF_CONFIGS[config]))
    module = module.to(device=device, dtype=dtype)
    x = torch.randn(t, batch, E, device=device).to(dtype).requires_grad_()
    kwargs, ref_masks = make_masks(mask, t, t, batch, device)
    out, weights = module(x, x, x, is_training=True, **kwargs)  # dropout 0: training is exact too
    assert weights is None and out.dtype == dtype and out.shape == x.shape

    x64 = x.detach().double().cpu().requires_grad_()
    params64 = {n: p.detach().double().cpu().requires_grad_() for n, p in module.named_parameters()}
    twin = SelfMultiheadAttn(E, H, impl=impl, mask_additive=additive, **SELF_CONFIGS[config]).double()
    twin.load_state_dict(params64, strict=False)
    with torch.no_grad():
        for n, p in twin.named_parameters():
            p.copy_(params64[n])
    expected = self_reference(twin, x64, ref_masks)
    assert_close(out, expected, dtype)

    grad = torch.randn_like(expected)
    got = torch.autograd.grad(out, [x, *module.parameters()], grad.to(device=device, dtype=dtype))
    want = torch.autograd.grad(expected, [x64, *twin.parameters()], grad)
    for g, w in zip(got, want):
        assert_close(g, w, dtype)


ENCDEC_CONFIGS = {"plain": {}, "bias": {"bias": True}, "norm-add": {"include_norm_add": True}}


ENCDEC_CASES = [
    (impl, config, mask)
    for impl in IMPLS
    for config in ENCDEC_CONFIGS
    for mask in ["none", "padding-bool", "padding-uint8", "time"]
    if not (impl == "fast" and config == "bias")  # upstream's rule: tested as an error below
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl,config,mask", ENCDEC_CASES)
def test_encdec_attention_matches_float64(device, dtype, impl, config, mask):
    torch.manual_seed(1)
    tq, tk, batch = 5, 9, 2
    module = randomize(EncdecMultiheadAttn(E, H, impl=impl, **ENCDEC_CONFIGS[config])).to(device=device, dtype=dtype)
    x = torch.randn(tq, batch, E, device=device).to(dtype).requires_grad_()
    mem = torch.randn(tk, batch, E, device=device).to(dtype).requires_grad_()
    kwargs, ref_masks = make_masks(mask, tq, tk, batch, device)
    out, weights = module(x, mem, mem, **kwargs)
    assert weights is None and out.shape == x.shape and out.dtype == dtype

    params = [p.detach().double().cpu().requires_grad_() for p in module.parameters()]
    named = dict(zip([n for n, _ in module.named_parameters()], params))
    x64, mem64 = (t.detach().double().cpu().requires_grad_() for t in (x, mem))
    norm = None
    if module.include_norm_add:
        norm = (
            (named["lyr_nrm_gamma_weights"], named["lyr_nrm_beta_weights"])
            if impl == "fast"
            else (named["lyr_nrm.weight"], named["lyr_nrm.bias"])
        )
    biases = tuple(named.get(n) for n in ("in_proj_bias_q", "in_proj_bias_kv", "out_proj_bias"))
    expected = encdec_attention(
        x64, mem64, named["in_proj_weight_q"], named["in_proj_weight_kv"], named["out_proj_weight"], H,
        biases=biases, norm=norm, **ref_masks,
    )  # fmt: skip
    assert_close(out, expected, dtype)
    grad = torch.randn_like(expected)
    got = torch.autograd.grad(out, [x, mem, *module.parameters()], grad.to(device=device, dtype=dtype))
    want = torch.autograd.grad(expected, [x64, mem64, *params], grad)
    for g, w in zip(got, want):
        assert_close(g, w, dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mask", ["none", "padding-bool", "time"])
@pytest.mark.parametrize("bias", [False, True])
def test_self_attention_matches_torch_multihead_attention(device, impl, mask, bias):
    torch.manual_seed(2)
    t, batch = 6, 4
    ours = randomize(SelfMultiheadAttn(E, H, bias=bias, impl=impl)).to(device)
    theirs = torch.nn.MultiheadAttention(E, H, bias=bias).to(device)
    with torch.no_grad():  # torch keeps q, k and v as three [E, E] blocks; upstream interleaves them per head
        theirs.in_proj_weight.copy_(ours.in_proj_weight.view(H, 3, E // H, E).transpose(0, 1).reshape(3 * E, E))
        theirs.out_proj.weight.copy_(ours.out_proj_weight)
        if bias:
            theirs.in_proj_bias.copy_(ours.in_proj_bias.view(H, 3, E // H).transpose(0, 1).reshape(3 * E))
            theirs.out_proj.bias.copy_(ours.out_proj_bias)
    x = torch.randn(t, batch, E, device=device, requires_grad=True)
    kwargs, _ = make_masks(mask, t, t, batch, device)
    out, _ = ours(x, x, x, **kwargs)
    expected, _ = theirs(x, x, x, need_weights=False, **kwargs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, grad)
    (dx_torch,) = torch.autograd.grad(expected, x, grad)
    torch.testing.assert_close(dx, dx_torch, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_separate_qkv_params_are_torch_multihead_attentions_blocks(device, impl):
    # q_weight, k_weight, v_weight are plain [E, E] projections: torch's three in_proj blocks as they are
    torch.manual_seed(8)
    ours = SelfMultiheadAttn(E, H, bias=True, impl=impl, separate_qkv_params=True, mask_additive=True)
    ours = randomize(ours).to(device)
    theirs = torch.nn.MultiheadAttention(E, H, bias=True).to(device)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([ours.q_weight, ours.k_weight, ours.v_weight]))
        theirs.in_proj_bias.copy_(torch.cat([ours.q_bias, ours.k_bias, ours.v_bias]))
        theirs.out_proj.weight.copy_(ours.out_proj_weight)
        theirs.out_proj.bias.copy_(ours.out_proj_bias)
    x = torch.randn(6, 3, E, device=device)
    mask = torch.randn(3, 6, device=device)  # torch reads a float key_padding_mask as additive too
    out, _ = ours(x, x, x, key_padding_mask=mask)
    expected, _ = theirs(x, x, x, key_padding_mask=mask, need_weights=False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_encdec_attention_matches_torch_multihead_attention(device, impl):
    torch.manual_seed(3)
    tq, tk, batch = 4, 7, 3
    ours = randomize(EncdecMultiheadAttn(E, H, impl=impl)).to(device)
    theirs = torch.nn.MultiheadAttention(E, H, bias=False).to(device)
    with torch.no_grad():
        kv = ours.in_proj_weight_kv.view(H, 2, E // H, E).transpose(0, 1).reshape(2 * E, E)
        theirs.in_proj_weight.copy_(torch.cat([ours.in_proj_weight_q, kv]))
        theirs.out_proj.weight.copy_(ours.out_proj_weight)
    x, mem = torch.randn(tq, batch, E, device=device), torch.randn(tk, batch, E, device=device)
    kwargs, _ = make_masks("padding-bool", tq, tk, batch, device)
    out, _ = ours(x, mem, mem, **kwargs)
    expected, _ = theirs(x, mem, mem, need_weights=False, **kwargs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (11, 1), (0, 2)])
def test_self_attention_small_and_empty_shapes(device, impl, shape):
    torch.manual_seed(4)
    module = randomize(SelfMultiheadAttn(E, H, impl=impl, bias=True)).to(device)
    x = torch.randn(*shape, E, device=device, requires_grad=True)
    out, _ = module(x, x, x)
    assert out.shape == x.shape
    assert_close(out, self_reference(module, x.detach().cpu(), {}), torch.float32)
    out.sum().backward()
    assert x.grad.shape == x.shape and torch.isfinite(x.grad).all()


# dropout -----------------------------------------------------------------------------------------


def _dropout_modules(kind, impl):
    if kind == "self":
        return SelfMultiheadAttn(E, H, dropout=0.3, impl=impl, bias=True)
    if kind == "self-norm-add":
        return SelfMultiheadAttn(E, H, dropout=0.3, impl=impl, include_norm_add=True)
    return EncdecMultiheadAttn(E, H, dropout=0.3, impl=impl, include_norm_add=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["self", "self-norm-add", "encdec-norm-add"])
def test_dropout_is_off_without_training_and_unbiased_with_it(impl, kind):
    torch.manual_seed(5)
    module = randomize(_dropout_modules(kind, impl))
    t, batch = 6, 2
    x = torch.randn(t, batch, E)
    mem = torch.randn(8, batch, E)
    key = x if kind.startswith("self") else mem

    # is_training=False: exact, whatever module.training says (upstream's switch is the argument)
    assert module.training
    exact, _ = module(x, key, key, is_training=False)
    zero = _dropout_modules(kind, impl)
    zero.dropout = 0.0
    zero.load_state_dict(module.state_dict())
    torch.testing.assert_close(exact, zero(x, key, key, is_training=True)[0], rtol=0, atol=0)

    # training: random, reproducible from the seed, and unbiased (the output is linear in each dropout mask)
    torch.manual_seed(123)
    first, _ = module(x, key, key)
    torch.manual_seed(123)
    again, _ = module(x, key, key)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.allclose(first, exact)
    runs = 600
    with torch.no_grad():
        samples = torch.stack([module(x, key, key)[0] for _ in range(runs)])
    mean, stderr = samples.mean(0), samples.std(0) / math.sqrt(runs)
    # within 5 standard errors of the exact output everywhere (per element; 96 elements)
    assert ((mean - exact).abs() <= 5 * stderr + 1e-6).all()


# construction, parameters and bad input ----------------------------------------------------------


def test_parameter_names_and_initialisation():
    embed = 64
    m = SelfMultiheadAttn(embed, 8, bias=True, include_norm_add=True)
    assert sorted(n for n, _ in m.named_parameters()) == sorted(
        [
            "in_proj_weight",
            "in_proj_bias",
            "out_proj_weight",
            "out_proj_bias",
            "lyr_nrm_gamma_weights",
            "lyr_nrm_beta_weights",
        ]
    )
    assert m.in_proj_weight.shape == (3 * embed, embed)
    # Xavier-uniform bounds: gain * sqrt(6 / (fan_in + fan_out)); in_proj with gain sqrt(2)
    in_bound = math.sqrt(2) * math.sqrt(6 / (4 * embed))
    out_bound = math.sqrt(6 / (2 * embed))
    assert 0.9 * in_bound < m.in_proj_weight.abs().max() <= in_bound
    assert 0.9 * out_bound < m.out_proj_weight.abs().max() <= out_bound
    assert (m.in_proj_bias == 0).all() and (m.out_proj_bias == 0).all()
    assert (m.lyr_nrm_gamma_weights == 1).all() and (m.lyr_nrm_beta_weights == 0).all()

    m = SelfMultiheadAttn(embed, 8, separate_qkv_params=True, bias=True, include_norm_add=True, impl="default")
    names = sorted(m.state_dict())
    assert names == sorted(
        ["q_weight", "k_weight", "v_weight", "q_bias", "k_bias", "v_bias", "out_proj_weight", "out_proj_bias",
         "lyr_nrm.weight", "lyr_nrm.bias"]
    )  # fmt: skip
    assert 0.9 * out_bound < m.q_weight.abs().max() <= out_bound

    e = EncdecMultiheadAttn(embed, 8, bias=True, impl="default")
    assert sorted(e.state_dict()) == sorted(
        [
            "in_proj_weight_q",
            "in_proj_weight_kv",
            "out_proj_weight",
            "in_proj_bias_q",
            "in_proj_bias_kv",
            "out_proj_bias",
        ]
    )
    kv_bound = math.sqrt(6 / (3 * embed))
    assert 0.9 * kv_bound < e.in_proj_weight_kv.abs().max() <= kv_bound
    assert e.in_proj_bias_q is not None and (e.in_proj_bias_kv == 0).all()
    assert SelfMultiheadAttn(embed, 8).in_proj_bias is None


CONSTRUCTION_ERRORS = {
    "heads do not divide": (SelfMultiheadAttn, (10, 3), {}, "embed_dim \\(10\\) must be a positive multiple"),
    "bad impl": (SelfMultiheadAttn, (8, 2), {"impl": "cuda"}, "impl must be 'fast' or 'default'"),
    "dropout 1": (SelfMultiheadAttn, (8, 2), {"dropout": 1.0}, "dropout must be in \\[0, 1\\)"),
    "additive with norm": (
        SelfMultiheadAttn, (8, 2), {"mask_additive": True, "include_norm_add": True, "impl": "default"},
        "mask_additive is not supported with include_norm_add",
    ),
    "additive fast without bias": (SelfMultiheadAttn, (8, 2), {"mask_additive": True}, "needs bias=True"),
    "encdec fast bias": (EncdecMultiheadAttn, (8, 2), {"bias": True}, "bias=True is not supported with impl='fast'"),
    "encdec bad impl": (EncdecMultiheadAttn, (8, 2), {"impl": "x"}, "impl must be"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CONSTRUCTION_ERRORS))
def test_construction_errors(case):
    cls, args, kwargs, message = CONSTRUCTION_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        cls(*args, **kwargs)


def _bad_forward_cases():
    x = torch.randn(5, 2, E)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    return {  # case: (module kwargs, forward args, forward kwargs, error, message)
        "2-d query": ({}, (x[0], x[0], x[0]), {}, ValueError, "query has shape \\(2, 16\\)"),
        "wrong embed": ({}, (x[..., :8],) * 3, {}, ValueError, "query has shape \\(5, 2, 8\\).*embed_dim=16"),
        "int query": ({}, (x.long(),) * 3, {}, TypeError, "query has dtype torch.int64"),
        "dtype mismatch": ({}, (x.double(),) * 3, {}, TypeError, "query has dtype torch.float64 but the parameters"),
        "both masks": ({}, (x,) * 3, {"key_padding_mask": pad, "attn_mask": pad[:1].expand(5, 5)}, ValueError,
                       "key_padding_mask and attn_mask may not both"),
        "float padding mask": ({}, (x,) * 3, {"key_padding_mask": pad.float()}, TypeError,
                               "key_padding_mask has dtype torch.float32; expected torch.bool or torch.uint8"),
        "bool additive mask": ({"mask_additive": True, "bias": True}, (x,) * 3, {"key_padding_mask": pad},
                               TypeError, "key_padding_mask has dtype torch.bool; with mask_additive=True it is added"),
        "additive time mask": ({"mask_additive": True, "bias": True}, (x,) * 3,
                               {"attn_mask": torch.zeros(5, 5, dtype=torch.bool)}, ValueError,
                               "attn_mask .* not supported with mask_additive"),
        "padding mask shape": ({}, (x,) * 3, {"key_padding_mask": pad.T}, ValueError,
                               "key_padding_mask has shape \\(5, 2\\); expected .* \\(2, 5\\)"),
        "time mask shape": ({}, (x,) * 3, {"attn_mask": torch.zeros(5, 4, dtype=torch.bool)}, ValueError,
                            "attn_mask has shape \\(5, 4\\)"),
        "float time mask": ({}, (x,) * 3, {"attn_mask": torch.zeros(5, 5)}, TypeError,
                            "attn_mask has dtype torch.float32"),
    }  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(_bad_forward_cases()))
def test_bad_forward_input_raises_naming_the_argument(impl, case):
    kwargs, args, forward_kwargs, error, message = _bad_forward_cases()[case]
    module = SelfMultiheadAttn(E, H, impl=impl, **kwargs)
    with pytest.raises(error, match=r"^SelfMultiheadAttn: " + message):
        module(*args, **forward_kwargs)


def test_encdec_bad_key():
    module = EncdecMultiheadAttn(E, H)
    x = torch.randn(5, 2, E)
    with pytest.raises(ValueError, match=r"^EncdecMultiheadAttn: key has batch size 3, the query 2"):
        module(x, torch.randn(4, 3, E), None)
    with pytest.raises(ValueError, match=r"^EncdecMultiheadAttn: key has shape \(4, 2, 8\)"):
        module(x, torch.randn(4, 2, 8), None)
    with pytest.raises(ValueError, match=r"^EncdecMultiheadAttn: key_padding_mask has shape \(2, 5\)"):
        module(x, torch.randn(4, 2, E), None, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))


def test_autocast_runs_in_the_autocast_dtype():
    module = randomize(SelfMultiheadAttn(E, H, bias=True, include_norm_add=True))
    x = torch.randn(4, 2, E)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = module(x, x, x)
    expected = self_reference(module, x, {})
    assert out.dtype in (torch.bfloat16, torch.float32)
    torch.testing.assert_close(out.double(), expected, rtol=0.05, atol=0.05)


# torch.compile -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_torch_compile_fullgraph(device, impl):
    torch.manual_seed(6)
    module = randomize(SelfMultiheadAttn(E, H, bias=True, impl=impl, mask_additive=True)).to(device)
    x = torch.randn(5, 3, E, device=device)
    mask = torch.randn(3, 5, device=device)

    def loss(x):
        return module(x, x, x, key_padding_mask=mask, is_training=False)[0].square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    results = []
    for fn in (loss, compiled):
        value = fn(x)
        results.append((value.detach(), *torch.autograd.grad(value, list(module.parameters()))))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_torch_compile_fullgraph_with_dropout_and_norm_add(device):
    module = SelfMultiheadAttn(E, H, dropout=0.2, include_norm_add=True).to(device)
    compiled = torch.compile(lambda x: module(x, x, x)[0], fullgraph=True, backend="aot_eager")
    x = torch.randn(5, 3, E, device=device, requires_grad=True)
    out = compiled(x)
    out.sum().backward()
    assert out.shape == x.shape and torch.isfinite(x.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bert_shape_on_gpu_against_float64(impl, dtype):
    # flash / memory-efficient kernels at a real shape, with a padding mask
    torch.manual_seed(7)
    module = randomize(SelfMultiheadAttn(1024, 16, bias=True, impl=impl)).to(device="cuda", dtype=dtype)
    x = torch.randn(128, 4, 1024, device="cuda", dtype=dtype)
    kwargs, ref_masks = make_masks("padding-bool", 128, 128, 4, "cuda")
    out, _ = module(x, x, x, is_training=False, **kwargs)
    w_in, b_in = module.in_proj_weight.cpu(), module.in_proj_bias.cpu()
    expected = self_attention(
        x.cpu(), w_in, b_in, module.out_proj_weight.cpu(), module.out_proj_bias.cpu(), 16, **ref_masks
    )
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.double().cpu(), expected, rtol=8 * eps, atol=8 * eps)


@pytest.mark.multigpu
def test_second_device():
    # cuda:0 is current; the module and its input live on cuda:1
    module = randomize(SelfMultiheadAttn(E, H, bias=True)).to("cuda:1")
    x = torch.randn(5, 2, E, device="cuda:1")
    out, _ = module(x, x, x)
    assert out.device == x.device
    assert_close(out, self_reference(module.cpu(), x.cpu(), {}), torch.float32)
