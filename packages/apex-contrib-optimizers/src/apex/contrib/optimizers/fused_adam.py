"""The deprecated contrib ``FusedAdam`` (upstream's pre-multi-tensor Adam with the legacy step)."""

from __future__ import annotations

import types
from collections import defaultdict

import torch

from apex.contrib.optimizers import _ops
from apex.contrib.optimizers._state import load_state_keeping_dtypes
from apex.optimizers import _ops as _optimizer_ops  # noqa: F401  (registers torch.ops.apex_optimizers)
from apex.optimizers._base import check_hyperparameters

_REDUCED = (torch.float16, torch.bfloat16)
_CHUNK_SIZE = 65536


def per_group(values, groups: int, name: str):
    """Upstream's legacy step arguments: None, one list of the only group (or a generator), or a list per group."""
    if values is None:
        return [None] * groups
    if isinstance(values, types.GeneratorType):
        return [list(values)]
    values = list(values)
    if values and not isinstance(values[0], (list, tuple)):  # upstream: "a list of tensors is one group"
        values = [values]
    if len(values) != groups:
        raise ValueError(f"{name} has {len(values)} parameter groups but the optimizer has {groups}")
    return values


def _l2_norm(tensors) -> float:
    """The L2 norm of all ``tensors`` together (0 for none), in fp32 on the host."""
    squares = [torch.linalg.vector_norm(t, dtype=torch.float32).square().to("cpu") for t in tensors]
    return float(torch.stack(squares).sum().sqrt()) if squares else 0.0


def check_no_sparse(owner: str, grad: torch.Tensor) -> None:
    if grad.is_sparse:
        raise RuntimeError(f"{owner} does not support sparse gradients, please consider SparseAdam instead")


class FusedAdam(torch.optim.Optimizer):
    r"""Adam as upstream's deprecated ``apex.contrib.optimizers.FusedAdam`` computes it.

    Per element, with :math:`g` the gradient divided by the combined scale (below) and :math:`t`
    the parameter's step:

    .. math::
        m &\leftarrow \beta_1 m + (1-\beta_1) g, \qquad v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        s &= \text{lr}\,\sqrt{1-\beta_2^t}\,/\,(1-\beta_1^t) \quad(\text{lr without bias\_correction}) \\
        \theta &\leftarrow \theta - s\,\Big(\frac{m}{d} + \lambda\theta\Big), \qquad
            d = \sqrt{v+\epsilon}\ (\text{eps\_inside\_sqrt}) \text{ or } \sqrt{v}+\epsilon

    The weight decay :math:`\lambda` is added to the update (decoupled, scaled by the step size).

    ``step(closure=None, grads=None, output_params=None, scale=1.0, grad_norms=None)``, the legacy
    step: ``grads`` (a list per group, or one list) replace ``.grad``; ``output_params`` (same
    shape) receive the updated parameters rounded to their dtype (fp16 model weights of fp32
    masters) in the same pass; the gradients are divided by ``scale`` (the loss scale) and, when
    ``max_grad_norm > 0`` and the group's ``grad_norms`` entry (the norm of the *scaled* gradients)
    says the unscaled norm exceeds it, also by ``(norm/scale + 1e-6) / max_grad_norm``. Without
    ``grad_norms`` (a plain ``step()``) that norm is the group's gradients' own (upstream raised a
    TypeError).

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        bias_correction: fold Adam's bias corrections into the step size.
        betas: coefficients of the running averages.
        eps: added to the denominator (under the square root with ``eps_inside_sqrt``).
        eps_inside_sqrt: :math:`\sqrt{v+\epsilon}` instead of :math:`\sqrt{v}+\epsilon`.
        weight_decay: :math:`\lambda`.
        max_grad_norm: clip the gradients to this global norm (with ``grad_norms``); 0 disables.
        amsgrad: not supported; True raises RuntimeError as upstream.
        use_mt: upstream's multi-tensor switch; accepted, every step here is multi-tensor.
        amp_scale_adjustment: multiplies the loss scale taken from ``apex.amp``'s stash.

    Differences from upstream, on purpose: ``exp_avg``/``exp_avg_sq`` are fp32 for fp16/bf16
    parameters too (upstream takes only fp32/fp64 parameters with its kernel); ``output_params``
    are written for every gradient dtype (upstream's single-tensor kernel skips them for fp32
    gradients); with ``eps_inside_sqrt=False`` the step runs apex-optimizers' fused Adam kernel,
    which leaves ``grads`` divided by the combined scale when that is not 1 (upstream leaves
    them as they were). ``eps_inside_sqrt=True`` and fp64 parameters use this package's op
    ``torch.ops.apex_contrib_optimizers.adam`` (a CUDA kernel on GPUs, its PyTorch reference elsewhere).
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        eps_inside_sqrt=False,
        weight_decay=0.0,
        max_grad_norm=0.0,
        amsgrad=False,
        use_mt=False,
        amp_scale_adjustment=1.0,
    ):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        check_hyperparameters(
            "FusedAdam", lr, eps=eps, betas=betas, weight_decay=weight_decay, max_grad_norm=max_grad_norm
        )
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(params, defaults)
        self._use_multi_tensor = bool(use_mt)
        self._amp_scale_adjustment = amp_scale_adjustment
        self.eps_mode = _ops.EPS_INSIDE_SQRT if eps_inside_sqrt else _ops.EPS_OUTSIDE_SQRT

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the moments keep their saved dtype (fp32 for fp16/bf16 parameters)."""
        load_state_keeping_dtypes(self, state_dict)

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=1.0, grad_norms=None):
        """One step; see the class docstring for the legacy arguments."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stash = getattr(self, "_amp_stash", None)
        if stash is not None and hasattr(stash, "grads"):  # an amp that hands the fp16 gradients over
            grads = stash.grads
            output_params = stash.output_params
            scale = stash.scale * self._amp_scale_adjustment
            grad_norms = stash.grad_norms
        if not scale > 0:
            raise ValueError(f"FusedAdam.step: scale must be positive, got {scale}")
        n = len(self.param_groups)
        grads_groups = per_group(grads, n, "grads")
        outputs_groups = per_group(output_params, n, "output_params")
        norms = [None] * n if grad_norms is None else list(grad_norms)
        if len(norms) != n:
            raise ValueError(f"grad_norms has {len(norms)} entries but the optimizer has {n} parameter groups")
        for group, group_grads, group_outputs, norm in zip(self.param_groups, grads_groups, outputs_groups, norms):
            self._step_group(group, group_grads, group_outputs, scale, norm)
        return loss

    def _combined_scale(self, group, scale, norm, grads) -> float:
        if group["max_grad_norm"] > 0:
            if norm is None:  # upstream failed here (no grad_norms); the group's own gradients' norm
                norm = _l2_norm(grads)
            clip = (float(norm) / scale + 1e-6) / group["max_grad_norm"]
            if clip > 1:
                return clip * scale
        return scale

    def _step_group(self, group, grads, outputs, scale, norm) -> None:
        params = group["params"]
        grads = [None] * len(params) if grads is None else list(grads)
        outputs = [None] * len(params) if outputs is None else list(outputs)
        for name, values in (("grads", grads), ("output_params", outputs)):
            if len(values) != len(params):
                raise ValueError(f"FusedAdam.step: {name} has {len(values)} tensors but the group has {len(params)}")
        buckets = defaultdict(list)
        for p, grad, out in zip(params, grads, outputs):
            if grad is None:
                grad = p.grad
            if grad is None:
                continue
            check_no_sparse("FusedAdam", grad)
            if out is not None and p.dtype != torch.float32:
                raise TypeError(f"FusedAdam.step: output_params need fp32 parameters (masters), got {p.dtype}")
            state = self.state[p]
            if len(state) == 0:
                state["step"] = 0
                state_dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
                state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype, memory_format=torch.preserve_format)
            state["step"] += 1
            key = (p.device, p.dtype, grad.dtype, None if out is None else out.dtype, state["step"])
            buckets[key].append((p, grad, out, state))
        combined_scale = self._combined_scale(group, scale, norm, [g for ms in buckets.values() for _, g, _, _ in ms])
        for (device, p_dtype, g_dtype, _, step), members in buckets.items():
            self._launch(group, device, p_dtype, g_dtype, step, members, combined_scale)

    def _launch(self, group, device, p_dtype, g_dtype, step, members, combined_scale) -> None:
        beta1, beta2 = group["betas"]
        ps = [p for p, _, _, _ in members]
        gs = [g for _, g, _, _ in members]
        outs = [o for _, _, o, _ in members if o is not None]
        ms = [s["exp_avg"] for _, _, _, s in members]
        vs = [s["exp_avg_sq"] for _, _, _, s in members]
        fits_fused_kernel = self.eps_mode == _ops.EPS_OUTSIDE_SQRT and torch.float64 not in (p_dtype, g_dtype)
        if fits_fused_kernel:
            # With the bias corrections in the step size and no bias correction in the kernel, the
            # decoupled-decay Adam kernel does this arithmetic: p(1 - s wd) - s m/(sqrt(v)+eps).
            step_size = _ops.adam_step_size(group["lr"], beta1, beta2, step, group["bias_correction"])
            grad_scale = None
            if combined_scale != 1.0:
                grad_scale = torch.full((1,), combined_scale, dtype=torch.float32, device=device)
            torch.ops.apex_optimizers.fused_adam(
                _CHUNK_SIZE,
                outs or ps,
                gs,
                ms,
                vs,
                ps if outs else [],
                step_size,
                step,
                beta1,
                beta2,
                group["eps"],
                group["weight_decay"],
                True,
                False,
                grad_scale=grad_scale,
            )
        else:
            _ops.adam(
                ps,
                outs,
                ms,
                vs,
                gs,
                group["lr"],
                beta1,
                beta2,
                group["eps"],
                combined_scale,
                step,
                self.eps_mode,
                group["bias_correction"],
                group["weight_decay"],
            )
