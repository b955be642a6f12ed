from __future__ import annotations

import torch

from apex.optimizers import _ops
from apex.optimizers._base import FusedOptimizer, check_hyperparameters, grads_of


class FusedLAMB(FusedOptimizer):
    r"""LAMB (You et al., "Large Batch Optimization for Deep Learning") in fused kernels.

    The gradients of all groups are first clipped together: with :math:`G` their global L2 norm,
    :math:`g \leftarrow g / \max(1, G/\text{max\_grad\_norm})` (no clipping when
    ``max_grad_norm <= 0``). Then per tensor, with :math:`\beta_3 = 1-\beta_1` if
    ``grad_averaging`` else 1:

    .. math::
        g &\leftarrow g + \lambda\theta \quad(\text{unless adam\_w\_mode}) \\
        m &\leftarrow \beta_1 m + \beta_3 g,\qquad v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        u &= \frac{m/(1-\beta_1^t)}{\sqrt{v/(1-\beta_2^t)} + \epsilon} + \lambda\theta\,[\text{adam\_w\_mode}] \\
        r &= \|\theta\| / \|u\| \text{ if both are non-zero, else } 1
            \quad(\text{only when } \lambda \ne 0 \text{ or use\_nvlamb; else } r = 1) \\
        \theta &\leftarrow \theta - \text{lr}\, r\, u

    The global norm, the per-tensor norms and the trust ratios are computed on the device.

    Args:
        params: parameters or parameter groups.
        lr: learning rate; None takes each group's own.
        bias_correction: apply Adam's bias corrections.
        betas: coefficients of the running averages.
        eps: added to the denominator.
        weight_decay: weight decay :math:`\lambda`.
        amsgrad: not supported; True raises.
        adam_w_mode: decoupled weight decay (added to the update) rather than L2 on the gradient.
        grad_averaging: scale the gradient term of the first moment by :math:`1-\beta_1`.
        set_grad_none: ``zero_grad()`` sets gradients to None by default.
        max_grad_norm: global gradient-norm clipping threshold.
        use_nvlamb: apply the trust ratio also to parameters without weight decay.
    """

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.01,
        amsgrad=False,
        adam_w_mode=True,
        grad_averaging=True,
        set_grad_none=True,
        max_grad_norm=1.0,
        use_nvlamb=False,
        *,
        capturable=False,
        master_weights=False,
    ):
        if amsgrad:
            raise RuntimeError(f"{type(self).__name__} does not support the AMSGrad variant (amsgrad=True)")
        check_hyperparameters(type(self).__name__, lr, eps=eps, betas=betas, weight_decay=weight_decay)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
        )
        self.adam_w_mode = adam_w_mode
        self.use_nvlamb = use_nvlamb
        self._global_norm: torch.Tensor | None = None
        super().__init__(params, defaults, set_grad_none, capturable, master_weights)

    def _prepare(self, scaler) -> None:
        """The global L2 norm of all (unscaled) gradients, on the first parameter's device."""
        squares, home = [], None
        for group in self.param_groups:
            for (device, _, _, _, _), params in self._buckets(group).items():
                home = home or device
                grad_scale, _ = scaler.on(device)
                noop = torch.zeros(1, dtype=torch.int32, device=device)
                if grad_scale is None:
                    norm, _ = torch.ops.apex_core.multi_tensor_l2norm(self.chunk_size, noop, grads_of(params), False)
                else:
                    norm, _ = torch.ops.apex_core.multi_tensor_unscale_l2norm(
                        self.chunk_size, noop, grads_of(params), [], 1.0 / grad_scale, False
                    )
                squares.append(norm.to(home, non_blocking=True).square())
        self._global_norm = torch.stack(squares).sum().sqrt().reshape(1) if squares else None

    def _step_group(self, group, scaler):
        beta1, beta2 = group["betas"]
        for b in self._bucket_inputs(group, scaler, "exp_avg", "exp_avg_sq"):
            step, step_tensor = self._advance(b.states, b.device, b.found_inf)
            _ops.fused_lamb(
                self.chunk_size,
                *b.tensor_lists,
                self._global_norm.to(b.device, non_blocking=True),
                b.lr,
                step,
                beta1,
                beta2,
                group["eps"],
                group["weight_decay"],
                self.adam_w_mode,
                group["bias_correction"],
                group["grad_averaging"],
                group["max_grad_norm"],
                self.use_nvlamb,
                b.lr_tensor,
                step_tensor,
                b.grad_scale,
                b.found_inf,
            )
