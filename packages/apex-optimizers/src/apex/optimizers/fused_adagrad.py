from __future__ import annotations

from apex.optimizers import _ops
from apex.optimizers._base import _WITH_FLOAT64, FusedOptimizer, check_hyperparameters


class FusedAdagrad(FusedOptimizer):
    r"""Adagrad in one fused kernel per parameter bucket.

    As ``torch.optim.Adagrad`` (no lr decay, zero initial accumulator):

    .. math::
        g &\leftarrow g + \lambda\theta \quad(\text{unless adagrad\_w\_mode}) \\
        h &\leftarrow h + g^2 \\
        \theta &\leftarrow \theta - \text{lr}\left(\frac{g}{\sqrt{h} + \epsilon}
            + \lambda\theta\,[\text{adagrad\_w\_mode}]\right)

    The accumulator :math:`h` is fp32 whatever the parameter dtype.

    Args:
        params: parameters or parameter groups (float64 too, with the math in fp32 as upstream's).
        lr: learning rate; None takes each group's own.
        eps: added to the denominator.
        weight_decay: weight decay :math:`\lambda`.
        set_grad_none: ``zero_grad()`` sets gradients to None by default.
        adagrad_w_mode: decoupled weight decay (applied to the update) instead of L2 on the gradient.
        maximize: maximize the objective (step along the gradient), as torch's ``maximize``.
    """

    param_dtypes = _WITH_FLOAT64
    state_keys = ("sum",)

    def __init__(
        self, params, lr=1e-2, eps=1e-10, weight_decay=0.0, set_grad_none=True, adagrad_w_mode=False, *, maximize=False
    ):
        check_hyperparameters("FusedAdagrad", lr, eps=eps, weight_decay=weight_decay)
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, maximize=bool(maximize))
        self.adagrad_w_mode = adagrad_w_mode
        super().__init__(params, defaults, set_grad_none)

    def _step_group(self, group, scaler):
        for b in self._bucket_inputs(group, scaler, "sum"):
            self._advance(b.states, b.device, b.found_inf)
            _ops.fused_adagrad(
                self.chunk_size,
                *b.tensor_lists,
                b.lr,
                group["eps"],
                group["weight_decay"],
                self.adagrad_w_mode,
                b.lr_tensor,
                b.grad_scale,
                b.found_inf,
                group.get("maximize", False),
            )
