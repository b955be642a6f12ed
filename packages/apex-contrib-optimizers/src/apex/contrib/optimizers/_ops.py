"""apex_contrib_optimizers's dispatcher ops: schemas, checks and PyTorch references.

These are the operations of upstream's deprecated ``fused_adam_cuda`` and ``distributed_lamb_cuda``
extensions whose arithmetic no apex-optimizers kernel does (Adam with the bias corrections folded
into the step size and eps optionally under the square root, its undo, the e5m2 byte casts, the
finite checks, the split LAMB of DistributedFusedLAMB). Where an apex-optimizers kernel does the
same arithmetic the classes call that instead (see ``fused_adam.py``, ``fused_sgd.py``,
``fused_lamb.py``).

The PyTorch references below are the CPU path, the fallback and the specification; on CUDA the kernels
of ``csrc/legacy_adam.cu`` (adam, adam_undo, maybe_cast, strided_check_finite) and
``csrc/distributed_lamb.cu`` (the two LAMB stages) run them, one pass each. Flags (``overflow_flag``,
``noop_flag``) are int32 one-element tensors on the device; nothing here reads them on the host. How an
op is written: ``apex.core.library``.
"""

from __future__ import annotations

import math

import torch

from apex.contrib.optimizers._plugin import KERNELS
from apex.core import checks
from apex.core.library import op

# Upstream's adam modes: 0 puts eps under the square root, 1 adds it after.
EPS_INSIDE_SQRT, EPS_OUTSIDE_SQRT = 0, 1
_PARAM_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# What an output copy may be: a float dtype, or uint8 holding e5m2 (the high byte of a float16).
_OUTPUT_DTYPES = (*checks.FLOAT_DTYPES, torch.uint8)
_CAST_DTYPES = (*_PARAM_DTYPES, torch.uint8)
_SIGN_AND_EXPONENT = -8388608  # 0xFF800000 as an int32: the sign and exponent bits of a float32


# e5m2 bytes ---------------------------------------------------------------------------------


def to_e5m2(x: torch.Tensor) -> torch.Tensor:
    """uint8 e5m2 codes of ``x``: the high byte of the float16 of ``x`` plus an eighth of its power
    of two (so the dropped mantissa byte rounds to nearest instead of truncating), as upstream."""
    x = x.float()
    power = (x.view(torch.int32) & _SIGN_AND_EXPONENT).view(torch.float32)
    bits = (x + power / 8).half().view(torch.int16).to(torch.int32)
    return ((bits >> 8) & 0xFF).to(torch.uint8)


def from_e5m2(codes: torch.Tensor) -> torch.Tensor:
    """The float16 values of uint8 e5m2 ``codes`` (the code is the high byte, the low byte zero)."""
    bits = codes.to(torch.int32) << 8
    return torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(torch.float16)


def _cast_into(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` converted to ``target``'s dtype (uint8: e5m2 codes) and shape."""
    value = value.reshape(target.shape)
    return to_e5m2(value) if target.dtype == torch.uint8 else value.to(target.dtype)


def _as_float(t: torch.Tensor) -> torch.Tensor:
    return from_e5m2(t).float() if t.dtype == torch.uint8 else t


def _flag_set(flag: torch.Tensor) -> torch.Tensor:
    return flag.reshape(()) != 0


def _check_flag(a, name: str = "overflow_flag", device=None):
    t = getattr(a, name)
    return checks.scalar_tensor(a.op, name, t, (torch.int32,), device)


# adam -----------------------------------------------------------------------------------------


def adam_step_size(lr: float, beta1: float, beta2: float, step: int, bias_correction: bool) -> float:
    """Upstream's step size: both bias corrections go into it (not into eps), lr alone without them."""
    if not bias_correction:
        return lr
    return lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)


def _state_dtype(param_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def _check_adam_lists(a, *, with_outputs: bool) -> None:
    checks.same_lengths(a.op, p=a.p, m=a.m, v=a.v, g=a.g)
    device = checks.tensor_list(a.op, "p", a.p, None, dtypes=_PARAM_DTYPES)
    if not a.p:
        return
    pdt = a.p[0].dtype
    state = _state_dtype(pdt)
    for name in ("m", "v"):
        checks.tensor_list(a.op, name, getattr(a, name), device, dtypes=(state,))
    grad_dtypes = (pdt, torch.float16, torch.bfloat16) if pdt == torch.float32 else (pdt,)
    checks.tensor_list(a.op, "g", a.g, device, dtypes=grad_dtypes)
    lists = {"m": a.m, "v": a.v, "g": a.g}
    if with_outputs and a.p_copy:
        checks.same_lengths(a.op, p=a.p, p_copy=a.p_copy)
        checks.tensor_list(a.op, "p_copy", a.p_copy, device, dtypes=_OUTPUT_DTYPES)
        lists["p_copy"] = a.p_copy
    for name, tensors in lists.items():
        for i, (p, t) in enumerate(zip(a.p, tensors)):
            if t.numel() != p.numel():
                raise ValueError(f"{a.op}: {name}[{i}] has {t.numel()} elements but p[{i}] has {p.numel()}")
    checks.same_layouts(a.op, p=a.p, **lists)
    if a.eps_mode not in (EPS_INSIDE_SQRT, EPS_OUTSIDE_SQRT):
        raise ValueError(f"{a.op}: eps_mode must be 0 (eps inside the square root) or 1 (outside), got {a.eps_mode}")
    if a.bias_correction and a.step < 1:
        raise ValueError(f"{a.op}: step must be >= 1 with bias_correction, got {a.step}")
    if not a.grad_scale > 0:
        raise ValueError(f"{a.op}: grad_scale must be positive, got {a.grad_scale}")


def _check_adam(a) -> None:
    _check_adam_lists(a, with_outputs=True)
    if a.p_copy and a.p_copy[0].dtype == torch.uint8 and not a.reversible:
        raise TypeError(f"{a.op}: p_copy has dtype torch.uint8 (e5m2); only the reversible step writes e5m2")


def _denominator(v, eps, mode):
    return (v + eps).sqrt() if mode == EPS_INSIDE_SQRT else v.sqrt() + eps


@op(
    KERNELS,
    "adam(Tensor(a!)[] p, Tensor(b!)[] p_copy, Tensor(c!)[] m, Tensor(d!)[] v, Tensor[] g, float lr, "
    "float beta1, float beta2, float eps, float grad_scale, int step, int eps_mode, bool bias_correction, "
    "float decay, bool reversible=False) -> ()",
    check=_check_adam,
)
def adam(a):
    """Upstream's contrib Adam, on every tensor of the lists. With ``s`` the step size
    (:func:`adam_step_size`) and ``g`` the gradient divided by ``grad_scale``::

        m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
        p = p - s (m / denom + decay p),  denom = sqrt(v + eps) (eps_mode 0) or sqrt(v) + eps (eps_mode 1)

    ``p_copy`` (empty, or one tensor per parameter) receives the new ``p`` rounded to its dtype.
    ``reversible``: elements whose scaled gradient is not finite are left as they were, and a
    tensor with any such element gets an infinity in ``p_copy[i][0]`` (upstream's signal to undo).
    Arithmetic in fp32 (fp64 for fp64 ``p``); ``m``/``v`` fp32 (fp64) for every ``p``."""
    step_size = adam_step_size(a.lr, a.beta1, a.beta2, a.step, a.bias_correction)
    for i, param in enumerate(a.p):
        compute = _state_dtype(param.dtype)
        p = param.to(compute)
        g = a.g[i].to(compute).reshape(p.shape) / a.grad_scale
        m = a.m[i] * a.beta1 + (1 - a.beta1) * g
        v = a.v[i] * a.beta2 + (1 - a.beta2) * g * g
        new_p = p - step_size * (m / _denominator(v, a.eps, a.eps_mode) + a.decay * p)
        if a.reversible:
            finite = torch.isfinite(g)
            m, v, new_p = torch.where(finite, m, a.m[i]), torch.where(finite, v, a.v[i]), torch.where(finite, new_p, p)
        a.m[i].copy_(m)
        a.v[i].copy_(v)
        param.copy_(new_p)
        if a.p_copy:
            out = _cast_into(a.p_copy[i], new_p)
            if a.reversible and out.numel() > 0:
                inf = _cast_into(out.reshape(-1)[:1], torch.full((1,), math.inf, device=out.device))
                first = torch.where(finite.all(), out.reshape(-1)[:1], inf)
                out = torch.cat([first, out.reshape(-1)[1:]]).reshape(out.shape)
            a.p_copy[i].copy_(out)


def _check_adam_undo(a) -> None:
    device = _check_flag(a)
    _check_adam_lists(a, with_outputs=False)
    if a.p and a.p[0].device != device:
        raise ValueError(f"{a.op}: overflow_flag is on {device}, expected {a.p[0].device}")


@op(
    KERNELS,
    "adam_undo(Tensor overflow_flag, Tensor(a!)[] p, Tensor(b!)[] m, Tensor(c!)[] v, Tensor[] g, float lr, "
    "float beta1, float beta2, float eps, float grad_scale, int step, int eps_mode, bool bias_correction, "
    "float decay) -> ()",
    check=_check_adam_undo,
)
def adam_undo(a):
    """Inverts :func:`adam` (same arguments) where its scaled gradient was finite, when
    ``overflow_flag`` is non-zero; otherwise writes nothing (decided on the device)."""
    step_size = adam_step_size(a.lr, a.beta1, a.beta2, a.step, a.bias_correction)
    undo = _flag_set(a.overflow_flag)
    for i, param in enumerate(a.p):
        compute = _state_dtype(param.dtype)
        p, m, v = param.to(compute), a.m[i], a.v[i]
        g = a.g[i].to(compute).reshape(p.shape) / a.grad_scale
        old_p = (p + step_size * (m / _denominator(v, a.eps, a.eps_mode))) / (1 - step_size * a.decay)
        old_m = (m - (1 - a.beta1) * g) / a.beta1
        # Rounding can leave a tiny negative second moment when the first step is undone.
        old_v = ((v - (1 - a.beta2) * g * g) / a.beta2).clamp_min(0)
        write = undo & torch.isfinite(g)
        a.m[i].copy_(torch.where(write, old_m, m))
        a.v[i].copy_(torch.where(write, old_v, v))
        param.copy_(torch.where(write, old_p, p))


# finite checks and casts ------------------------------------------------------------------------


def _check_strided_check_finite(a) -> None:
    device = _check_flag(a)
    checks.tensor_list(a.op, "p_copy", [a.p_copy], device, dtypes=_CAST_DTYPES)
    if a.stride < 1:
        raise ValueError(f"{a.op}: stride must be >= 1, got {a.stride}")


@op(
    KERNELS,
    "strided_check_finite(Tensor(a!) overflow_flag, Tensor p_copy, int stride, bool clear_overflow_first) -> ()",
    check=_check_strided_check_finite,
)
def strided_check_finite(a):
    """Sets ``overflow_flag`` to 1 if any of every ``stride``-th element of ``p_copy`` (flattened;
    uint8: e5m2 codes) is inf or NaN; clears it first when ``clear_overflow_first``."""
    sample = _as_float(a.p_copy.reshape(-1)[:: a.stride])
    bad = ~torch.isfinite(sample).all()
    before = torch.zeros_like(a.overflow_flag) if a.clear_overflow_first else a.overflow_flag
    a.overflow_flag.copy_(torch.where(bad, torch.ones_like(before), before))


def _check_maybe_cast(a) -> None:
    device = _check_flag(a)
    checks.same_lengths(a.op, p_in=a.p_in, p_out=a.p_out)
    checks.tensor_list(a.op, "p_in", a.p_in, device, dtypes=_CAST_DTYPES)
    checks.tensor_list(a.op, "p_out", a.p_out, device, dtypes=_CAST_DTYPES)
    for i, (x, y) in enumerate(zip(a.p_in, a.p_out)):
        if x.numel() != y.numel():
            raise ValueError(f"{a.op}: p_out[{i}] has {y.numel()} elements but p_in[{i}] has {x.numel()}")
    checks.same_layouts(a.op, p_in=a.p_in, p_out=a.p_out)


@op(
    KERNELS,
    "maybe_cast(Tensor overflow_flag, Tensor[] p_in, Tensor(a!)[] p_out) -> ()",
    check=_check_maybe_cast,
)
def maybe_cast(a):
    """``p_out[i] = p_in[i]`` converted (fp32, fp16, bf16, fp64, or uint8 e5m2 codes either way),
    unless ``overflow_flag`` is non-zero (decided on the device)."""
    keep = _flag_set(a.overflow_flag)
    for x, y in zip(a.p_in, a.p_out):
        y.copy_(torch.where(keep, y, _cast_into(y, _as_float(x))))


# DistributedFusedLAMB's split LAMB (upstream's distributed_lamb_cuda) ------------------------------
# Per-tensor hyperparameters come as 1-D device tensors (one entry per tensor of the lists), so one
# call serves parameters of several groups; nothing is read on the host.

_FLOAT32 = (torch.float32,)


def _check_per_tensor(a, n: int, device, names, dtype=torch.float32) -> None:
    for name in names:
        t = getattr(a, name)
        checks.placed(a.op, name, t, device)
        if t.dtype != dtype or t.dim() != 1 or t.numel() < n:
            raise ValueError(
                f"{a.op}: {name} must be a 1-D {dtype} tensor of at least {n} elements (one per tensor), "
                f"got {t.dtype} of shape {tuple(t.shape)}"
            )


def _check_compute_update_term(a) -> None:
    device = _check_flag(a, "noop_flag")
    n = checks.same_lengths(a.op, g=a.g, p=a.p, m=a.m, v=a.v, u=a.u)
    if not n:
        return
    checks.tensor_list(a.op, "g", a.g, device)
    checks.tensor_list(a.op, "p", a.p, device, dtypes=(torch.float32, torch.float16))
    for name in ("m", "v", "u"):
        checks.tensor_list(a.op, name, getattr(a, name), device, dtypes=_FLOAT32)
    for name in ("g", "m", "v", "u"):
        for i, (p, t) in enumerate(zip(a.p, getattr(a, name))):
            if t.numel() != p.numel():
                raise ValueError(f"{a.op}: {name}[{i}] has {t.numel()} elements but p[{i}] has {p.numel()}")
    _check_per_tensor(a, n, device, ("beta1", "beta2", "beta3", "epsilon", "decay"))
    _check_per_tensor(a, n, device, ("bias_correction",), dtype=torch.int32)
    checks.scalar_tensor(a.op, "step", a.step, (torch.int32,), device)
    for name in ("global_scale", "global_grad_norm"):
        checks.scalar_tensor(a.op, name, getattr(a, name), _FLOAT32, device)
    if a.moment_mode not in (0, 1):
        raise ValueError(
            f"{a.op}: moment_mode must be 0 (L2 on the gradient) or 1 (decoupled decay), got {a.moment_mode}"
        )


@op(
    KERNELS,
    "lamb_compute_update_term(Tensor noop_flag, Tensor[] g, Tensor[] p, Tensor(a!)[] m, Tensor(b!)[] v, "
    "Tensor(c!)[] u, Tensor beta1, Tensor beta2, Tensor beta3, Tensor bias_correction, Tensor step, "
    "Tensor epsilon, int moment_mode, Tensor decay, Tensor global_scale, Tensor global_grad_norm, "
    "float max_grad_norm) -> ()",
    check=_check_compute_update_term,
)
def lamb_compute_update_term(a):
    """LAMB's first stage per tensor ``i``: the gradient divided by the loss scale ``global_scale``
    (and, when ``max_grad_norm > 0``, also by ``max(1, (norm/scale + 1e-6) / max_grad_norm)`` with
    ``norm = global_grad_norm``, the norm of the scaled gradients), then Adam's moments with
    ``beta1[i]``, ``beta2[i]``, the gradient term weighted by ``beta3[i]``, bias corrections where
    ``bias_correction[i] == 1`` at step ``step``, and the update ``u = m^/(sqrt(v^) + epsilon[i])``,
    with ``decay[i] p`` added to the gradient (``moment_mode`` 0) or to ``u`` (1). Nothing is written
    when ``noop_flag`` is non-zero."""
    if not a.p:
        return
    skip = _flag_set(a.noop_flag)
    scale = a.global_scale.reshape(())
    combined = scale
    if a.max_grad_norm > 0:
        clip = a.max_grad_norm / (a.global_grad_norm.reshape(()) / scale + 1e-6)
        combined = scale / clip.clamp(max=1.0)
    step = a.step.reshape(()).float()
    for i, p in enumerate(a.p):
        b1, b2, b3 = a.beta1[i], a.beta2[i], a.beta3[i]
        corrected = a.bias_correction[i] == 1
        bc1 = torch.where(corrected, 1 - b1**step, torch.ones_like(b1))
        bc2 = torch.where(corrected, 1 - b2**step, torch.ones_like(b2))
        param = p.float().reshape(-1)
        g = a.g[i].float().reshape(-1) / combined
        if a.moment_mode == 0:
            g = g + a.decay[i] * param
        m = a.m[i].reshape(-1) * b1 + b3 * g
        v = a.v[i].reshape(-1) * b2 + (1 - b2) * g * g
        u = (m / bc1) / ((v / bc2).sqrt() + a.epsilon[i])
        if a.moment_mode == 1:
            u = u + a.decay[i] * param
        for target, new in ((a.m[i], m), (a.v[i], v), (a.u[i], u)):
            target.copy_(torch.where(skip, target.reshape(-1), new).reshape(target.shape))


def _check_update_weights(a) -> None:
    device = _check_flag(a, "noop_flag")
    n = checks.same_lengths(a.op, u=a.u, p=a.p, p_copy=a.p_copy)
    if not n:
        return
    checks.tensor_list(a.op, "u", a.u, device, dtypes=_FLOAT32)
    checks.tensor_list(a.op, "p", a.p, device, dtypes=(torch.float32, torch.float16))
    checks.tensor_list(a.op, "p_copy", a.p_copy, device, dtypes=_OUTPUT_DTYPES)
    for name in ("u", "p_copy"):
        for i, (p, t) in enumerate(zip(a.p, getattr(a, name))):
            if t.numel() != p.numel():
                raise ValueError(f"{a.op}: {name}[{i}] has {t.numel()} elements but p[{i}] has {p.numel()}")
    _check_per_tensor(a, n, device, ("param_norm", "decay"))
    _check_per_tensor(a, n, device, ("update_norm_offset",), dtype=torch.int64)
    checks.placed(a.op, "update_norm", a.update_norm, device)
    if a.update_norm.dtype != torch.float32 or a.update_norm.dim() != 1:
        raise ValueError(f"{a.op}: update_norm must be a 1-D float32 tensor, got {a.update_norm.dtype}")
    for name in ("learning_rate", "global_grad_norm"):
        checks.scalar_tensor(a.op, name, getattr(a, name), _FLOAT32, device)


@op(
    KERNELS,
    "lamb_update_weights(Tensor noop_flag, Tensor[] u, Tensor(a!)[] p, Tensor(b!)[] p_copy, Tensor param_norm, "
    "Tensor update_norm, Tensor update_norm_offset, Tensor learning_rate, Tensor decay, Tensor global_grad_norm, "
    "bool use_nvlamb) -> ()",
    check=_check_update_weights,
)
def lamb_update_weights(a):
    """LAMB's second stage per tensor ``i``: ``p -= r u`` with ``r = lr * param_norm[i] /
    update_norm[update_norm_offset[i]]`` where both norms are non-zero and the trust ratio applies
    (``use_nvlamb`` or ``decay[i] != 0``), else ``r = lr``; ``p_copy[i]`` receives the new ``p`` in
    its dtype (uint8: e5m2 codes). Nothing is written when ``noop_flag`` is non-zero.
    ``global_grad_norm`` is accepted for upstream's signature and not read."""
    if not a.p:
        return
    skip = _flag_set(a.noop_flag)
    lr = a.learning_rate.reshape(())
    update_norms = a.update_norm.index_select(0, a.update_norm_offset[: len(a.p)])
    for i, p in enumerate(a.p):
        pn, un = a.param_norm[i], update_norms[i]
        trusted = (pn != 0) & (un != 0)
        if not a.use_nvlamb:
            trusted = trusted & (a.decay[i] != 0)
        ratio = torch.where(trusted, lr * pn / un, lr)
        new = p.float().reshape(-1) - ratio * a.u[i].reshape(-1)
        p.copy_(torch.where(skip, p.reshape(-1), new.to(p.dtype)).reshape(p.shape))
        copy = a.p_copy[i]
        copy.copy_(torch.where(skip, copy.reshape(-1), _cast_into(copy.reshape(-1), new)).reshape(copy.shape))
