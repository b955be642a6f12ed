"""The deprecated contrib ``FusedLAMB``: apex.optimizers.FusedLAMB with upstream's contrib signature."""

from __future__ import annotations

from apex.optimizers import FusedLAMB as _FusedLAMB


class FusedLAMB(_FusedLAMB):
    r"""LAMB as upstream's deprecated ``apex.contrib.optimizers.FusedLAMB``: the arithmetic of
    :class:`apex.optimizers.FusedLAMB` (see its docstring) with ``use_nvlamb=False``, whose
    kernels it runs. The gradients of all groups are clipped together to ``max_grad_norm`` by
    their global L2 norm; the trust ratio :math:`\|\theta\|/\|u\|` is applied to parameters with
    non-zero weight decay only.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        bias_correction: apply Adam's bias corrections.
        betas: coefficients of the running averages.
        eps: added to the denominator.
        weight_decay: weight decay.
        amsgrad: not supported; True raises RuntimeError.
        adam_w_mode: decoupled weight decay (added to the update) rather than L2 on the gradient.
        grad_averaging: scale the gradient term of the first moment by :math:`1-\beta_1`.
        set_grad_none: ``zero_grad()`` sets gradients to None by default.
        max_grad_norm: global gradient-norm clipping threshold (<= 0: no clipping).

    Differences from upstream, on purpose: the moments are fp32 for fp16/bf16 parameters too and
    bf16 parameters are accepted (upstream: fp16/fp32, moments in the parameter's dtype); the
    gradients are left as they were (upstream's kernel overwrites them with the update); nothing is
    printed at construction; ``max_grad_norm <= 0`` disables clipping (upstream divides by it);
    ``torch.amp.GradScaler`` can unscale inside the step (``_step_supports_amp_scaling``). Upstream's
    ``step`` at the last release called its ``fused_lamb_cuda.lamb`` without the global norm and
    failed; the global norm here is that of all groups' gradients, as upstream's earlier releases.
    """

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
    ):
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adam_w_mode=adam_w_mode,
            grad_averaging=grad_averaging,
            set_grad_none=set_grad_none,
            max_grad_norm=max_grad_norm,
            use_nvlamb=False,
        )
