"""apex-optimizers' dispatcher ops (namespace ``apex_optimizers``): schemas, checks, references.

Conventions shared by every op:
- one tensor list per role; ``params``/``grads`` of one dtype each (fp32, fp16 or bf16; Adam and
  Adagrad also float64, as upstream's kernels), all optimizer state (moments, sums, momentum
  buffers, master weights) in fp32;
- tensors contiguous, or dense (channels-last, any permutation) with the same shape and strides
  at one index of every list: the kernels run over the storage element by element;
- ``maximize`` (Adam, SGD, Adagrad, as torch's): the gradient is negated as it is read;
- ``master_params`` empty, or fp32 copies of ``params``: the update is computed on them and the
  rounded result is written to ``params`` in the same pass;
- ``lr``/``step`` are host numbers unless ``lr_tensor``/``step_tensor`` (fp32, one element, on the
  device) are given, which then win: the step can be captured in a CUDA graph;
- ``grad_scale`` (the loss scale, fp32 one-element tensor): gradients are divided by it;
  ``found_inf`` (fp32 one-element tensor): when non-zero nothing is written (the step is skipped
  without a host sync), as ``torch.amp.GradScaler`` expects of fused optimizers;
- arithmetic in fp32.
The references below are the specification the CUDA kernels are tested against. How an op is
written: ``apex.core.library``.
"""

from __future__ import annotations

import torch

from apex.core import checks
from apex.core.library import op
from apex.optimizers._plugin import KERNELS

FP32 = (torch.float32,)
WITH_FLOAT64 = (*checks.FLOAT_DTYPES, torch.float64)
# The optional one-element fp32 tensors, in the order they are checked; an op takes those of its schema.
OPTIONAL_SCALARS = ("lr_tensor", "step_tensor", "grad_scale", "found_inf")


# shared checks and helpers ----------------------------------------------------------------


def _check_lists(a, *states: str, dtypes=checks.FLOAT_DTYPES) -> None:
    """params, grads (of ``dtypes``), the fp32 state lists named ``states`` (one tensor per
    parameter), master_params and the optional scalars, as every op takes them; sets ``a.device``."""
    per_param = {"grads": a.grads, **{name: getattr(a, name) for name in states}}
    checks.same_lengths(a.op, params=a.params, **per_param)
    a.device = checks.tensor_list(a.op, "params", a.params, None, dtypes=dtypes)
    checks.tensor_list(a.op, "grads", a.grads, a.device, dtypes=dtypes)
    for name in states:
        checks.tensor_list(a.op, name, per_param[name], a.device, dtypes=FP32)
    if a.master_params:
        checks.same_lengths(a.op, params=a.params, master_params=a.master_params)
        checks.tensor_list(a.op, "master_params", a.master_params, a.device, dtypes=FP32)
    for name, tensors in [*per_param.items(), ("master_params", a.master_params)]:
        for i, (p, t) in enumerate(zip(a.params, tensors)):
            if t.numel() != p.numel():
                raise ValueError(f"{a.op}: {name}[{i}] has {t.numel()} elements but params[{i}] has {p.numel()}")
    checks.same_layouts(a.op, params=a.params, **per_param, master_params=a.master_params)
    for name in OPTIONAL_SCALARS:
        t = getattr(a, name, None)
        if t is not None:
            checks.scalar_tensor(a.op, name, t, FP32, a.device)
    if a.params and torch.float64 in (a.params[0].dtype, a.grads[0].dtype):
        if a.params[0].dtype != a.grads[0].dtype:
            raise TypeError(
                f"{a.op}: params have dtype {a.params[0].dtype} but grads have {a.grads[0].dtype}; "
                "float64 params need float64 grads"
            )
        if a.master_params:
            raise ValueError(f"{a.op}: float64 params take no master_params")


def _lr(a):
    return a.lr if a.lr_tensor is None else a.lr_tensor.reshape(())


def _bias_corrections(a):
    if not a.bias_correction:
        return 1.0, 1.0
    step_tensor = getattr(a, "step_tensor", None)  # NovoGrad's schema has none
    step = float(a.step) if step_tensor is None else step_tensor.reshape(())
    return 1.0 - a.beta1**step, 1.0 - a.beta2**step


def _skip(a):
    """A device bool that is set when ``found_inf`` is, or None without ``found_inf``."""
    return None if a.found_inf is None else a.found_inf.reshape(()) != 0


def _tensors(a):
    """Per parameter: its index, its fp32 value (the master copy's, if any), its unscaled fp32
    gradient (not negated for ``maximize``: each op does that)."""
    for i, param in enumerate(a.params):
        p = (a.master_params[i] if a.master_params else param).float()
        g = a.grads[i].float()
        if a.grad_scale is not None:
            g = g / a.grad_scale.reshape(())
        yield i, p, g.reshape(p.shape)


def _commit(target: torch.Tensor, new: torch.Tensor, skip):
    """Write ``new`` into ``target`` unless ``skip`` (a device bool) is set."""
    new = new.reshape(target.shape).to(target.dtype)
    if skip is None:
        target.copy_(new)
    else:
        target.copy_(torch.where(skip, target, new))


def _write_params(a, i, new, skip):
    if a.master_params:
        _commit(a.master_params[i], new, skip)
    _commit(a.params[i], new, skip)


# fused_adam -------------------------------------------------------------------------------


def _check_adam(a) -> None:
    checks.positive_chunk_size(a.op, a.chunk_size)
    _check_lists(a, "exp_avgs", "exp_avg_sqs", dtypes=WITH_FLOAT64)
    if a.step_tensor is None and a.step < 1 and a.bias_correction:
        raise ValueError(f"{a.op}: step must be >= 1 with bias_correction, got {a.step}")


@op(
    KERNELS,
    "fused_adam(int chunk_size, Tensor(a!)[] params, Tensor(e!)[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] master_params, float lr, int step, float beta1, float beta2, "
    "float eps, float weight_decay, bool adam_w_mode, bool bias_correction, Tensor? lr_tensor=None, "
    "Tensor? step_tensor=None, Tensor? grad_scale=None, Tensor? found_inf=None, bool maximize=False) -> ()",
    check=_check_adam,
)
def fused_adam(a):
    """With ``grad_scale`` the unscaled gradients are also written back to ``grads`` (as torch's
    GradScaler leaves them for non-fused optimizers), unless the step is skipped."""
    lr = _lr(a)
    bc1, bc2 = _bias_corrections(a)
    skip = _skip(a)
    for i, p, g in _tensors(a):
        if a.grad_scale is not None:
            _commit(a.grads[i], g, skip)
        if a.maximize:
            g = -g
        if a.weight_decay != 0:
            if a.adam_w_mode:
                p = p * (1 - lr * a.weight_decay)
            else:
                g = g + a.weight_decay * p
        m = a.exp_avgs[i] * a.beta1 + g * (1 - a.beta1)
        v = a.exp_avg_sqs[i] * a.beta2 + g * g * (1 - a.beta2)
        denom = v.sqrt() / bc2**0.5 + a.eps
        p = p - (lr / bc1) * m / denom
        _commit(a.exp_avgs[i], m, skip)
        _commit(a.exp_avg_sqs[i], v, skip)
        _write_params(a, i, p, skip)


# fused_sgd --------------------------------------------------------------------------------


def _check_sgd(a) -> None:
    checks.positive_chunk_size(a.op, a.chunk_size)
    if a.momentum == 0 and a.momentum_buffers:
        raise ValueError(f"{a.op}: momentum_buffers must be empty when momentum is 0")
    states = ("momentum_buffers",) if a.momentum != 0 else ()
    _check_lists(a, *states)
    if a.nesterov and (a.momentum <= 0 or a.dampening != 0):
        raise ValueError(f"{a.op}: nesterov needs momentum > 0 and dampening 0")


@op(
    KERNELS,
    "fused_sgd(int chunk_size, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
    "Tensor(c!)[] master_params, float lr, float weight_decay, float momentum, float dampening, bool nesterov, "
    "bool first_run, bool wd_after_momentum, Tensor? lr_tensor=None, Tensor? grad_scale=None, "
    "Tensor? found_inf=None, bool maximize=False) -> ()",
    check=_check_sgd,
)
def fused_sgd(a):
    lr = _lr(a)
    skip = _skip(a)
    for i, p, g in _tensors(a):
        if a.maximize:
            g = -g
        if a.weight_decay != 0 and not a.wd_after_momentum:
            g = g + a.weight_decay * p
        if a.momentum != 0:
            buf = g if a.first_run else a.momentum_buffers[i] * a.momentum + g * (1 - a.dampening)
            _commit(a.momentum_buffers[i], buf, skip)
            g = g + a.momentum * buf if a.nesterov else buf
        if a.weight_decay != 0 and a.wd_after_momentum:
            g = g + a.weight_decay * p
        _write_params(a, i, p - lr * g, skip)


# fused_adagrad ----------------------------------------------------------------------------


def _check_adagrad(a) -> None:
    checks.positive_chunk_size(a.op, a.chunk_size)
    _check_lists(a, "state_sums", dtypes=WITH_FLOAT64)


@op(
    KERNELS,
    "fused_adagrad(int chunk_size, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] state_sums, "
    "Tensor(c!)[] master_params, float lr, float eps, float weight_decay, bool adagrad_w_mode, "
    "Tensor? lr_tensor=None, Tensor? grad_scale=None, Tensor? found_inf=None, bool maximize=False) -> ()",
    check=_check_adagrad,
)
def fused_adagrad(a):
    lr = _lr(a)
    skip = _skip(a)
    for i, p, g in _tensors(a):
        if a.maximize:
            g = -g
        if a.weight_decay != 0 and not a.adagrad_w_mode:
            g = g + a.weight_decay * p
        h = a.state_sums[i] + g * g
        update = g / (h.sqrt() + a.eps)
        if a.weight_decay != 0 and a.adagrad_w_mode:
            update = update + a.weight_decay * p
        _commit(a.state_sums[i], h, skip)
        _write_params(a, i, p - lr * update, skip)


# fused_lamb -------------------------------------------------------------------------------


def _check_lamb(a) -> None:
    checks.positive_chunk_size(a.op, a.chunk_size)
    _check_lists(a, "exp_avgs", "exp_avg_sqs")
    if a.params:
        checks.scalar_tensor(a.op, "global_grad_norm", a.global_grad_norm, FP32, a.device)


def lamb_clip_ratio(global_grad_norm, max_grad_norm):
    """Divisor of the gradients: ||g|| / max_grad_norm when that exceeds 1 (and max_grad_norm > 0)."""
    norm = global_grad_norm.reshape(())
    if max_grad_norm <= 0:
        return torch.ones_like(norm)
    return torch.where(norm > max_grad_norm, norm / max_grad_norm, torch.ones_like(norm))


@op(
    KERNELS,
    "fused_lamb(int chunk_size, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] master_params, Tensor global_grad_norm, float lr, int step, "
    "float beta1, float beta2, float eps, float weight_decay, bool adam_w_mode, bool bias_correction, "
    "bool grad_averaging, float max_grad_norm, bool use_nvlamb, Tensor? lr_tensor=None, "
    "Tensor? step_tensor=None, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()",
    check=_check_lamb,
)
def fused_lamb(a):
    if not a.params:
        return
    lr = _lr(a)
    bc1, bc2 = _bias_corrections(a)
    clip = lamb_clip_ratio(a.global_grad_norm, a.max_grad_norm)
    beta3 = 1 - a.beta1 if a.grad_averaging else 1.0
    skip = _skip(a)
    for i, p, g in _tensors(a):
        g = g / clip
        if a.weight_decay != 0 and not a.adam_w_mode:
            g = g + a.weight_decay * p
        m = a.exp_avgs[i] * a.beta1 + g * beta3
        v = a.exp_avg_sqs[i] * a.beta2 + g * g * (1 - a.beta2)
        update = (m / bc1) / ((v / bc2).sqrt() + a.eps)
        if a.weight_decay != 0 and a.adam_w_mode:
            update = update + a.weight_decay * p
        if a.use_nvlamb or a.weight_decay != 0:
            p_norm, u_norm = p.norm(), update.norm()
            ratio = torch.where((p_norm > 0) & (u_norm > 0), p_norm / u_norm, torch.ones_like(p_norm))
        else:
            ratio = 1.0
        _commit(a.exp_avgs[i], m, skip)
        _commit(a.exp_avg_sqs[i], v, skip)
        _write_params(a, i, p - lr * ratio * update, skip)


# fused_novograd ---------------------------------------------------------------------------


def _check_novograd(a) -> None:
    checks.positive_chunk_size(a.op, a.chunk_size)
    _check_lists(a, "exp_avgs")
    for name in ("exp_avg_sq_norms", "grad_norms"):
        t = getattr(a, name)
        if t.dtype != torch.float32 or t.dim() != 1 or t.numel() != len(a.params):
            raise ValueError(
                f"{a.op}: {name} must be a 1-D float32 tensor of {len(a.params)} elements (one per "
                f"tensor), got {t.dtype} of shape {tuple(t.shape)}"
            )
        if a.params and t.device != a.device:
            raise ValueError(f"{a.op}: {name} is on {t.device}, expected {a.device}")
    if a.step < 1:
        raise ValueError(f"{a.op}: step must be >= 1, got {a.step}")


@op(
    KERNELS,
    "fused_novograd(int chunk_size, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!) exp_avg_sq_norms, Tensor grad_norms, Tensor(d!)[] master_params, float lr, int step, float beta1, "
    "float beta2, float eps, float weight_decay, bool bias_correction, bool grad_averaging, "
    "bool reg_inside_moment, bool init_zero, Tensor? lr_tensor=None, Tensor? grad_scale=None, "
    "Tensor? found_inf=None) -> ()",
    check=_check_novograd,
)
def fused_novograd(a):
    if not a.params:
        return
    lr = _lr(a)
    bc1, bc2 = _bias_corrections(a)
    skip = _skip(a)
    # Per-tensor second moment of the gradient norm; the first step takes the norm itself
    # unless init_zero. ``grad_norms`` are of the unscaled gradients.
    norms_sq = a.grad_norms * a.grad_norms
    if a.step == 1 and not a.init_zero:
        v = norms_sq
    else:
        v = a.exp_avg_sq_norms * a.beta2 + norms_sq * (1 - a.beta2)
    _commit(a.exp_avg_sq_norms, v, skip)
    beta3 = 1 - a.beta1 if a.grad_averaging else 1.0
    for i, p, g in _tensors(a):
        g = g / ((v[i] / bc2).sqrt() + a.eps)
        if a.weight_decay != 0 and a.reg_inside_moment:
            g = g + a.weight_decay * p
        m = a.exp_avgs[i] * a.beta1 + g * beta3
        update = m / bc1
        if a.weight_decay != 0 and not a.reg_inside_moment:
            update = update + a.weight_decay * p
        _commit(a.exp_avgs[i], m, skip)
        _write_params(a, i, p - lr * update, skip)
