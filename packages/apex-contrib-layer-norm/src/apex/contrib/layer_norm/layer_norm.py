"""FastLayerNorm and FastLayerNormFN (upstream's module path), on apex-normalization's layer norm ops.

Upstream's ``fast_layer_norm`` extension had its own kernels, compiled for a fixed list of hidden
sizes. Here the forward and backward are ``torch.ops.apex_normalization.norm_forward`` /
``norm_backward`` (the kernels of ``apex.normalization.FusedLayerNorm``), which take every hidden
size. Upstream's rule for dtypes is kept: the output (and ``dz``) has gamma's dtype, gamma and beta
share one, the statistics are float32 (float64 for float64 input). Supported (x, gamma) dtypes:
equal (float32, float16, bfloat16, and float64 here), float32 x with float16 or bfloat16 gamma
(upstream's), and float16 or bfloat16 x with float32 gamma (here only: a float32 output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from apex._autocast_utils import _cast_if_autocast_enabled

try:
    import apex.normalization  # noqa: F401  (registers torch.ops.apex_normalization)
except ModuleNotFoundError as exc:  # a dependency, but an install with --no-deps can lack it
    if exc.name != "apex.normalization":
        raise
    raise ModuleNotFoundError(
        "apex.contrib.layer_norm runs apex-normalization's layer norm kernels, which is not installed: "
        "pip install apex-normalization",
        name=exc.name,
    ) from exc

_ops = torch.ops.apex_normalization

# Off CUDA FastLayerNorm and FastLayerNormFN.apply take torch's layer norm (_torch_layer_norm: F.layer_norm
# with upstream's dtypes) after the same checks: through apex-normalization's op the CPU path paid the op's
# host time (64x256 float32 forward + backward on 1 CPU thread 0.19 ms, nn.LayerNorm 0.05) and, with
# memory_efficient, its Python reference (8192x1024 bfloat16 92 ms, nn.LayerNorm 11). The tests set this
# False to run the op's path on the CPU.
_TORCH_OFF_CUDA = True
_HALF = (torch.float16, torch.bfloat16)
_DTYPES = (torch.float32, *_HALF, torch.float64)
_DTYPE_NAMES = "float32, float16, bfloat16 or float64"


# checks: metadata only (they run on fake tensors under torch.compile), errors naming the argument


def _check_dtypes(op: str, name: str, dtype: torch.dtype, gamma: torch.Tensor) -> None:
    """``dtype`` (of x, the input) and gamma's: one of the supported pairs."""
    if dtype not in _DTYPES:
        raise TypeError(f"{op}: {name} has dtype {dtype}; expected {_DTYPE_NAMES}")
    w = gamma.dtype
    if not (w == dtype or (dtype == torch.float32 and w in _HALF) or (dtype in _HALF and w == torch.float32)):
        raise TypeError(
            f"{op}: gamma has dtype {w} and {name} {dtype}; supported: the same dtype, float32 {name} with "
            f"float16 or bfloat16 gamma, float16 or bfloat16 {name} with float32 gamma"
        )


def _check_params(op: str, gamma: torch.Tensor, beta: torch.Tensor | None, device: torch.device) -> int:
    """gamma and beta (beta may be None); returns the hidden size."""
    hidden = gamma.numel()
    if hidden == 0:
        raise ValueError(f"{op}: gamma is empty")
    if gamma.device != device:
        raise ValueError(f"{op}: gamma is on {gamma.device}, expected {device}")
    if beta is not None:
        if beta.dtype != gamma.dtype:
            raise TypeError(f"{op}: beta has dtype {beta.dtype} but gamma has {gamma.dtype}")
        if beta.shape != gamma.shape:
            raise ValueError(f"{op}: beta has shape {tuple(beta.shape)} but gamma has {tuple(gamma.shape)}")
        if beta.device != device:
            raise ValueError(f"{op}: beta is on {beta.device}, expected {device}")
    return hidden


def _check_rows(op: str, name: str, t: torch.Tensor, hidden: int, two_d: bool) -> None:
    if two_d and t.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D (rows, hidden_size), got shape {tuple(t.shape)}")
    if t.dim() == 0 or t.shape[-1] != hidden:
        raise ValueError(
            f"{op}: {name} has shape {tuple(t.shape)}; its last dimension must be gamma's {hidden} elements"
        )


def check_forward(op: str, x, gamma, beta, epsilon, two_d: bool) -> None:
    """The arguments of a forward; ``two_d``: x must be (rows, hidden_size), as ``ln_fwd``'s."""
    hidden = _check_params(op, gamma, beta, x.device)
    if beta is None:
        raise TypeError(f"{op}: beta is required")
    _check_dtypes(op, "x", x.dtype, gamma)
    _check_rows(op, "x", x, hidden, two_d)
    if not epsilon >= 0:  # NaN too
        raise ValueError(f"{op}: epsilon must be >= 0, got {epsilon}")


def check_backward(op: str, dz, x_or_z, mu, rsigma, gamma, beta, memory_efficient: bool) -> None:
    """The arguments of a backward of 2-D (rows, hidden_size) tensors. ``x_or_z`` is the forward's
    input, or with ``memory_efficient`` its output (which needs beta, not mu)."""
    device = x_or_z.device
    hidden = _check_params(op, gamma, beta, device)
    _check_dtypes(op, "x_or_z", x_or_z.dtype, gamma)
    _check_rows(op, "x_or_z", x_or_z, hidden, True)
    if memory_efficient:
        if beta is None:
            raise ValueError(f"{op}: beta is required with memory_efficient (x is recovered from the output z)")
        if x_or_z.dtype != gamma.dtype:
            raise TypeError(
                f"{op}: x_or_z has dtype {x_or_z.dtype}; with memory_efficient it is the output z, in gamma's "
                f"dtype {gamma.dtype}"
            )
    elif mu is None:
        raise ValueError(f"{op}: mu is required unless memory_efficient")
    if dz.dtype != gamma.dtype:
        raise TypeError(f"{op}: dz has dtype {dz.dtype}; expected the output's, gamma's {gamma.dtype}")
    if dz.shape != x_or_z.shape:
        raise ValueError(f"{op}: dz has shape {tuple(dz.shape)} but x_or_z has {tuple(x_or_z.shape)}")
    if dz.device != device:
        raise ValueError(f"{op}: dz is on {dz.device}, expected {device}")
    stats_dtype = torch.float64 if x_or_z.dtype == torch.float64 else torch.float32
    rows = x_or_z.shape[0]
    for name, t in (("mu", None if memory_efficient else mu), ("rsigma", rsigma)):
        if t is None:
            continue
        if t.dtype != stats_dtype:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected {stats_dtype}")
        if t.numel() != rows:
            raise ValueError(f"{op}: {name} has {t.numel()} elements, expected one per row ({rows})")
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, expected {device}")


# the calls into apex-normalization (checked arguments)


def _upcast(input_dtype: torch.dtype, gamma: torch.Tensor) -> bool:
    """float32 input with 16-bit parameters, which apex-normalization's ops do not take: computed
    with float32 parameters, the results rounded once to gamma's dtype."""
    return input_dtype == torch.float32 and gamma.dtype in _HALF


def forward(x, gamma, beta, epsilon) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(z, mu, rsigma): z = (x - mu) * rsigma * gamma + beta over x's last dimension, in gamma's
    dtype; mu and rsigma with x's leading shape."""
    hidden = gamma.numel()
    w = gamma.reshape(hidden).contiguous()
    b = beta.reshape(hidden).contiguous()
    x = x.contiguous()
    if _upcast(x.dtype, gamma):
        z, mu, rsigma = _ops.norm_forward(x, w.float(), b.float(), (hidden,), epsilon, False, False, None)
        return z.to(gamma.dtype), mu, rsigma
    output_dtype = None if w.dtype == x.dtype else w.dtype
    return _ops.norm_forward(x, w, b, (hidden,), epsilon, False, False, output_dtype)


def backward(dz, x_or_z, mu, rsigma, gamma, beta, memory_efficient: bool, input_dtype: torch.dtype):
    """(dx in ``input_dtype``, dgamma, dbeta in gamma's dtype and shape) of 2-D tensors."""
    hidden = gamma.numel()
    w = gamma.reshape(hidden).contiguous()
    # Without beta (upstream's older five-argument call) dbeta is still returned: the op computes
    # the bias gradient when given a bias, whose values it reads only with memory_efficient.
    b = torch.zeros_like(w) if beta is None else beta.reshape(hidden).contiguous()
    upcast = _upcast(input_dtype, gamma)
    if upcast:
        dz, w, b = dz.float(), w.float(), b.float()
        if memory_efficient:
            x_or_z = x_or_z.float()
    mean = rsigma.new_empty((0,)) if memory_efficient else mu.contiguous()
    dx, dgamma, dbeta = _ops.norm_backward(
        dz.contiguous(),
        x_or_z.contiguous(),
        w,
        b,
        mean,
        rsigma.contiguous(),
        (hidden,),
        False,
        memory_efficient,
        input_dtype,
        True,
    )
    if upcast:
        dgamma, dbeta = dgamma.to(gamma.dtype), dbeta.to(gamma.dtype)
    return dx, dgamma.view(gamma.shape), dbeta.view(gamma.shape)


class FastLayerNormFN(torch.autograd.Function):
    r"""Layer norm over the last dimension with weight and bias, as upstream's:
    ``FastLayerNormFN.apply(x, gamma, beta, epsilon, memory_efficient=False)``.

    .. math::
        z = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma + \beta

    x is viewed as ``(-1, hidden_size)`` with ``hidden_size = gamma.numel()``, which must be x's
    last dimension (upstream only needed it to divide x's size). The output has gamma's dtype (see
    the module docstring for the supported pairs); mean and variance are computed in float32.
    ``memory_efficient``: save the output instead of the input for backward and recover x from it
    (gamma must have no zeros). Differentiable once in x, gamma and beta. Unlike upstream's, any
    hidden size is supported and no autocast casting is done here (:class:`FastLayerNorm` does it).
    """

    @classmethod
    def apply(cls, x, gamma, beta, epsilon, memory_efficient=False):
        """Upstream's entry point (what Megatron-Core calls). Where apex-normalization's op takes the
        pair of dtypes (every pair but float32 x with 16-bit gamma) this is the op with its
        registered autograd, C++ on CUDA: the kernels :meth:`forward` and :meth:`backward` run, at
        a fraction of a Python Function's host time per call (0.54-0.75x FusedLayerNorm's speed
        at forward+backward shapes of about 0.12 ms on the H200 before). Otherwise the Function."""
        if isinstance(x, torch.Tensor) and isinstance(gamma, torch.Tensor):
            if _TORCH_OFF_CUDA and not x.is_cuda:
                return _torch_layer_norm("FastLayerNormFN", x, gamma, beta, epsilon)
            if not _upcast(x.dtype, gamma):
                return _norm_op("FastLayerNormFN", x, gamma, beta, epsilon, memory_efficient)
        return super().apply(x, gamma, beta, epsilon, memory_efficient)

    @staticmethod
    def forward(ctx, x, gamma, beta, epsilon, memory_efficient=False):
        check_forward("FastLayerNormFN", x, gamma, beta, epsilon, False)
        x = x.contiguous()
        xmat = x.view(-1, gamma.numel())
        zmat, mu, rsigma = forward(xmat, gamma, beta, epsilon)
        ctx.memory_efficient = bool(memory_efficient)
        ctx.x_shape = x.shape
        ctx.input_dtype = x.dtype
        if ctx.memory_efficient:
            ctx.save_for_backward(zmat, gamma, beta, None, rsigma)
        else:
            ctx.save_for_backward(xmat, gamma, beta, mu, rsigma)
        return zmat.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x_or_z, gamma, beta, mu, rsigma = ctx.saved_tensors
        dymat = dy.contiguous().view(x_or_z.shape)
        dx, dgamma, dbeta = backward(dymat, x_or_z, mu, rsigma, gamma, beta, ctx.memory_efficient, ctx.input_dtype)
        return dx.view(ctx.x_shape), dgamma, dbeta, None, None


def _fast_layer_norm(x, gamma, beta, epsilon, memory_efficient):
    """FastLayerNorm's forward: upstream's autocast cast, then the op with its registered autograd
    (the same call as apex.normalization's modules, C++ autograd on CUDA); FastLayerNormFN for the
    float32-input, 16-bit-parameter pair, which the op does not take."""
    x, gamma, beta = _cast_if_autocast_enabled(x, gamma, beta)
    if _TORCH_OFF_CUDA and not x.is_cuda:
        return _torch_layer_norm("FastLayerNorm", x, gamma, beta, epsilon)
    if _upcast(x.dtype, gamma):
        return FastLayerNormFN.apply(x, gamma, beta, epsilon, memory_efficient)
    return _norm_op("FastLayerNorm", x, gamma, beta, epsilon, memory_efficient)


def _torch_layer_norm(op, x, gamma, beta, epsilon):
    """Off CUDA: ``F.layer_norm`` after the op's checks (as ``op``), the output in gamma's dtype: for a
    mixed pair x and the parameters in float32 (16-bit values are exact there), the output rounded once.
    memory_efficient changes nothing here (torch's backward saves the input; the results are the same)."""
    check_forward(op, x, gamma, beta, epsilon, False)
    hidden = gamma.numel()
    w = gamma if gamma.dim() == 1 else gamma.reshape(hidden)
    b = beta if beta.dim() == 1 else beta.reshape(hidden)
    if x.dtype == gamma.dtype:
        return F.layer_norm(x, (hidden,), w, b, epsilon)
    return F.layer_norm(x.float(), (hidden,), w.float(), b.float(), epsilon).to(gamma.dtype)


def _norm_op(op, x, gamma, beta, epsilon, memory_efficient):
    """The op with its registered autograd, for the pairs of dtypes it takes (checked as ``op``)."""
    check_forward(op, x, gamma, beta, epsilon, False)
    hidden = gamma.numel()
    output_dtype = None if gamma.dtype == x.dtype else gamma.dtype
    # The module's 1-D parameters go in as they are: a view would add an autograd node per call.
    w = (gamma if gamma.dim() == 1 else gamma.reshape(hidden)).contiguous()
    b = (beta if beta.dim() == 1 else beta.reshape(hidden)).contiguous()
    return _ops.norm_forward(x.contiguous(), w, b, (hidden,), epsilon, False, memory_efficient, output_dtype)[0]


class FastLayerNorm(nn.Module):
    r"""Layer normalization over the last dimension with a learnable weight and bias, as upstream's
    ``apex.contrib.layer_norm.FastLayerNorm``.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \text{weight} + \text{bias}

    Mean and (biased) variance in float32. The output has the parameters' dtype; under CUDA
    autocast the input and parameters are first cast to its dtype (upstream's behaviour). On CUDA
    this is apex.normalization's layer norm kernel (forward and backward), or without a built kernel
    its PyTorch reference; off CUDA it is ``torch.nn.functional.layer_norm`` (in float32 for a mixed
    pair of dtypes; ``memory_efficient`` then changes nothing), as is :class:`FastLayerNormFN`.

    Args:
        hidden_size (int): the size of the input's last dimension (any size; upstream's kernels
            took a fixed list).
        eps (float): added to the variance. Default: 1e-5 (the attribute is ``epsilon``, as upstream's).
        memory_efficient (bool): save the output instead of the input for backward and recover the
            normalized values from it (the weight must have no zeros). Default: False.
        device, dtype: of the parameters (keyword only; not upstream's).

    Shape: input ``(*, hidden_size)``; output the same.
    """

    def __init__(self, hidden_size, eps=1e-5, memory_efficient=False, *, device=None, dtype=None):
        super().__init__()
        self.epsilon = eps
        self.memory_efficient = memory_efficient
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x):
        return _fast_layer_norm(x, self.weight, self.bias, self.epsilon, self.memory_efficient)

    def extra_repr(self) -> str:
        text = f"{self.weight.numel()}, eps={self.epsilon}"
        return text + (", memory_efficient=True" if self.memory_efficient else "")


__all__ = ["FastLayerNorm", "FastLayerNormFN"]
