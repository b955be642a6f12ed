from __future__ import annotations

import torch

from apex.optimizers import _ops
from apex.optimizers._base import FusedOptimizer, check_hyperparameters


class FusedNovoGrad(FusedOptimizer):
    r"""NovoGrad (Ginsburg et al., "Stochastic Gradient Methods with Layer-wise Adaptive Moments").

    The second moment is one number per tensor, from the norm of the tensor's gradient
    (L2 for ``norm_type=2``, max-abs for ``norm_type=0``):

    .. math::
        v &\leftarrow \|g\|^2 \text{ at the first step unless init\_zero, else }
            v \leftarrow \beta_2 v + (1-\beta_2)\|g\|^2 \\
        \hat g &= g / (\sqrt{v/(1-\beta_2^t)} + \epsilon) + \lambda\theta\,[\text{reg\_inside\_moment}] \\
        m &\leftarrow \beta_1 m + \beta_3 \hat g,\quad \beta_3 = 1-\beta_1 \text{ if grad\_averaging else } 1 \\
        \theta &\leftarrow \theta - \text{lr}\,\big(m/(1-\beta_1^t)
            + \lambda\theta\,[\text{not reg\_inside\_moment}]\big)

    Args:
        params: parameters or parameter groups.
        lr: learning rate; None takes each group's own.
        bias_correction: apply the bias corrections.
        betas: coefficients of the running averages.
        eps: added to the denominator.
        weight_decay: weight decay :math:`\lambda`.
        amsgrad: not supported; True raises.
        reg_inside_moment: add the weight decay inside the moment (the paper) or to the update.
        grad_averaging: scale the gradient term of the first moment by :math:`1-\beta_1`.
        norm_type: 2 (L2) or 0 (infinity norm) for the per-tensor gradient norm.
        init_zero: start the second moment at zero instead of the first gradient's norm.
        set_grad_none: ``zero_grad()`` sets gradients to None by default.

    Steps are counted on the host (a step that a GradScaler skips is still counted).
    """

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        reg_inside_moment=False,
        grad_averaging=True,
        norm_type=2,
        init_zero=False,
        set_grad_none=True,
    ):
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant (amsgrad=True)")
        check_hyperparameters("FusedNovoGrad", lr, eps=eps, betas=betas, weight_decay=weight_decay)
        if norm_type not in (0, 2):
            raise ValueError(f"FusedNovoGrad: norm_type must be 2 (L2) or 0 (infinity), got {norm_type}")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            norm_type=norm_type,
        )
        self.reg_inside_moment = reg_inside_moment
        self.init_zero = init_zero
        super().__init__(params, defaults, set_grad_none)

    def _grad_norms(self, grads, norm_type, grad_scale, device):
        if norm_type == 2:
            noop = torch.zeros(1, dtype=torch.int32, device=device)
            if grad_scale is None:
                _, norms = torch.ops.apex_core.multi_tensor_l2norm(self.chunk_size, noop, grads, True)
            else:
                _, norms = torch.ops.apex_core.multi_tensor_unscale_l2norm(
                    self.chunk_size, noop, grads, [], 1.0 / grad_scale, True
                )
            return norms
        # torch refuses the infinity norm of an empty tensor; like its L2 norm, it is 0 here
        filled = [g for g in grads if g.numel()]
        maxima = iter(torch._foreach_norm(filled, float("inf")) if filled else [])
        zero = torch.zeros((), dtype=torch.float32, device=device)
        norms = torch.stack([next(maxima).float() if g.numel() else zero for g in grads])
        return norms / grad_scale if grad_scale is not None else norms

    def _step_group(self, group, scaler):
        beta1, beta2 = group["betas"]
        for b in self._bucket_inputs(group, scaler, "exp_avg"):
            states = b.states
            for state in states:
                state.setdefault("exp_avg_sq", torch.zeros((), dtype=torch.float32, device=b.device))
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1.0)
            step = int(steps[0].item())
            self._stepped = max(step, self._stepped or 0)
            grads = b.grads
            second_moments = torch.stack([s["exp_avg_sq"] for s in states])
            _ops.fused_novograd(
                self.chunk_size,
                b.params,
                grads,
                [s["exp_avg"] for s in states],
                second_moments,
                self._grad_norms(grads, group["norm_type"], b.grad_scale, b.device),
                b.masters,
                b.lr,
                step,
                beta1,
                beta2,
                group["eps"],
                group["weight_decay"],
                group["bias_correction"],
                group["grad_averaging"],
                self.reg_inside_moment,
                self.init_zero,
                b.lr_tensor,
                b.grad_scale,
                b.found_inf,
            )
            torch._foreach_copy_([s["exp_avg_sq"] for s in states], list(second_moments.unbind()))
