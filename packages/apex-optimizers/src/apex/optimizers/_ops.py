"""apex-optimizers' dispatcher ops (namespace ``apex_optimizers``): schemas, references, fakes.

Conventions shared by every op:
- one tensor list per role; ``params``/``grads`` of one dtype each (fp32, fp16 or bf16), all
  optimizer state (moments, sums, momentum buffers, master weights) in fp32;
- ``master_params`` empty, or fp32 copies of ``params``: the update is computed on them and the
  rounded result is written to ``params`` in the same pass;
- ``lr``/``step`` are host numbers unless ``lr_tensor``/``step_tensor`` (fp32, one element, on the
  device) are given, which then win: the step can be captured in a CUDA graph;
- ``grad_scale`` (the loss scale, fp32 one-element tensor): gradients are divided by it;
  ``found_inf`` (fp32 one-element tensor): when non-zero nothing is written (the step is skipped
  without a host sync), as ``torch.amp.GradScaler`` expects of fused optimizers;
- arithmetic in fp32.
The references below are the specification the CUDA kernels are tested against.
"""

from __future__ import annotations

import torch

import apex.core  # noqa: F401  (registers apex_core's norms, used by LAMB and NovoGrad)
from apex.core import checks
from apex.core.library import define
from apex.optimizers._plugin import KERNELS

FP32 = (torch.float32,)


# shared checks and helpers ----------------------------------------------------------------


def _check_common(op, params, grads, states: dict, master_params, optional: dict):
    lists = {"params": params, "grads": grads, **states}
    checks.same_lengths(op, **lists)
    device = checks.tensor_list(op, "params", params, None)
    checks.tensor_list(op, "grads", grads, device)
    for name, tensors in states.items():
        checks.tensor_list(op, name, tensors, device, dtypes=FP32)
    if master_params:
        checks.same_lengths(op, params=params, master_params=master_params)
        checks.tensor_list(op, "master_params", master_params, device, dtypes=FP32)
    for name, tensors in [("grads", grads), *states.items(), ("master_params", master_params or [])]:
        for i, (p, t) in enumerate(zip(params, tensors)):
            if t.numel() != p.numel():
                raise ValueError(f"{op}: {name}[{i}] has {t.numel()} elements but params[{i}] has {p.numel()}")
    for name, t in optional.items():
        if t is not None:
            checks.scalar_tensor(op, name, t, FP32, device)
    return device


def _optional(lr_tensor=None, step_tensor=None, grad_scale=None, found_inf=None):
    return {"lr_tensor": lr_tensor, "step_tensor": step_tensor, "grad_scale": grad_scale, "found_inf": found_inf}


def _lr_step(lr, step, lr_tensor, step_tensor):
    lr_value = lr_tensor.reshape(()) if lr_tensor is not None else lr
    step_value = step_tensor.reshape(()) if step_tensor is not None else float(step)
    return lr_value, step_value


def _grad(g, grad_scale):
    gf = g.float()
    return gf / grad_scale.reshape(()) if grad_scale is not None else gf


def _commit(target: torch.Tensor, new: torch.Tensor, skip):
    """Write ``new`` into ``target`` unless ``skip`` (a device bool) is set."""
    new = new.reshape(target.shape).to(target.dtype)
    if skip is None:
        target.copy_(new)
    else:
        target.copy_(torch.where(skip, target, new))


def _skip(found_inf):
    return None if found_inf is None else found_inf.reshape(()) != 0


def _write_params(params, master_params, i, new, skip):
    if master_params:
        _commit(master_params[i], new, skip)
    _commit(params[i], new, skip)


def _current(params, master_params, i):
    return (master_params[i] if master_params else params[i]).float()


def _bias_corrections(beta1, beta2, step, bias_correction):
    if not bias_correction:
        return 1.0, 1.0
    return 1.0 - beta1**step, 1.0 - beta2**step


# fused_adam -------------------------------------------------------------------------------

ADAM_SCHEMA = (
    "fused_adam(int chunk_size, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] master_params, float lr, int step, float beta1, float beta2, "
    "float eps, float weight_decay, bool adam_w_mode, bool bias_correction, Tensor? lr_tensor=None, "
    "Tensor? step_tensor=None, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()"
)


def _check_adam(
    chunk_size,
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    master_params,
    lr,
    step,
    beta1,
    beta2,
    eps,
    weight_decay,
    adam_w_mode,
    bias_correction,
    lr_tensor=None,
    step_tensor=None,
    grad_scale=None,
    found_inf=None,
):
    checks.positive_chunk_size("fused_adam", chunk_size)
    _check_common(
        "fused_adam",
        params,
        grads,
        {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs},
        master_params,
        _optional(lr_tensor, step_tensor, grad_scale, found_inf),
    )
    if step_tensor is None and step < 1 and bias_correction:
        raise ValueError(f"fused_adam: step must be >= 1 with bias_correction, got {step}")


def _adam_reference(
    chunk_size,
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    master_params,
    lr,
    step,
    beta1,
    beta2,
    eps,
    weight_decay,
    adam_w_mode,
    bias_correction,
    lr_tensor=None,
    step_tensor=None,
    grad_scale=None,
    found_inf=None,
):
    _check_adam(
        chunk_size,
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        master_params,
        lr,
        step,
        beta1,
        beta2,
        eps,
        weight_decay,
        adam_w_mode,
        bias_correction,
        lr_tensor,
        step_tensor,
        grad_scale,
        found_inf,
    )
    lr_value, step_value = _lr_step(lr, step, lr_tensor, step_tensor)
    bc1, bc2 = _bias_corrections(beta1, beta2, step_value, bias_correction)
    skip = _skip(found_inf)
    for i in range(len(params)):
        p = _current(params, master_params, i)
        g = _grad(grads[i], grad_scale).reshape(p.shape)
        if weight_decay != 0:
            if adam_w_mode:
                p = p * (1 - lr_value * weight_decay)
            else:
                g = g + weight_decay * p
        m = exp_avgs[i] * beta1 + g * (1 - beta1)
        v = exp_avg_sqs[i] * beta2 + g * g * (1 - beta2)
        denom = v.sqrt() / bc2**0.5 + eps
        p = p - (lr_value / bc1) * m / denom
        _commit(exp_avgs[i], m, skip)
        _commit(exp_avg_sqs[i], v, skip)
        _write_params(params, master_params, i, p, skip)


fused_adam = define(KERNELS, ADAM_SCHEMA, _adam_reference, _check_adam)


# fused_sgd --------------------------------------------------------------------------------

SGD_SCHEMA = (
    "fused_sgd(int chunk_size, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
    "Tensor(c!)[] master_params, float lr, float weight_decay, float momentum, float dampening, bool nesterov, "
    "bool first_run, bool wd_after_momentum, Tensor? lr_tensor=None, Tensor? grad_scale=None, "
    "Tensor? found_inf=None) -> ()"
)


def _check_sgd(
    chunk_size,
    params,
    grads,
    momentum_buffers,
    master_params,
    lr,
    weight_decay,
    momentum,
    dampening,
    nesterov,
    first_run,
    wd_after_momentum,
    lr_tensor=None,
    grad_scale=None,
    found_inf=None,
):
    op = "fused_sgd"
    checks.positive_chunk_size(op, chunk_size)
    states = {"momentum_buffers": momentum_buffers} if momentum != 0 else {}
    if momentum == 0 and momentum_buffers:
        raise ValueError(f"{op}: momentum_buffers must be empty when momentum is 0")
    _check_common(op, params, grads, states, master_params, _optional(lr_tensor, None, grad_scale, found_inf))
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"{op}: nesterov needs momentum > 0 and dampening 0")


def _sgd_reference(
    chunk_size,
    params,
    grads,
    momentum_buffers,
    master_params,
    lr,
    weight_decay,
    momentum,
    dampening,
    nesterov,
    first_run,
    wd_after_momentum,
    lr_tensor=None,
    grad_scale=None,
    found_inf=None,
):
    _check_sgd(
        chunk_size,
        params,
        grads,
        momentum_buffers,
        master_params,
        lr,
        weight_decay,
        momentum,
        dampening,
        nesterov,
        first_run,
        wd_after_momentum,
        lr_tensor,
        grad_scale,
        found_inf,
    )
    lr_value = lr_tensor.reshape(()) if lr_tensor is not None else lr
    skip = _skip(found_inf)
    for i in range(len(params)):
        p = _current(params, master_params, i)
        g = _grad(grads[i], grad_scale).reshape(p.shape)
        if weight_decay != 0 and not wd_after_momentum:
            g = g + weight_decay * p
        if momentum != 0:
            buf = g if first_run else momentum_buffers[i] * momentum + g * (1 - dampening)
            _commit(momentum_buffers[i], buf, skip)
            g = g + momentum * buf if nesterov else buf
        if weight_decay != 0 and wd_after_momentum:
            g = g + weight_decay * p
        _write_params(params, master_params, i, p - lr_value * g, skip)


fused_sgd = define(KERNELS, SGD_SCHEMA, _sgd_reference, _check_sgd)


# fused_adagrad ----------------------------------------------------------------------------

ADAGRAD_SCHEMA = (
    "fused_adagrad(int chunk_size, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] state_sums, "
    "Tensor(c!)[] master_params, float lr, float eps, float weight_decay, bool adagrad_w_mode, "
    "Tensor? lr_tensor=None, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()"
)


def _check_adagrad(
    chunk_size,
    params,
    grads,
    state_sums,
    master_params,
    lr,
    eps,
    weight_decay,
    adagrad_w_mode,
    lr_tensor=None,
    grad_scale=None,
    found_inf=None,
):
    checks.positive_chunk_size("fused_adagrad", chunk_size)
    _check_common(
        "fused_adagrad",
        params,
        grads,
        {"state_sums": state_sums},
        master_params,
        _optional(lr_tensor, None, grad_scale, found_inf),
    )


def _adagrad_reference(
    chunk_size,
    params,
    grads,
    state_sums,
    master_params,
    lr,
    eps,
    weight_decay,
    adagrad_w_mode,
    lr_tensor=None,
    grad_scale=None,
    found_inf=None,
):
    _check_adagrad(
        chunk_size,
        params,
        grads,
        state_sums,
        master_params,
        lr,
        eps,
        weight_decay,
        adagrad_w_mode,
        lr_tensor,
        grad_scale,
        found_inf,
    )
    lr_value = lr_tensor.reshape(()) if lr_tensor is not None else lr
    skip = _skip(found_inf)
    for i in range(len(params)):
        p = _current(params, master_params, i)
        g = _grad(grads[i], grad_scale).reshape(p.shape)
        if weight_decay != 0 and not adagrad_w_mode:
            g = g + weight_decay * p
        h = state_sums[i] + g * g
        update = g / (h.sqrt() + eps)
        if weight_decay != 0 and adagrad_w_mode:
            update = update + weight_decay * p
        _commit(state_sums[i], h, skip)
        _write_params(params, master_params, i, p - lr_value * update, skip)


fused_adagrad = define(KERNELS, ADAGRAD_SCHEMA, _adagrad_reference, _check_adagrad)


# fused_lamb -------------------------------------------------------------------------------

LAMB_SCHEMA = (
    "fused_lamb(int chunk_size, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] master_params, Tensor global_grad_norm, float lr, int step, "
    "float beta1, float beta2, float eps, float weight_decay, bool adam_w_mode, bool bias_correction, "
    "bool grad_averaging, float max_grad_norm, bool use_nvlamb, Tensor? lr_tensor=None, "
    "Tensor? step_tensor=None, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()"
)


def _check_lamb(
    chunk_size,
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    master_params,
    global_grad_norm,
    lr,
    step,
    beta1,
    beta2,
    eps,
    weight_decay,
    adam_w_mode,
    bias_correction,
    grad_averaging,
    max_grad_norm,
    use_nvlamb,
    lr_tensor=None,
    step_tensor=None,
    grad_scale=None,
    found_inf=None,
):
    op = "fused_lamb"
    checks.positive_chunk_size(op, chunk_size)
    device = _check_common(
        op,
        params,
        grads,
        {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs},
        master_params,
        _optional(lr_tensor, step_tensor, grad_scale, found_inf),
    )
    if params:
        checks.scalar_tensor(op, "global_grad_norm", global_grad_norm, FP32, device)


def lamb_clip_ratio(global_grad_norm, max_grad_norm):
    """Divisor of the gradients: ||g|| / max_grad_norm when that exceeds 1 (and max_grad_norm > 0)."""
    norm = global_grad_norm.reshape(())
    if max_grad_norm <= 0:
        return torch.ones_like(norm)
    return torch.where(norm > max_grad_norm, norm / max_grad_norm, torch.ones_like(norm))


def _lamb_reference(
    chunk_size,
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    master_params,
    global_grad_norm,
    lr,
    step,
    beta1,
    beta2,
    eps,
    weight_decay,
    adam_w_mode,
    bias_correction,
    grad_averaging,
    max_grad_norm,
    use_nvlamb,
    lr_tensor=None,
    step_tensor=None,
    grad_scale=None,
    found_inf=None,
):
    _check_lamb(
        chunk_size,
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        master_params,
        global_grad_norm,
        lr,
        step,
        beta1,
        beta2,
        eps,
        weight_decay,
        adam_w_mode,
        bias_correction,
        grad_averaging,
        max_grad_norm,
        use_nvlamb,
        lr_tensor,
        step_tensor,
        grad_scale,
        found_inf,
    )
    if not params:
        return
    lr_value, step_value = _lr_step(lr, step, lr_tensor, step_tensor)
    bc1, bc2 = _bias_corrections(beta1, beta2, step_value, bias_correction)
    clip = lamb_clip_ratio(global_grad_norm, max_grad_norm)
    beta3 = 1 - beta1 if grad_averaging else 1.0
    skip = _skip(found_inf)
    for i in range(len(params)):
        p = _current(params, master_params, i)
        g = _grad(grads[i], grad_scale).reshape(p.shape) / clip
        if weight_decay != 0 and not adam_w_mode:
            g = g + weight_decay * p
        m = exp_avgs[i] * beta1 + g * beta3
        v = exp_avg_sqs[i] * beta2 + g * g * (1 - beta2)
        update = (m / bc1) / ((v / bc2).sqrt() + eps)
        if weight_decay != 0 and adam_w_mode:
            update = update + weight_decay * p
        if use_nvlamb or weight_decay != 0:
            p_norm, u_norm = p.norm(), update.norm()
            ratio = torch.where((p_norm > 0) & (u_norm > 0), p_norm / u_norm, torch.ones_like(p_norm))
        else:
            ratio = 1.0
        _commit(exp_avgs[i], m, skip)
        _commit(exp_avg_sqs[i], v, skip)
        _write_params(params, master_params, i, p - lr_value * ratio * update, skip)


fused_lamb = define(KERNELS, LAMB_SCHEMA, _lamb_reference, _check_lamb)


# fused_novograd ---------------------------------------------------------------------------

NOVOGRAD_SCHEMA = (
    "fused_novograd(int chunk_size, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!) exp_avg_sq_norms, Tensor grad_norms, Tensor(d!)[] master_params, float lr, int step, float beta1, "
    "float beta2, float eps, float weight_decay, bool bias_correction, bool grad_averaging, "
    "bool reg_inside_moment, bool init_zero, Tensor? lr_tensor=None, Tensor? grad_scale=None, "
    "Tensor? found_inf=None) -> ()"
)


def _check_novograd(
    chunk_size,
    params,
    grads,
    exp_avgs,
    exp_avg_sq_norms,
    grad_norms,
    master_params,
    lr,
    step,
    beta1,
    beta2,
    eps,
    weight_decay,
    bias_correction,
    grad_averaging,
    reg_inside_moment,
    init_zero,
    lr_tensor=None,
    grad_scale=None,
    found_inf=None,
):
    op = "fused_novograd"
    checks.positive_chunk_size(op, chunk_size)
    device = _check_common(
        op, params, grads, {"exp_avgs": exp_avgs}, master_params, _optional(lr_tensor, None, grad_scale, found_inf)
    )
    for name, t in (("exp_avg_sq_norms", exp_avg_sq_norms), ("grad_norms", grad_norms)):
        if t.dtype != torch.float32 or t.dim() != 1 or t.numel() != len(params):
            raise ValueError(
                f"{op}: {name} must be a 1-D float32 tensor of {len(params)} elements (one per "
                f"tensor), got {t.dtype} of shape {tuple(t.shape)}"
            )
        if params and t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, expected {device}")
    if step < 1:
        raise ValueError(f"{op}: step must be >= 1, got {step}")


def _novograd_reference(
    chunk_size,
    params,
    grads,
    exp_avgs,
    exp_avg_sq_norms,
    grad_norms,
    master_params,
    lr,
    step,
    beta1,
    beta2,
    eps,
    weight_decay,
    bias_correction,
    grad_averaging,
    reg_inside_moment,
    init_zero,
    lr_tensor=None,
    grad_scale=None,
    found_inf=None,
):
    _check_novograd(
        chunk_size,
        params,
        grads,
        exp_avgs,
        exp_avg_sq_norms,
        grad_norms,
        master_params,
        lr,
        step,
        beta1,
        beta2,
        eps,
        weight_decay,
        bias_correction,
        grad_averaging,
        reg_inside_moment,
        init_zero,
        lr_tensor,
        grad_scale,
        found_inf,
    )
    if not params:
        return
    lr_value = lr_tensor.reshape(()) if lr_tensor is not None else lr
    bc1, bc2 = _bias_corrections(beta1, beta2, float(step), bias_correction)
    skip = _skip(found_inf)
    # Per-tensor second moment of the gradient norm; the first step takes the norm itself
    # unless init_zero. ``grad_norms`` are of the unscaled gradients.
    norms_sq = grad_norms * grad_norms
    if step == 1 and not init_zero:
        v = norms_sq
    else:
        v = exp_avg_sq_norms * beta2 + norms_sq * (1 - beta2)
    _commit(exp_avg_sq_norms, v, skip)
    beta3 = 1 - beta1 if grad_averaging else 1.0
    for i in range(len(params)):
        p = _current(params, master_params, i)
        g = _grad(grads[i], grad_scale).reshape(p.shape)
        g = g / ((v[i] / bc2).sqrt() + eps)
        if weight_decay != 0 and reg_inside_moment:
            g = g + weight_decay * p
        m = exp_avgs[i] * beta1 + g * beta3
        update = m / bc1
        if weight_decay != 0 and not reg_inside_moment:
            update = update + weight_decay * p
        _commit(exp_avgs[i], m, skip)
        _write_params(params, master_params, i, p - lr_value * update, skip)


fused_novograd = define(KERNELS, NOVOGRAD_SCHEMA, _novograd_reference, _check_novograd)
