"""DistributedFusedAdam's own ops (namespace ``apex_contrib_optimizers``), registered on import.

Adam on flat shards with upstream's ``distributed_adam_cuda`` semantics, for what apex-optimizers'
``fused_adam`` does not take: optimizer state in fp16/bf16, and fp32 master weights kept as bf16
parameters plus 16-bit remainders. The PyTorch references below are the CPU path, the fallback and the
specification; on CUDA the kernels of ``csrc/distributed_adam.cu`` run them in one pass (fp32 subnormals
flush to zero there: the build uses --use_fast_math).

Shared conventions (those of upstream's kernels):
- gradients are *multiplied* by ``grad_scale`` (a one-element fp32 tensor: upstream passes the
  inverse loss scale times any clipping factor);
- ``adam_mode`` (upstream's ``mode``) 0: L2 regularisation (``g += weight_decay * p``); 1: decoupled
  decay (AdamW), applied as ``p -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)``;
- the bias corrections are ``1 - beta ** step`` when ``bias_correction``;
- ``noop_flag`` (int32, one element): when non-zero nothing is written (the step is skipped on the
  device, no host sync). Upstream's non-capturable kernels ignore the flag (their callers pass zero);
- ``lr_tensor``/``step_tensor`` (fp32, one element, on the device) replace ``lr``/``step`` when given;
- arithmetic in fp32.
"""

from __future__ import annotations

import torch

from apex.contrib.optimizers._plugin import KERNELS
from apex.core import checks
from apex.core.library import op

FP32 = (torch.float32,)
ADAM_MODES = (0, 1)


def _check_common(a, *, state_dtypes, per_param: dict) -> None:
    checks.positive_chunk_size(a.op, a.chunk_size)
    checks.same_lengths(a.op, **per_param)
    device = None
    for name, tensors in per_param.items():
        dtypes = {
            "exp_avgs": state_dtypes,
            "exp_avg_sqs": state_dtypes,
            "param_remainders": (torch.int16,),
        }.get(name, checks.FLOAT_DTYPES)
        if name == "params" and a.op.endswith("remainders"):
            dtypes = (torch.bfloat16,)
        if name == "params_out" and a.op.endswith("remainders"):
            dtypes = (torch.bfloat16,)
        device = checks.tensor_list(a.op, name, tensors, device, dtypes=dtypes)
        for i, t in enumerate(tensors):
            if not t.is_contiguous():
                raise ValueError(f"{a.op}: {name}[{i}] is not contiguous; the ops take flat (contiguous) shards")
    first = next(iter(per_param.values()))
    for name, tensors in per_param.items():
        for i, (p, t) in enumerate(zip(first, tensors)):
            if t.numel() != p.numel():
                raise ValueError(f"{a.op}: {name}[{i}] has {t.numel()} elements but params[{i}] has {p.numel()}")
    if a.adam_mode not in ADAM_MODES:
        raise ValueError(f"{a.op}: adam_mode must be 0 (L2) or 1 (decoupled weight decay), got {a.adam_mode}")
    if a.noop_flag.dtype != torch.int32 or a.noop_flag.numel() != 1:
        raise TypeError(
            f"{a.op}: noop_flag must be a one-element int32 tensor, got {a.noop_flag.dtype} "
            f"of shape {tuple(a.noop_flag.shape)}"
        )
    checks.scalar_tensor(a.op, "grad_scale", a.grad_scale, FP32, None)
    for name in ("noop_flag", "grad_scale", "lr_tensor", "step_tensor"):
        t = getattr(a, name, None)
        if name in ("lr_tensor", "step_tensor") and t is not None:
            checks.scalar_tensor(a.op, name, t, FP32, None)
        if t is not None and device is not None and t.device != device:
            raise ValueError(f"{a.op}: {name} is on {t.device}, expected {device} (the device of params)")
    if getattr(a, "step_tensor", None) is None and a.bias_correction and a.step < 1:
        raise ValueError(f"{a.op}: step must be >= 1 with bias_correction, got {a.step}")


def _hyper(a):
    """(lr, bias correction 1, bias correction 2) as numbers or device scalars."""
    lr = a.lr if getattr(a, "lr_tensor", None) is None else a.lr_tensor.reshape(())
    if not a.bias_correction:
        return lr, 1.0, 1.0
    step_tensor = getattr(a, "step_tensor", None)
    step = float(a.step) if step_tensor is None else step_tensor.reshape(())
    return lr, 1.0 - a.beta1**step, 1.0 - a.beta2**step


def adam_update(p, m, v, g, a, lr, bc1, bc2):
    """Upstream's update in fp32; returns the new (p, m, v)."""
    g = g * a.grad_scale.reshape(())
    if a.adam_mode == 0:
        g = g + a.weight_decay * p
    m = torch.lerp(g, m, a.beta1)
    v = torch.lerp(g * g, v, a.beta2)
    update = (m / bc1) / ((v / bc2).sqrt() + a.eps)
    if a.adam_mode == 1:
        update = update + a.weight_decay * p
    return p - lr * update, m, v


def _commit(target: torch.Tensor, new: torch.Tensor, skip: torch.Tensor) -> None:
    target.copy_(torch.where(skip, target, new.to(target.dtype)))


# distributed_adam ---------------------------------------------------------------------------


def _check_distributed_adam(a) -> None:
    per_param = dict(
        params=a.params, exp_avgs=a.exp_avgs, exp_avg_sqs=a.exp_avg_sqs, grads=a.grads, params_out=a.params_out
    )
    _check_common(a, state_dtypes=checks.FLOAT_DTYPES, per_param=per_param)
    for i, (p, m, v) in enumerate(zip(a.params, a.exp_avgs, a.exp_avg_sqs)):
        if not (p.dtype == m.dtype == v.dtype):
            raise TypeError(
                f"{a.op}: params[{i}], exp_avgs[{i}] and exp_avg_sqs[{i}] must share the state dtype, "
                f"got {p.dtype}, {m.dtype}, {v.dtype}"
            )


@op(
    KERNELS,
    "distributed_adam(int chunk_size, Tensor noop_flag, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor[] grads, Tensor(d!)[] params_out, Tensor grad_scale, float lr, "
    "float beta1, float beta2, float eps, int step, int adam_mode, bool bias_correction, float weight_decay, "
    "Tensor? lr_tensor=None, Tensor? step_tensor=None) -> ()",
    check=_check_distributed_adam,
)
def distributed_adam(a):
    """Adam on ``params`` (the master values, in the state dtype: fp32, fp16 or bf16), updated in
    place with ``exp_avgs``/``exp_avg_sqs``; the new value (in the state dtype) is also written to ``params_out``
    (any float dtype: the buffer the parameters are all-gathered from). Upstream's
    ``multi_tensor_fused_adam`` tensor lists ``[p_in, m, v, g, p_out]``; gradients may be of any
    float dtype (upstream: the state dtype only)."""
    lr, bc1, bc2 = _hyper(a)
    skip = a.noop_flag.reshape(()) != 0
    for p, m, v, g, out in zip(a.params, a.exp_avgs, a.exp_avg_sqs, a.grads, a.params_out):
        new_p, new_m, new_v = adam_update(p.float(), m.float(), v.float(), g.float(), a, lr, bc1, bc2)
        _commit(m, new_m, skip)
        _commit(v, new_v, skip)
        new_p = new_p.to(p.dtype)  # as upstream: the output is the new value in the state dtype, converted
        _commit(p, new_p, skip)
        _commit(out, new_p, skip)


# distributed_adam_with_param_remainders -----------------------------------------------------


def bf16_and_remainder_to_fp32(bf16: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 value whose high half is ``bf16`` (undoing its rounding up) and low half ``remainder``."""
    high = bf16.contiguous().view(torch.int16).to(torch.int32) - (remainder < 0).to(torch.int32)
    bits = (high << 16) | (remainder.to(torch.int32) & 0xFFFF)
    return bits.view(torch.float32)


def fp32_to_bf16_and_remainder(fp32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split fp32 into bf16 (its high half, rounded up in magnitude when the low half's top bit is
    set, as upstream's kernel rounds) and the low 16 bits as int16."""
    bits = fp32.contiguous().view(torch.int32)
    low = bits & 0xFFFF
    remainder = ((low ^ 0x8000) - 0x8000).to(torch.int16)
    high = (bits >> 16) + (remainder < 0).to(torch.int32)
    high = (((high & 0xFFFF) ^ 0x8000) - 0x8000).to(torch.int16)
    return high.view(torch.bfloat16), remainder


def _check_with_remainders(a) -> None:
    per_param = dict(
        params=a.params,
        param_remainders=a.param_remainders,
        exp_avgs=a.exp_avgs,
        exp_avg_sqs=a.exp_avg_sqs,
        grads=a.grads,
        params_out=a.params_out,
    )
    _check_common(a, state_dtypes=FP32, per_param=per_param)


@op(
    KERNELS,
    "distributed_adam_with_param_remainders(int chunk_size, Tensor noop_flag, Tensor[] params, "
    "Tensor(a!)[] param_remainders, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, Tensor[] grads, "
    "Tensor(d!)[] params_out, Tensor grad_scale, float lr, float beta1, float beta2, float eps, int step, "
    "int adam_mode, bool bias_correction, float weight_decay, Tensor? lr_tensor=None, Tensor? step_tensor=None) -> ()",
    check=_check_with_remainders,
)
def distributed_adam_with_param_remainders(a):
    """Adam on fp32 master values kept as bf16 ``params`` plus int16 ``param_remainders`` (their
    low 16 bits); fp32 moments. The new remainders are written in place and the new bf16 values to
    ``params_out`` (which may be ``params`` itself). Upstream's
    ``multi_tensor_fused_adam_with_param_remainders`` lists ``[p_in, p_rem, m, v, g, p_out]``."""
    lr, bc1, bc2 = _hyper(a)
    skip = a.noop_flag.reshape(()) != 0
    for p, rem, m, v, g, out in zip(a.params, a.param_remainders, a.exp_avgs, a.exp_avg_sqs, a.grads, a.params_out):
        master = bf16_and_remainder_to_fp32(p, rem)
        new_p, new_m, new_v = adam_update(master, m, v, g.float(), a, lr, bc1, bc2)
        new_bf16, new_rem = fp32_to_bf16_and_remainder(new_p)
        _commit(m, new_m, skip)
        _commit(v, new_v, skip)
        _commit(rem, new_rem, skip)
        _commit(out, new_bf16, skip)
