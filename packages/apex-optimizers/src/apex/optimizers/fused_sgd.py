from __future__ import annotations

import torch

from apex.optimizers import _ops
from apex.optimizers._base import FusedOptimizer, check_hyperparameters, grads_of, required


class FusedSGD(FusedOptimizer):
    r"""SGD with momentum, Nesterov and weight decay in one fused kernel per parameter bucket.

    As ``torch.optim.SGD``: with :math:`g` the gradient and :math:`\lambda` the weight decay,

    .. math::
        g &\leftarrow g + \lambda\theta \quad(\text{before momentum, unless wd\_after\_momentum}) \\
        b &\leftarrow g \text{ (first step)},\quad b \leftarrow \mu b + (1-\tau) g \text{ (later steps)} \\
        g &\leftarrow g + \mu b \text{ (nesterov)}\quad\text{or}\quad g \leftarrow b \\
        g &\leftarrow g + \lambda\theta \quad(\text{only if wd\_after\_momentum}) \\
        \theta &\leftarrow \theta - \text{lr}\, g

    Momentum buffers are fp32 whatever the parameter dtype.

    Args:
        params: parameters or parameter groups.
        lr: learning rate: required, here or in every parameter group (``torch.optim.optimizer.required``
            as upstream's default; a group's own lr wins).
        momentum: momentum factor :math:`\mu`.
        dampening: dampening :math:`\tau` of the momentum.
        weight_decay: L2 penalty :math:`\lambda`.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening 0).
        wd_after_momentum: apply weight decay after the momentum update instead of before.
        materialize_master_grads: accepted for compatibility with upstream Apex's amp O2 path;
            with ``master_weights`` (which amp O2 turns on for bf16 models) the update reads the
            model's fp16/bf16 gradients directly, so there are no separate master grads.
        set_grad_none: ``zero_grad()`` sets gradients to None by default.
        maximize: maximize the objective (step along the gradient), as torch's ``maximize``.
        master_weights: keep fp32 master copies of fp16/bf16 parameters in the optimizer state,
            update them from the parameters' own gradients, and write the rounded result to the
            parameters in the same kernel (upstream's FusedSGD does this under amp O2). Not in
            upstream's signature, hence keyword-only.
    """

    def __init__(
        self,
        params,
        lr=required,
        momentum=0.0,
        dampening=0.0,
        weight_decay=0.0,
        nesterov=False,
        wd_after_momentum=False,
        materialize_master_grads=True,
        set_grad_none=False,
        *,
        maximize=False,
        master_weights=False,
    ):
        check_hyperparameters("FusedSGD", lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("FusedSGD: nesterov momentum requires a momentum and zero dampening")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=bool(maximize),
        )
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        super().__init__(params, defaults, set_grad_none, master_weights=master_weights)

    def _step_group(self, group, scaler):
        momentum = group["momentum"]
        for (device, _, _, has_master, _), params in self._buckets(group).items():
            host_lr, lr_tensor = self._lr(group, device)
            grad_scale, found_inf = scaler.on(device)
            # Parameters whose momentum buffer starts now take the gradient itself (first_run).
            # (Zeros, not garbage, in case a GradScaler skips that first step on the device.)
            new = [p for p in params if momentum != 0 and "momentum_buffer" not in self.state[p]]
            for p in new:
                self.state[p]["momentum_buffer"] = torch.zeros_like(
                    p, dtype=torch.float32, memory_format=torch.preserve_format
                )
            new_ids = {id(p) for p in new}
            old = [p for p in params if id(p) not in new_ids]
            for first_run, subset in ((True, new), (False, old)):
                if not subset:
                    continue
                buffers = [self.state[p]["momentum_buffer"] for p in subset] if momentum != 0 else []
                masters = [self._master_param(p) for p in subset] if has_master else []
                _ops.fused_sgd(
                    self.chunk_size,
                    subset,
                    grads_of(subset),
                    buffers,
                    masters,
                    host_lr,
                    group["weight_decay"],
                    momentum,
                    group["dampening"],
                    group["nesterov"],
                    first_run,
                    self.wd_after_momentum,
                    lr_tensor,
                    grad_scale,
                    found_inf,
                    group.get("maximize", False),
                )
