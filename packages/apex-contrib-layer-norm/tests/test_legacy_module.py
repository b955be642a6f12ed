"""The legacy top-level module fast_layer_norm (upstream's extension name): ln_fwd / ln_bwd with upstream's
arguments and returns, against float64 at every hidden size upstream's kernels had and at others, the
same results as FastLayerNormFN (the path Megatron-Core takes), bad input, and the package's imports."""

from __future__ import annotations

import subprocess
import sys

import fast_layer_norm
import pytest
import torch

from apex.contrib.layer_norm import FastLayerNormFN

from ._helpers import (
    EPS,
    PAIRS,
    TOL,
    UPSTREAM_HIDDEN_SIZES,
    assert_close,
    check_gradients,
    pair_id,
    params,
    randn,
    reference,
)

# Hidden sizes upstream's kernels refused: tiny, odd, a prime past a vector width, past 65536.
OTHER_HIDDEN_SIZES = [1, 7, 100, 1000, 4097, 20000, 65537]
ROWS = 3


def legacy(x, gamma, beta, dz, memory_efficient, five_arguments=False):
    """ln_fwd then ln_bwd as upstream's FastLayerNormFN called them."""
    z, mu, rsigma = fast_layer_norm.ln_fwd(x, gamma, beta, EPS)
    if five_arguments:  # upstream's older ln_bwd(dz, x, mu, rsigma, gamma)
        return (z, mu, rsigma), fast_layer_norm.ln_bwd(dz, x, mu, rsigma, gamma)
    x_or_z = z if memory_efficient else x
    return (z, mu, rsigma), fast_layer_norm.ln_bwd(
        dz, x_or_z, None if memory_efficient else mu, rsigma, gamma, beta, memory_efficient
    )


def check(device, hidden, pair, memory_efficient, rows=ROWS, five_arguments=False):
    x_dtype, w_dtype = pair
    x = randn((rows, hidden), device, x_dtype, 2.0, 0.5)
    gamma, beta = params(hidden, device, w_dtype)
    dz = randn((rows, hidden), device, w_dtype)
    (z, mu, rsigma), grads = legacy(x, gamma, beta, dz, memory_efficient, five_arguments)
    stats = torch.float64 if x_dtype == torch.float64 else torch.float32
    assert (z.dtype, z.shape, mu.dtype, mu.shape, rsigma.dtype, rsigma.shape) == (
        w_dtype,
        x.shape,
        stats,
        (rows,),
        stats,
        (rows,),
    )
    y64, mean, rs, leaves = reference(x, gamma, beta)
    assert_close(z, y64, TOL[w_dtype], "z")
    torch.testing.assert_close(mu.double(), mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rsigma.double(), rs, rtol=2e-6, atol=0)
    assert isinstance(grads, list) and len(grads) == 5
    dx, dgamma, dbeta, dgamma_part, dbeta_part = grads
    # With memory_efficient, x_or_z is z: dx comes back in z's dtype, as upstream's (empty_like(x_or_z)).
    x_seen = x.to(z.dtype) if memory_efficient else x
    assert dx.dtype == x_seen.dtype
    expected = torch.autograd.grad(y64, leaves, dz.double())
    check_gradients((dx.to(x.dtype), dgamma, dbeta), expected, x, gamma, dz, w_dtype, memory_efficient)
    for part, total in ((dgamma_part, dgamma), (dbeta_part, dbeta)):
        assert part.dtype == torch.float32 and part.dim() == 2 and part.shape[1] == hidden
        torch.testing.assert_close(part.sum(0), total.float())


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-input", "memory-efficient"])
@pytest.mark.parametrize("pair", [PAIRS[0], PAIRS[2], PAIRS[4]], ids=pair_id)
@pytest.mark.parametrize("hidden", UPSTREAM_HIDDEN_SIZES)
def test_upstream_hidden_sizes(device, hidden, pair, memory_efficient):
    check(device, hidden, pair, memory_efficient)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-input", "memory-efficient"])
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
@pytest.mark.parametrize("hidden", OTHER_HIDDEN_SIZES)
def test_other_hidden_sizes(device, hidden, pair, memory_efficient):
    check(device, hidden, pair, memory_efficient)


@pytest.mark.parametrize("rows", [0, 1, 257])
def test_row_counts(device, rows):
    check(device, 1024, PAIRS[2], False, rows=rows)


def test_older_five_argument_backward(device):
    check(device, 768, PAIRS[0], False, five_arguments=True)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-input", "memory-efficient"])
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_same_bits_as_fast_layer_norm_fn(device, pair, memory_efficient):
    # FastLayerNormFN (Megatron-Core's entry point) and the legacy calls are one computation.
    x_dtype, w_dtype = pair
    x = randn((2, 5, 1024), device, x_dtype, 2.0)
    gamma, beta = params(1024, device, w_dtype)
    dz = randn((2, 5, 1024), device, w_dtype)
    xr, gr, br = (t.detach().requires_grad_() for t in (x, gamma, beta))
    out = FastLayerNormFN.apply(xr, gr, br, EPS, memory_efficient)
    dx, dgamma, dbeta = torch.autograd.grad(out, (xr, gr, br), dz)
    (z, _, _), grads = legacy(x.view(-1, 1024), gamma, beta, dz.view(-1, 1024), memory_efficient)
    assert torch.equal(out, z.view(x.shape))
    if memory_efficient and x_dtype != w_dtype:
        # The legacy dx has z's dtype (upstream's); FastLayerNormFN's is computed in x's. On CUDA
        # the two are different instantiations of the backward kernel, whose parameter-gradient
        # sums may be ordered differently: float32 roundings apart, not bit for bit.
        assert grads[0].dtype == w_dtype and dx.dtype == x_dtype
        for name, got, expected in (("dgamma", grads[1], dgamma), ("dbeta", grads[2], dbeta)):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item(), msg=name)
        assert_close(grads[0].view(x.shape), dx.double(), 2 * max(TOL[x_dtype], TOL[w_dtype]), "dx")
    else:
        assert torch.equal(dgamma, grads[1]) and torch.equal(dbeta, grads[2])
        assert torch.equal(dx, grads[0].view(x.shape))


def _good(device):
    x = torch.randn(4, 8, device=device)
    gamma, beta = torch.rand(8, device=device) + 0.5, torch.randn(8, device=device)
    z, mu, rsigma = fast_layer_norm.ln_fwd(x, gamma, beta, EPS)
    return x, gamma, beta, z, mu, rsigma


FWD_BAD = {  # case: (change to (x, gamma, beta, epsilon), error, message after "ln_fwd: ")
    "3-d x": (
        lambda x, g, b, e: (x.view(2, 2, 8), g, b, e),
        ValueError,
        r"x must be 2-D \(rows, hidden_size\), got shape \(2, 2, 8\)",
    ),
    "1-d x": (lambda x, g, b, e: (x[0], g, b, e), ValueError, r"x must be 2-D \(rows, hidden_size\), got shape \(8,\)"),
    "hidden size": (
        lambda x, g, b, e: (x, g[:4], b[:4], e),
        ValueError,
        r"x has shape \(4, 8\); its last dimension must be gamma's 4",
    ),
    "int x": (lambda x, g, b, e: (x.int(), g, b, e), TypeError, "x has dtype torch.int32; expected"),
    "bf16 gamma, fp16 x": (
        lambda x, g, b, e: (x.half(), g.bfloat16(), b.bfloat16(), e),
        TypeError,
        "gamma has dtype torch.bfloat16 and x torch.float16",
    ),
    "fp64 gamma, fp32 x": (
        lambda x, g, b, e: (x, g.double(), b.double(), e),
        TypeError,
        "gamma has dtype torch.float64 and x torch.float32",
    ),
    "beta dtype": (
        lambda x, g, b, e: (x, g, b.half(), e),
        TypeError,
        "beta has dtype torch.float16 but gamma has torch.float32",
    ),
    "beta shape": (lambda x, g, b, e: (x, g, b[:7], e), ValueError, r"beta has shape \(7,\) but gamma has \(8,\)"),
    "beta missing": (lambda x, g, b, e: (x, g, None, e), TypeError, "beta is required"),
    "negative epsilon": (lambda x, g, b, e: (x, g, b, -1.0), ValueError, "epsilon must be >= 0, got -1.0"),
}


@pytest.mark.parametrize("case", list(FWD_BAD))
def test_ln_fwd_bad_input_names_the_argument(device, case):
    x, gamma, beta, *_ = _good(device)
    change, error, message = FWD_BAD[case]
    with pytest.raises(error, match="^ln_fwd: " + message):
        fast_layer_norm.ln_fwd(*change(x, gamma, beta, EPS))


BWD_BAD = {  # case: (change to (dz, x_or_z, mu, rsigma, gamma, beta, memory_efficient), error, message)
    "dz shape": (
        lambda dz, x, mu, rs, g, b, m: (dz[:3], x, mu, rs, g, b, m),
        ValueError,
        r"dz has shape \(3, 8\) but x_or_z has \(4, 8\)",
    ),
    "dz dtype": (
        lambda dz, x, mu, rs, g, b, m: (dz.half(), x, mu, rs, g, b, m),
        TypeError,
        "dz has dtype torch.float16; expected the output's, gamma's torch.float32",
    ),
    "3-d x_or_z": (
        lambda dz, x, mu, rs, g, b, m: (dz.view(2, 2, 8), x.view(2, 2, 8), mu, rs, g, b, m),
        ValueError,
        r"x_or_z must be 2-D",
    ),
    "mu dtype": (
        lambda dz, x, mu, rs, g, b, m: (dz, x, mu.double(), rs, g, b, m),
        TypeError,
        "mu has dtype torch.float64; expected torch.float32",
    ),
    "rsigma rows": (
        lambda dz, x, mu, rs, g, b, m: (dz, x, mu, rs[:3], g, b, m),
        ValueError,
        r"rsigma has 3 elements, expected one per row \(4\)",
    ),
    "mu missing": (
        lambda dz, x, mu, rs, g, b, m: (dz, x, None, rs, g, b, m),
        ValueError,
        "mu is required unless memory_efficient",
    ),
    "memory_efficient without beta": (
        lambda dz, x, mu, rs, g, b, m: (dz, x, None, rs, g, None, True),
        ValueError,
        "beta is required with memory_efficient",
    ),
    "memory_efficient, x_or_z not z": (
        lambda dz, x, mu, rs, g, b, m: (dz.bfloat16(), x, None, rs, g.bfloat16(), b.bfloat16(), True),
        TypeError,
        "x_or_z has dtype torch.float32; with memory_efficient it is the output z",
    ),
    "gamma size": (lambda dz, x, mu, rs, g, b, m: (dz, x, mu, rs, g[:4], b[:4], m), ValueError, "x_or_z has shape"),
}


@pytest.mark.parametrize("case", list(BWD_BAD))
def test_ln_bwd_bad_input_names_the_argument(device, case):
    x, gamma, beta, z, mu, rsigma = _good(device)
    dz = torch.randn_like(z)
    change, error, message = BWD_BAD[case]
    with pytest.raises(error, match="^ln_bwd: " + message):
        fast_layer_norm.ln_bwd(*change(dz, x, mu, rsigma, gamma, beta, False))


@pytest.mark.gpu
def test_devices_are_named():
    x, gamma, beta, z, mu, rsigma = _good("cuda")
    with pytest.raises(ValueError, match=r"^ln_fwd: gamma is on cpu, expected cuda:0"):
        fast_layer_norm.ln_fwd(x, gamma.cpu(), beta, EPS)
    with pytest.raises(ValueError, match=r"^ln_bwd: rsigma is on cpu, expected cuda:0"):
        fast_layer_norm.ln_bwd(torch.randn_like(z), x, mu, rsigma.cpu(), gamma, beta, False)
    with pytest.raises(ValueError, match=r"^ln_bwd: dz is on cpu, expected cuda:0"):
        fast_layer_norm.ln_bwd(torch.randn_like(z).cpu(), x, mu, rsigma, gamma, beta, False)


def test_non_contiguous_tensors_are_accepted(device):
    x = randn((64, 5), device, torch.float32).t()
    gamma, beta = params(64, device, torch.float32)
    z, _, _ = fast_layer_norm.ln_fwd(x, gamma, beta, EPS)
    y64, _, _, _ = reference(x, gamma, beta)
    assert_close(z, y64, TOL[torch.float32], "z")


# the package as upstream's users import it --------------------------------------------------------


def test_imports_in_a_fresh_interpreter():
    code = (
        "import fast_layer_norm, sys; "
        "from apex.contrib.layer_norm import FastLayerNorm; "
        "from apex.contrib.layer_norm.layer_norm import FastLayerNormFN, FastLayerNorm as M; "
        "sys.exit(0 if M is FastLayerNorm and callable(fast_layer_norm.ln_fwd) and callable(fast_layer_norm.ln_bwd) "
        "else 1)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_plugin_provides_the_legacy_module():
    from apex.contrib.layer_norm._plugin import PLUGIN

    assert (PLUGIN.name, PLUGIN.distribution, PLUGIN.kernel_library) == ("layer_norm", "apex-contrib-layer-norm", None)
    assert PLUGIN.provides == ("apex.contrib.layer_norm", "fast_layer_norm")
    assert "apex-normalization" in PLUGIN.requires


def test_missing_apex_normalization_is_named():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'apex.normalization':\n"
        "            raise ModuleNotFoundError('No module named apex.normalization', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import fast_layer_norm\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0
    assert "apex-normalization's layer norm kernels, which is not installed: pip install apex-normalization" in (
        done.stderr
    )
