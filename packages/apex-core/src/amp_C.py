"""Upstream Apex's ``amp_C`` extension module, on our ops (so it also runs on the CPU).

Every function takes upstream's ``(chunk_size, noop_flag, tensor_lists, *args)`` and is meant to be
called through :func:`apex.multi_tensor_apply.multi_tensor_applier`::

    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier
    multi_tensor_applier(amp_C.multi_tensor_scale, noop_flag, [grads, grads], 1.0 / scale)

``noop_flag`` is a one-element int32 tensor on the tensors' device. The functions that check for
overflow set it to 1 (without a host sync); those that upstream skips when it is set
(``multi_tensor_sgd``, ``multi_tensor_adam_capturable*``, ``multi_tensor_lamb_mp``,
``multi_tensor_l2norm_mp``) write nothing then. The scale, axpby, norm and split-LAMB functions are
apex-core's; the optimizer kernels (adam, sgd, adagrad, novograd, lamb) are apex-optimizers' ops,
looked up on first call (``pip install apex-optimizers``). Optimizer state of another dtype than
float32 (upstream lets moments share the parameters' dtype) is updated through float32 copies,
as upstream computes in float32. Differences from upstream, on purpose:

- ``multi_tensor_l2norm_mp`` returns zeros when the flag is set (upstream leaves them uninitialised);
- ``multi_tensor_lamb`` / ``multi_tensor_lamb_mp`` with ``max_grad_norm <= 0`` do not clip
  (upstream divides by it);
- ``multi_tensor_sgd`` with ``nesterov`` needs ``momentum > 0`` and ``dampening == 0`` (as torch's SGD).
"""

from __future__ import annotations

import torch

from apex.core import _ops

FLOAT32 = torch.float32
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _lists(op: str, tensor_lists, depths: tuple[int, ...]):
    if len(tensor_lists) not in depths:
        expected = " or ".join(str(d) for d in depths)
        raise ValueError(f"{op}: tensor_lists must hold {expected} lists, got {len(tensor_lists)}")
    return [list(lst) for lst in tensor_lists]


def _optimizer_ops(op: str):
    """apex-optimizers' ops (``torch.ops.apex_optimizers``), registered by importing the package."""
    try:
        import apex.optimizers._ops  # noqa: F401  (registers torch.ops.apex_optimizers.*)
    except ImportError as exc:
        raise ImportError(
            f"amp_C.{op} runs apex-optimizers' kernel, which is not installed: pip install apex-optimizers"
        ) from exc
    return torch.ops.apex_optimizers


def _usable(tensors, dtypes=(FLOAT32,)):
    """The tensors, or float32 copies of those whose dtype is not in ``dtypes``; see :func:`_write_back`."""
    return [t if t.dtype in dtypes else t.float() for t in tensors]


def _write_back(originals, used) -> None:
    for t, u in zip(originals, used):
        if u is not t:
            t.copy_(u)


def _flag_nonfinite(noop_flag, total) -> None:
    noop_flag.masked_fill_(~torch.isfinite(total).reshape(noop_flag.shape), 1)


def _skip(noop_flag):
    """found_inf for the optimizer ops: set (the step is skipped) when noop_flag is."""
    return noop_flag.reshape(1).to(FLOAT32)


def _commit(target, new, skip) -> None:
    """Write ``new`` into ``target`` unless the device bool ``skip`` is set."""
    new = new.reshape(target.shape).to(target.dtype)
    target.copy_(new if skip is None else torch.where(skip, target, new))


# scale, axpby, norms ------------------------------------------------------------------------


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``out = in * scale`` for ``tensor_lists = [inputs, outputs]``; ``scale`` a float or a 1-element fp32 tensor.

    Sets the flag when an input is not finite."""
    inputs, outputs = _lists("multi_tensor_scale", tensor_lists, (2,))
    if isinstance(scale, torch.Tensor):
        return _ops.multi_tensor_scale(chunk_size, noop_flag, inputs, outputs, 1.0, scale)
    return _ops.multi_tensor_scale(chunk_size, noop_flag, inputs, outputs, float(scale))


def multi_tensor_axpby(chunk_size, noop_flag, tensor_lists, a, b, arg_to_check):
    """``out = a * x + b * y`` for ``tensor_lists = [x, y, out]``; checks x (0), y (1) or both (-1) for inf/nan."""
    x, y, out = _lists("multi_tensor_axpby", tensor_lists, (3,))
    return _ops.multi_tensor_axpby(chunk_size, noop_flag, x, y, out, float(a), float(b), int(arg_to_check))


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """``(total_norm[1], per_tensor_norms[n or 0])`` in fp32 for ``tensor_lists = [inputs]``.

    Sets the flag when the norm is not finite."""
    (inputs,) = _lists("multi_tensor_l2norm", tensor_lists, (1,))
    total, per = _ops.multi_tensor_l2norm(chunk_size, noop_flag, inputs, bool(per_tensor))
    _flag_nonfinite(noop_flag, total)
    return total, per


def multi_tensor_l2norm_mp(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """:func:`multi_tensor_l2norm`, except that it computes nothing (zeros) when the flag is already set."""
    (inputs,) = _lists("multi_tensor_l2norm_mp", tensor_lists, (1,))
    skip = noop_flag.reshape(()) != 0
    total, per = _ops.multi_tensor_l2norm(chunk_size, noop_flag, inputs, bool(per_tensor))
    total = torch.where(skip, torch.zeros_like(total), total)
    per = torch.where(skip, torch.zeros_like(per), per)
    _flag_nonfinite(noop_flag, total)
    return total, per


def multi_tensor_l2norm_scale(chunk_size, noop_flag, tensor_lists, scale, per_tensor=False):
    """The norm of ``inputs`` (as :func:`multi_tensor_l2norm`) and ``outputs = inputs * scale``,
    for ``tensor_lists = [inputs, outputs]``; sets the flag on a non-finite input."""
    inputs, outputs = _lists("multi_tensor_l2norm_scale", tensor_lists, (2,))
    result = multi_tensor_l2norm(chunk_size, noop_flag, [inputs], per_tensor)
    _ops.multi_tensor_scale(chunk_size, noop_flag, inputs, outputs, float(scale))
    return result


def multi_tensor_unscale_l2norm(chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor=False):
    """Norm of ``inputs * inv_scale`` (``inputs`` unchanged); with ``tensor_lists = [inputs, outputs]``
    also writes the unscaled values. Sets the flag when a value is not finite."""
    lists = _lists("multi_tensor_unscale_l2norm", tensor_lists, (1, 2))
    outputs = lists[1] if len(lists) == 2 else []
    return _ops.multi_tensor_unscale_l2norm(chunk_size, noop_flag, lists[0], outputs, inv_scale, bool(per_tensor))


def update_scale_hysteresis(
    current_scale,
    growth_tracker,
    hysteresis_tracker,
    found_inf,
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
):
    """Megatron-style dynamic loss-scale update with hysteresis, on the device (in place); returns
    ``current_scale``. ``growth_factor`` 1.0 keeps the scale from growing."""
    _ops.update_scale_hysteresis(
        current_scale,
        growth_tracker,
        hysteresis_tracker,
        found_inf,
        float(growth_factor),
        float(backoff_factor),
        int(growth_interval),
        int(hysteresis),
    )
    return current_scale


# adam ---------------------------------------------------------------------------------------


def multi_tensor_adam(
    chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay
):
    """Adam on ``[grads, params, exp_avgs, exp_avg_sqs]``; ``mode`` 0 is L2 regularisation, 1 AdamW.

    Ignores the flag (infs and NaNs propagate, as upstream's); params fp64, fp32, fp16 or bf16."""
    g, p, m, v = _lists("multi_tensor_adam", tensor_lists, (4,))
    ops = _optimizer_ops("multi_tensor_adam")
    pu, gu, mu, vu = _usable(p, _KERNEL_DTYPES), _usable(g, _KERNEL_DTYPES), _usable(m), _usable(v)
    ops.fused_adam(
        chunk_size,
        pu,
        gu,
        mu,
        vu,
        [],
        float(lr),
        int(step),
        float(beta1),
        float(beta2),
        float(epsilon),
        float(weight_decay),
        int(mode) == 1,
        bool(bias_correction),
    )
    for originals, used in ((p, pu), (m, mu), (v, vu)):
        _write_back(originals, used)


def _adam_capturable(
    op, noop_flag, chunk_size, lists, lr, beta1, beta2, epsilon, step, mode, bias_correction, wd, inv_scale
):
    g, p, m, v = lists[:4]
    master = lists[4] if len(lists) == 5 else []
    ops = _optimizer_ops(op)
    skip = noop_flag.reshape(()) != 0
    source = master or p
    # upstream writes the unscaled gradient back (with the L2 term added in mode 0)
    unscaled = [gi.float() * inv_scale.reshape(()) for gi in g]
    if int(mode) == 0 and wd != 0:
        written = [u + wd * s.float().reshape(u.shape) for u, s in zip(unscaled, source)]
    else:
        written = unscaled
    pu, mu, vu = _usable(p, _KERNEL_DTYPES), _usable(m), _usable(v)
    masters = _usable(master)
    ops.fused_adam(
        chunk_size,
        pu,
        unscaled,
        mu,
        vu,
        masters,
        1.0,
        1,
        float(beta1),
        float(beta2),
        float(epsilon),
        float(wd),
        int(mode) == 1,
        bool(bias_correction),
        lr.reshape(1).to(FLOAT32),
        step.reshape(1).to(FLOAT32),
        None,
        _skip(noop_flag),
    )
    for gi, w in zip(g, written):
        _commit(gi, w, skip)
    for originals, used in ((p, pu), (m, mu), (v, vu), (master, masters)):
        _write_back(originals, used)


def multi_tensor_adam_capturable(
    chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay, inv_scale
):
    """Adam on ``[grads, params, exp_avgs, exp_avg_sqs]`` with ``lr`` (fp32), ``step`` (int32) and
    ``inv_scale`` (fp32) one-element device tensors: CUDA-graph safe. Gradients are multiplied by
    ``inv_scale`` and written back unscaled; nothing is written when the flag is set."""
    lists = _lists("multi_tensor_adam_capturable", tensor_lists, (4,))
    _adam_capturable(
        "multi_tensor_adam_capturable",
        noop_flag,
        chunk_size,
        lists,
        lr,
        beta1,
        beta2,
        epsilon,
        step,
        mode,
        bias_correction,
        float(weight_decay),
        inv_scale,
    )


def multi_tensor_adam_capturable_master(
    chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay, inv_scale
):
    """:func:`multi_tensor_adam_capturable` on ``[grads, params, exp_avgs, exp_avg_sqs, master_params]``:
    the update is computed on the master copies and the rounded result written to ``params``."""
    lists = _lists("multi_tensor_adam_capturable_master", tensor_lists, (5,))
    _adam_capturable(
        "multi_tensor_adam_capturable_master",
        noop_flag,
        chunk_size,
        lists,
        lr,
        beta1,
        beta2,
        epsilon,
        step,
        mode,
        bias_correction,
        float(weight_decay),
        inv_scale,
    )


# sgd, adagrad, novograd ---------------------------------------------------------------------


def multi_tensor_sgd(
    chunk_size, noop_flag, tensor_lists, wd, momentum, dampening, lr, nesterov, first_run, wd_after_momentum, scale
):
    """SGD on ``[grads, weights, momentum_buffers]`` or ``[grads, fp32 weights, momentum_buffers,
    fp16 weight copies]`` (the copies get the updated weights). Gradients are multiplied by
    ``scale``; nothing is written when the flag is set."""
    lists = _lists("multi_tensor_sgd", tensor_lists, (3, 4))
    g, w, mom = lists[:3]
    ops = _optimizer_ops("multi_tensor_sgd")
    grads = [gi.float() * float(scale) for gi in g] if float(scale) != 1.0 else _usable(g, _KERNEL_DTYPES)
    if len(lists) == 4:  # the fp32 weights are the master copies of the fp16 ones
        params, masters = lists[3], _usable(w)
    else:
        params, masters = _usable(w, _KERNEL_DTYPES), []
    buffers = _usable(mom) if float(momentum) != 0 else []
    ops.fused_sgd(
        chunk_size,
        params,
        grads,
        buffers,
        masters,
        float(lr),
        float(wd),
        float(momentum),
        float(dampening),
        bool(nesterov),
        bool(first_run),
        bool(wd_after_momentum),
        None,
        None,
        _skip(noop_flag),
    )
    _write_back(w, masters if len(lists) == 4 else params)
    _write_back(mom, buffers)


def multi_tensor_adagrad(chunk_size, noop_flag, tensor_lists, lr, epsilon, mode, weight_decay):
    """Adagrad on ``[grads, params, state_sums]``; ``mode`` 0 adds the L2 term to the gradient, 1
    decouples the weight decay. Ignores the flag; fp64, fp32 or fp16."""
    g, p, h = _lists("multi_tensor_adagrad", tensor_lists, (3,))
    ops = _optimizer_ops("multi_tensor_adagrad")
    pu, gu, hu = _usable(p, _KERNEL_DTYPES), _usable(g, _KERNEL_DTYPES), _usable(h)
    ops.fused_adagrad(chunk_size, pu, gu, hu, [], float(lr), float(epsilon), float(weight_decay), int(mode) == 1)
    _write_back(p, pu)
    _write_back(h, hu)


def _blend_norms(chunk_size, grads, grad_norms, beta2, norm_type):
    """Upstream's in-place blend of the per-tensor gradient norms (L2 for norm_type 2, max-abs for 0)."""
    if norm_type == 0:
        new = torch.stack([gi.float().abs().amax() if gi.numel() else gi.new_zeros((), dtype=FLOAT32) for gi in grads])
        blended = beta2 * grad_norms + (1 - beta2) * new
    else:
        noop = torch.zeros(1, dtype=torch.int32, device=grad_norms.device)
        _, new = _ops.multi_tensor_l2norm(chunk_size, noop, grads, True)
        blended = (beta2 * grad_norms * grad_norms + (1 - beta2) * new * new).sqrt()
    grad_norms.copy_(blended)


def multi_tensor_novograd(
    chunk_size,
    noop_flag,
    tensor_lists,
    grad_norms,
    lr,
    beta1,
    beta2,
    epsilon,
    step,
    bias_correction,
    weight_decay,
    grad_averaging,
    mode,
    norm_type,
):
    """NovoGrad on ``[grads, params, exp_avgs]``. First blends ``grad_norms`` (fp32, one per tensor)
    in place with the gradients' norms (``norm_type`` 2: L2, 0: max-abs), then updates: ``mode`` 0
    normalises the gradient and adds the weight decay inside the moment, mode 1 normalises the
    moment and decouples the weight decay. Ignores the flag."""
    g, p, m = _lists("multi_tensor_novograd", tensor_lists, (3,))
    beta1, beta2, epsilon, lr, wd = float(beta1), float(beta2), float(epsilon), float(lr), float(weight_decay)
    _blend_norms(chunk_size, g, grad_norms, beta2, int(norm_type))
    if int(mode) == 0:  # apex-optimizers' fused_novograd with the weight decay inside the moment
        ops = _optimizer_ops("multi_tensor_novograd")
        pu, gu, mu = _usable(p, _KERNEL_DTYPES), _usable(g, _KERNEL_DTYPES), _usable(m)
        # init_zero with exp_avg_sq_norms = n^2 and grad_norms = n: the op's second moment is n^2
        ops.fused_novograd(
            chunk_size,
            pu,
            gu,
            mu,
            grad_norms * grad_norms,
            grad_norms.clone(),
            [],
            lr,
            int(step),
            beta1,
            beta2,
            epsilon,
            wd,
            bool(bias_correction),
            bool(grad_averaging),
            True,
            True,
        )
        _write_back(p, pu)
        _write_back(m, mu)
        return
    # mode 1 keeps the raw gradient in the moment, which apex-optimizers' op does not: torch ops
    bc1, bc2 = (1 - beta1 ** int(step), (1 - beta2 ** int(step)) ** 0.5) if bias_correction else (1.0, 1.0)
    beta3 = 1 - beta1 if grad_averaging else 1.0
    for i, (gi, pi, mi) in enumerate(zip(g, p, m)):
        pf = pi.float()
        new_m = beta1 * mi.float() + beta3 * gi.float().reshape(mi.shape)
        update = (new_m / bc1) / (grad_norms[i] / bc2 + epsilon) + wd * pf
        mi.copy_(new_m)
        pi.copy_(pf - lr * update)


# lamb ---------------------------------------------------------------------------------------


def _lamb_update_into_grads(g, source_before, m, v, beta1, beta2, epsilon, step, bias_correction, mode, wd, skip):
    """Upstream leaves the LAMB update (before the trust ratio) in the gradients."""
    step = step.reshape(()).to(FLOAT32) if isinstance(step, torch.Tensor) else float(step)
    bc1, bc2 = (1 - beta1**step, 1 - beta2**step) if bias_correction else (1.0, 1.0)
    for i, gi in enumerate(g):
        update = (m[i].float() / bc1) / ((v[i].float() / bc2).sqrt() + epsilon)
        if mode == 1 and wd != 0:
            update = update + wd * source_before[i]
        _commit(gi, update, skip)


def multi_tensor_lamb(
    chunk_size,
    noop_flag,
    tensor_lists,
    lr,
    beta1,
    beta2,
    epsilon,
    step,
    bias_correction,
    weight_decay,
    grad_averaging,
    mode,
    global_grad_norm,
    max_grad_norm,
    use_nvlamb=False,
):
    """LAMB on ``[grads, params, exp_avgs, exp_avg_sqs]`` (fp32 or fp16). Gradients are divided by
    ``global_grad_norm / max_grad_norm`` when that exceeds 1; the trust ratio applies when
    ``use_nvlamb`` or ``weight_decay != 0``; the update is left in ``grads``. Ignores the flag."""
    g, p, m, v = _lists("multi_tensor_lamb", tensor_lists, (4,))
    ops = _optimizer_ops("multi_tensor_lamb")
    beta1, beta2, epsilon, wd, mode = float(beta1), float(beta2), float(epsilon), float(weight_decay), int(mode)
    before = [pi.float().clone() for pi in p] if mode == 1 and wd != 0 else []
    clip = _ops_clip_ratio(global_grad_norm, float(max_grad_norm))
    grads = [gi.float() / clip for gi in g]
    pu, mu, vu = _usable(p, _KERNEL_DTYPES), _usable(m), _usable(v)
    hyper = (beta1, beta2, epsilon, wd, mode == 1, bool(bias_correction), bool(grad_averaging), bool(use_nvlamb))
    _fused_lamb(ops, chunk_size, pu, grads, mu, vu, [], float(lr), int(step), hyper, clip.device)
    for originals, used in ((p, pu), (m, mu), (v, vu)):
        _write_back(originals, used)
    _lamb_update_into_grads(g, before, mu, vu, beta1, beta2, epsilon, step, bias_correction, mode, wd, None)


def _fused_lamb(ops, chunk_size, params, grads, mu, vu, masters, lr, step, hyper, device, device_scalars=()):
    """apex-optimizers' fused_lamb without its own clipping (the gradients come clipped): ``hyper``
    is (beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, grad_averaging, use_nvlamb)."""
    beta1, beta2, epsilon, wd, adam_w_mode, bias_correction, grad_averaging, use_nvlamb = hyper
    ones = torch.ones(1, dtype=FLOAT32, device=device)  # the op's global_grad_norm: no clipping there
    ops.fused_lamb(
        chunk_size,
        params,
        grads,
        mu,
        vu,
        masters,
        ones,
        lr,
        step,
        beta1,
        beta2,
        epsilon,
        wd,
        adam_w_mode,
        bias_correction,
        grad_averaging,
        0.0,
        use_nvlamb,
        *device_scalars,
    )


def _ops_clip_ratio(global_grad_norm, max_grad_norm):
    """The divisor of the gradients, on the device: ||g|| / max when that exceeds 1 (and max > 0)."""
    norm = global_grad_norm.reshape(()).to(FLOAT32)
    max_norm = torch.as_tensor(max_grad_norm, dtype=FLOAT32, device=norm.device).reshape(())
    ratio = norm / torch.where(max_norm > 0, max_norm, torch.ones_like(max_norm))
    return torch.where((max_norm > 0) & (norm > max_norm), ratio, torch.ones_like(norm))


def multi_tensor_lamb_mp(
    chunk_size,
    noop_flag,
    tensor_lists,
    lr,
    beta1,
    beta2,
    epsilon,
    step,
    bias_correction,
    weight_decay,
    grad_averaging,
    mode,
    global_grad_norm,
    max_grad_norm,
    use_nvlamb,
    found_inf,
    inv_scale,
):
    """LAMB with device-side ``lr`` (fp32), ``step`` (int32), ``max_grad_norm`` and ``inv_scale``
    (fp32) on ``[grads, fp32 params, exp_avgs, exp_avg_sqs]`` or ``[grads, fp32 master params,
    exp_avgs, exp_avg_sqs, low-precision params]``. Gradients are multiplied by ``inv_scale``;
    nothing is written when the flag is set (``found_inf`` is not read, as upstream's)."""
    lists = _lists("multi_tensor_lamb_mp", tensor_lists, (4, 5))
    g, p32, m, v = lists[:4]
    ops = _optimizer_ops("multi_tensor_lamb_mp")
    beta1, beta2, epsilon, wd, mode = float(beta1), float(beta2), float(epsilon), float(weight_decay), int(mode)
    skip = noop_flag.reshape(()) != 0
    before = [pi.float().clone() for pi in p32] if mode == 1 and wd != 0 else []
    clip = _ops_clip_ratio(global_grad_norm, max_grad_norm)
    grads = [gi.float() * inv_scale.reshape(()) / clip for gi in g]
    if len(lists) == 5:
        params, masters = lists[4], _usable(p32)
    else:
        params, masters = _usable(p32, _KERNEL_DTYPES), []
    mu, vu = _usable(m), _usable(v)
    hyper = (beta1, beta2, epsilon, wd, mode == 1, bool(bias_correction), bool(grad_averaging), bool(use_nvlamb))
    device_scalars = (lr.reshape(1).to(FLOAT32), step.reshape(1).to(FLOAT32), None, _skip(noop_flag))
    _fused_lamb(ops, chunk_size, params, grads, mu, vu, masters, 1.0, 1, hyper, clip.device, device_scalars)
    _write_back(p32, masters if len(lists) == 5 else params)
    _write_back(m, mu)
    _write_back(v, vu)
    _lamb_update_into_grads(g, before, mu, vu, beta1, beta2, epsilon, step, bias_correction, mode, wd, skip)


def multi_tensor_lamb_stage1_cuda(
    chunk_size,
    noop_flag,
    tensor_lists,
    per_tensor_decay,
    step,
    beta1,
    beta2,
    epsilon,
    global_grad_norm,
    max_global_grad_norm,
):
    """Legacy split LAMB, stage 1, on ``[grads, params, exp_avgs, exp_avg_sqs, updates]``: updates the
    moments and writes ``m_hat / (sqrt(v_hat) + eps) + per_tensor_decay[i] * p`` into ``updates``.
    As upstream's, the bias corrections are for ``step + 1`` and the flag is ignored."""
    g, p, m, v, updates = _lists("multi_tensor_lamb_stage1_cuda", tensor_lists, (5,))
    beta1, beta2, epsilon = float(beta1), float(beta2), float(epsilon)
    bc1, bc2 = 1 - beta1 ** (int(step) + 1), 1 - beta2 ** (int(step) + 1)
    if not g:
        return
    clip = _ops_clip_ratio(global_grad_norm, float(max_global_grad_norm))
    for i, (gi, pi, mi, vi, ui) in enumerate(zip(g, p, m, v, updates)):
        gf = gi.float().reshape(mi.shape) / clip
        new_m = beta1 * mi.float() + (1 - beta1) * gf
        new_v = beta2 * vi.float() + (1 - beta2) * gf * gf
        update = (new_m / bc1) / ((new_v / bc2).sqrt() + epsilon) + per_tensor_decay[i] * pi.float().reshape(mi.shape)
        mi.copy_(new_m)
        vi.copy_(new_v)
        ui.copy_(update.reshape(ui.shape))


def multi_tensor_lamb_stage2_cuda(
    chunk_size,
    noop_flag,
    tensor_lists,
    per_tensor_param_norm,
    per_tensor_update_norm,
    lr,
    weight_decay,
    use_nvlamb=False,
):
    """Legacy split LAMB, stage 2, on ``[params, updates]``: ``p -= ratio * update`` with
    ``ratio = lr * ||p|| / ||update||`` (``lr`` when a norm is 0) where ``use_nvlamb`` or
    ``weight_decay != 0``, else ``lr``. Ignores the flag."""
    p, updates = _lists("multi_tensor_lamb_stage2_cuda", tensor_lists, (2,))
    lr = float(lr)
    trust = bool(use_nvlamb) or float(weight_decay) != 0
    for i, (pi, ui) in enumerate(zip(p, updates)):
        ratio = lr
        if trust:
            pn, un = per_tensor_param_norm[i].float(), per_tensor_update_norm[i].float()
            ratio = torch.where((pn != 0) & (un != 0), lr * pn / un, torch.full_like(pn, lr))
        pi.copy_(pi.float() - ratio * ui.float().reshape(pi.shape))
