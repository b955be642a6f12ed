from __future__ import annotations

import torch

from apex.optimizers import _ops
from apex.optimizers._base import _WITH_FLOAT64, FusedOptimizer, check_hyperparameters


class FusedAdam(FusedOptimizer):
    r"""Adam and AdamW in one fused multi-tensor kernel per parameter bucket.

    With :math:`g` the gradient (divided by the loss scale when a ``GradScaler`` drives the
    step), :math:`\lambda` the weight decay and :math:`t` the step:

    .. math::
        \text{Adam (adam\_w\_mode=False):}\quad & g \leftarrow g + \lambda\theta \\
        \text{AdamW (adam\_w\_mode=True):}\quad & \theta \leftarrow \theta (1 - \text{lr}\,\lambda) \\
        m &\leftarrow \beta_1 m + (1-\beta_1) g,\qquad v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        \theta &\leftarrow \theta - \frac{\text{lr}}{1-\beta_1^t}\,
            \frac{m}{\sqrt{v}/\sqrt{1-\beta_2^t} + \epsilon}

    exactly as ``torch.optim.Adam``/``AdamW`` compute it (the bias corrections are 1 when
    ``bias_correction=False``). Moments are fp32 whatever the parameter dtype.

    Args:
        params: parameters or parameter groups (fp32, fp16 and bf16 may be mixed, on any devices;
            float64 too, with the math in fp32 as upstream's kernel does it).
        lr: learning rate (a float, or a tensor read on the device); None takes each group's own.
        bias_correction: apply Adam's bias corrections.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        adam_w_mode: decoupled weight decay (AdamW) when True, L2 regularisation (Adam) when False.
        weight_decay: decay coefficient :math:`\lambda`.
        amsgrad: not supported; True raises.
        set_grad_none: ``zero_grad()`` sets gradients to None by default.
        capturable: keep the step count (and a tensor lr) on the device so that ``step()`` can be
            captured in a CUDA graph; a skipped (overflow) step is not counted.
        master_weights: keep fp32 master copies of fp16/bf16 parameters in the optimizer state,
            update them, and write the rounded result to the parameters in the same kernel.
        maximize: maximize the objective (step along the gradient), as torch's ``maximize``.

    As upstream's FusedAdam: ``group["step"]`` is the group's step count (written after each
    step; a value written there, e.g. by Megatron's distributed optimizer when it loads a
    checkpoint, becomes every parameter's step), ``param_groups_master`` the fp32 master copies,
    ``_dummy_overflow_buf`` an int32 flag, and ``step(closure=None, grad_scaler=None)`` takes a
    ``torch.amp.GradScaler``. After a GradScaler step the gradients hold their unscaled values
    (written by the kernel), as torch's non-fused optimizers leave them.
    """

    param_dtypes = _WITH_FLOAT64
    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=True,
        capturable=False,
        master_weights=False,
        *,
        maximize=False,
    ):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (amsgrad=True)")
        check_hyperparameters("FusedAdam", lr, eps=eps, betas=betas, weight_decay=weight_decay)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            maximize=bool(maximize),
        )
        self.adam_w_mode = adam_w_mode
        super().__init__(params, defaults, set_grad_none, capturable, master_weights)
        first = next((p for g in self.param_groups for p in g["params"]), None)
        self._dummy_overflow_buf = torch.zeros(
            1, dtype=torch.int32, device=first.device if first is not None else "cpu"
        )

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """One step; ``grad_scaler``: a ``torch.amp.GradScaler`` whose scale and inf check the
        step applies (upstream's protocol), else what ``GradScaler.step`` set on the optimizer."""
        return self._step(closure, grad_scaler)

    def _step_group(self, group, scaler):
        beta1, beta2 = group["betas"]
        for b in self._bucket_inputs(group, scaler, "exp_avg", "exp_avg_sq"):
            step, step_tensor = self._advance(b.states, b.device, b.found_inf)
            _ops.fused_adam(
                self.chunk_size,
                *b.tensor_lists,
                b.lr,
                step,
                beta1,
                beta2,
                group["eps"],
                group["weight_decay"],
                self.adam_w_mode,
                group["bias_correction"],
                b.lr_tensor,
                step_tensor,
                b.grad_scale,
                b.found_inf,
                group.get("maximize", False),
            )
