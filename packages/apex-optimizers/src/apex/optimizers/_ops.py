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


# The references work on whole tensor lists with torch's foreach ops (a pass per op over every
# tensor, in place where it can: the fp32 state and the fp32 values are updated where they live when
# no step can be skipped). Host numbers and one-element tensors (lr_tensor, step_tensor) both go
# through the same calls.


class _Work:
    """An op's fp32 working lists: ``p`` each parameter's value (its master copy, if any), ``g`` its
    unscaled gradient shaped as ``p`` (not negated for ``maximize``: each op does that), and the
    state lists named ``states`` (attributes of the same names). With ``found_inf`` (``skip``) the
    values and states are copies, committed by :meth:`finish` unless the step is skipped; otherwise
    fp32 ones are the tensors themselves. ``g`` may be the gradients themselves: never written in place."""

    def __init__(self, a, *states: str):
        self.a = a
        self.skip = _skip(a)
        self.targets = list(a.master_params) if a.master_params else list(a.params)
        self.p = [t.float() for t in self.targets]
        if self.skip is not None:
            self.p = [x.clone() if x is t else x for x, t in zip(self.p, self.targets)]
        self.states = states
        for name in states:
            tensors = list(getattr(a, name))
            setattr(self, name, tensors if self.skip is None else [t.clone() for t in tensors])
        g = [t.float() if t.shape == x.shape else t.float().reshape(x.shape) for t, x in zip(a.grads, self.p)]
        if a.grad_scale is not None:
            g = torch._foreach_div(g, a.grad_scale.reshape(()))
        self.g = g

    def finish(self) -> None:
        """Write the states, master copies and parameters (rounded to their dtype)."""
        a = self.a
        for name in self.states:
            _commit_all(getattr(a, name), getattr(self, name), self.skip)
        _commit_all(self.targets, self.p, self.skip)
        if a.master_params:
            _commit_all(a.params, self.p, self.skip)


def _commit_all(targets, news, skip) -> None:
    """Write each of ``news`` into its target (not where it is the target) unless ``skip`` (a device bool) is set."""
    pairs = [(t, n if n.shape == t.shape else n.reshape(t.shape)) for t, n in zip(targets, news) if n is not t]
    if not pairs:
        return
    dst, src = [t for t, _ in pairs], [n for _, n in pairs]
    if skip is not None:
        src = [torch.where(skip, t, n.to(t.dtype)) for t, n in zip(dst, src)]
    torch._foreach_copy_(dst, src)


def _sub_scaled_(p, update, scale) -> None:
    """p -= scale * update, ``scale`` a number or a one-element tensor."""
    if isinstance(scale, torch.Tensor):
        torch._foreach_sub_(p, torch._foreach_mul(update, scale))
    else:
        torch._foreach_add_(p, update, alpha=-scale)


def _sub_ratio_(p, num, den, scale) -> None:
    """p -= scale * num / den, ``scale`` a number or a one-element tensor."""
    if isinstance(scale, torch.Tensor):
        _sub_scaled_(p, torch._foreach_div(num, den), scale)
    else:
        torch._foreach_addcdiv_(p, num, den, value=-scale)


def _add_weight_decay(g, p, weight_decay):
    """g + weight_decay * p (a fresh list)."""
    return torch._foreach_add(g, p, alpha=weight_decay)


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
    if not a.params:
        return
    lr = _lr(a)
    bc1, bc2 = _bias_corrections(a)
    w = _Work(a, "exp_avgs", "exp_avg_sqs")
    g, p = w.g, w.p
    if a.grad_scale is not None:
        _commit_all(a.grads, g, w.skip)
    if a.maximize:
        g = torch._foreach_neg(g)
    if a.weight_decay != 0:
        if a.adam_w_mode:
            torch._foreach_mul_(p, 1 - lr * a.weight_decay)
        else:
            g = _add_weight_decay(g, p, a.weight_decay)
    m, v = w.exp_avgs, w.exp_avg_sqs
    torch._foreach_mul_(m, a.beta1)
    torch._foreach_add_(m, g, alpha=1 - a.beta1)
    torch._foreach_mul_(v, a.beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - a.beta2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2**0.5)
    torch._foreach_add_(denom, a.eps)
    _sub_ratio_(p, m, denom, lr / bc1)
    w.finish()


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
    if not a.params:
        return
    lr = _lr(a)
    w = _Work(a, "momentum_buffers") if a.momentum != 0 else _Work(a)
    g, p = w.g, w.p
    if a.maximize:
        g = torch._foreach_neg(g)
    if a.weight_decay != 0 and not a.wd_after_momentum:
        g = _add_weight_decay(g, p, a.weight_decay)
    if a.momentum != 0:
        buf = w.momentum_buffers
        if a.first_run:
            torch._foreach_copy_(buf, g)
        else:
            torch._foreach_mul_(buf, a.momentum)
            torch._foreach_add_(buf, g, alpha=1 - a.dampening)
        g = torch._foreach_add(g, buf, alpha=a.momentum) if a.nesterov else buf
    if a.weight_decay != 0 and a.wd_after_momentum:
        g = _add_weight_decay(g, p, a.weight_decay)
    _sub_scaled_(p, g, lr)
    w.finish()


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
    if not a.params:
        return
    lr = _lr(a)
    w = _Work(a, "state_sums")
    g, p, h = w.g, w.p, w.state_sums
    if a.maximize:
        g = torch._foreach_neg(g)
    if a.weight_decay != 0 and not a.adagrad_w_mode:
        g = _add_weight_decay(g, p, a.weight_decay)
    torch._foreach_addcmul_(h, g, g)
    denom = torch._foreach_sqrt(h)
    torch._foreach_add_(denom, a.eps)
    if a.weight_decay != 0 and a.adagrad_w_mode:
        update = torch._foreach_div(g, denom)
        torch._foreach_add_(update, p, alpha=a.weight_decay)
        _sub_scaled_(p, update, lr)
    else:
        _sub_ratio_(p, g, denom, lr)
    w.finish()


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
    w = _Work(a, "exp_avgs", "exp_avg_sqs")
    p, m, v = w.p, w.exp_avgs, w.exp_avg_sqs
    g = torch._foreach_div(w.g, clip)
    if a.weight_decay != 0 and not a.adam_w_mode:
        torch._foreach_add_(g, p, alpha=a.weight_decay)
    torch._foreach_mul_(m, a.beta1)
    torch._foreach_add_(m, g, alpha=beta3)
    torch._foreach_mul_(v, a.beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - a.beta2)
    # g's memory (fresh, no longer needed) takes the update: no new tensors (on the CPU each is fresh
    # pages to fault in, 4x the time of an in-place pass)
    update = g
    torch._foreach_copy_(update, v)
    torch._foreach_div_(update, bc2)
    torch._foreach_sqrt_(update)
    torch._foreach_add_(update, a.eps)  # sqrt(v / bc2) + eps
    for u, m_i in zip(update, m):
        torch.div(m_i, u, out=u)
    torch._foreach_div_(update, bc1)  # m / bc1 / (sqrt(v / bc2) + eps)
    if a.weight_decay != 0 and a.adam_w_mode:
        torch._foreach_add_(update, p, alpha=a.weight_decay)
    if a.use_nvlamb or a.weight_decay != 0:
        p_norms, u_norms = torch.stack(torch._foreach_norm(p)), torch.stack(torch._foreach_norm(update))
        ratios = torch.where((p_norms > 0) & (u_norms > 0), p_norms / u_norms, torch.ones_like(p_norms))
        torch._foreach_mul_(update, list(ratios.unbind()))
    _sub_scaled_(p, update, lr)
    w.finish()


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
    _commit_all([a.exp_avg_sq_norms], [v], skip)
    beta3 = 1 - a.beta1 if a.grad_averaging else 1.0
    w = _Work(a, "exp_avgs")
    p, m = w.p, w.exp_avgs
    denom = (v / bc2).sqrt() + a.eps  # one per tensor
    g = torch._foreach_div(w.g, list(denom.unbind()))
    if a.weight_decay != 0 and a.reg_inside_moment:
        torch._foreach_add_(g, p, alpha=a.weight_decay)
    torch._foreach_mul_(m, a.beta1)
    torch._foreach_add_(m, g, alpha=beta3)
    update = g  # its memory: no new tensors (fresh pages on the CPU)
    torch._foreach_copy_(update, m)
    torch._foreach_div_(update, bc1)
    if a.weight_decay != 0 and not a.reg_inside_moment:
        torch._foreach_add_(update, p, alpha=a.weight_decay)
    _sub_scaled_(p, update, lr)
    w.finish()
