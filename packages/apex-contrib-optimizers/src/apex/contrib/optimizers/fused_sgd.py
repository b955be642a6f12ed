"""The deprecated contrib ``FusedSGD``: SGD on fp32 masters with explicit gradients and output params."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.optim.optimizer import required

from apex.contrib.optimizers._state import load_state_keeping_dtypes
from apex.contrib.optimizers.fused_adam import check_no_sparse, per_group
from apex.optimizers import _ops as _optimizer_ops  # noqa: F401  (registers torch.ops.apex_optimizers)
from apex.optimizers._base import check_hyperparameters

_CHUNK_SIZE = 65536


class FusedSGD(torch.optim.Optimizer):
    r"""SGD with momentum as upstream's deprecated ``apex.contrib.optimizers.FusedSGD``, made to be
    wrapped by :class:`apex.contrib.optimizers.FP16_Optimizer`, which hands it the gradients.

    Per element, with :math:`g` the given gradient divided by ``scale``, :math:`\mu` the momentum
    and :math:`\tau` the dampening:

    .. math::
        g &\leftarrow g + \lambda\theta \quad(\text{before the momentum, or after it with wd\_after\_momentum}) \\
        b &\leftarrow g \text{ (first step) or } \mu b + (1-\tau) g, \qquad
            g \leftarrow g + \mu b \text{ (nesterov) or } b \\
        \theta &\leftarrow \theta - \text{lr}\, g

    ``step(closure=None, grads=None, output_params=None, scale=1.0, grad_norms=None)``: ``grads``
    and ``output_params`` are required (a list per group, or one list), as upstream: the group's
    parameters are the fp32 masters, ``output_params`` the model's weights, which receive the
    updated masters rounded to their dtype in the same pass. ``grad_norms`` is accepted and unused,
    as upstream.

    Args:
        params: parameters (the fp32 masters) or parameter groups.
        lr: learning rate (required).
        momentum: :math:`\mu`.
        dampening: :math:`\tau`.
        weight_decay: :math:`\lambda` (an L2 term on the gradient).
        nesterov: Nesterov momentum (needs momentum > 0 and dampening 0).
        wd_after_momentum: add the weight decay after the momentum.
        materialize_master_grads: accepted for upstream's signature; the gradients go straight
            to the kernel (upstream ignores it too).

    Differences from upstream, on purpose: fp32 ``output_params`` are written as well (upstream
    writes only fp16 ones, so fp32 model weights of an FP16_Optimizer never moved); bf16
    ``output_params`` are accepted; the momentum buffers are fp32.
    """

    def __init__(
        self,
        params,
        lr=required,
        momentum=0,
        dampening=0,
        weight_decay=0,
        nesterov=False,
        wd_after_momentum=False,
        materialize_master_grads=True,
    ):
        check_hyperparameters("FusedSGD", lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("FusedSGD: Nesterov momentum requires a momentum and zero dampening (nesterov=True)")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the momentum buffers keep their saved dtype."""
        load_state_keeping_dtypes(self, state_dict)

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=1.0, grad_norms=None):
        """One step on the given gradients; see the class docstring."""
        if hasattr(self, "_amp_stash"):
            raise RuntimeError("apex.contrib.optimizers.FusedSGD should not be used with AMP.")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grads is None:
            raise RuntimeError(
                "apex.contrib.optimizers.FusedSGD must be wrapped with apex.contrib.optimizers.FP16_Optimizer, "
                "which provides grads (step(grads=...) was None)"
            )
        if output_params is None:
            raise RuntimeError(
                "apex.contrib.optimizers.FusedSGD must be wrapped with apex.contrib.optimizers.FP16_Optimizer, "
                "which provides output_params (step(output_params=...) was None)"
            )
        if not scale > 0:
            raise ValueError(f"FusedSGD.step: scale must be positive, got {scale}")
        n = len(self.param_groups)
        for group, group_grads, group_outputs in zip(
            self.param_groups, per_group(grads, n, "grads"), per_group(output_params, n, "output_params")
        ):
            if group_grads is None or group_outputs is None:
                raise RuntimeError("apex.contrib.optimizers.FusedSGD only works when all parameters require grad.")
            self._step_group(group, list(group_grads), list(group_outputs), scale)
        return loss

    def _step_group(self, group, grads, outputs, scale) -> None:
        params = group["params"]
        for name, values in (("grads", grads), ("output_params", outputs)):
            if len(values) != len(params):
                raise ValueError(f"FusedSGD.step: {name} has {len(values)} tensors but the group has {len(params)}")
        momentum = group["momentum"]
        buckets = defaultdict(list)
        for p, grad, out in zip(params, grads, outputs):
            if grad is None or out is None:
                raise RuntimeError("apex.contrib.optimizers.FusedSGD only works when all parameters require grad.")
            check_no_sparse("FusedSGD", grad)
            if p.dtype != torch.float32:
                raise TypeError(f"FusedSGD.step: the parameters must be the fp32 masters, got {p.dtype}")
            state = self.state[p]
            first_run = momentum != 0 and "momentum_buffer" not in state
            if first_run:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buckets[(p.device, grad.dtype, out.dtype, first_run)].append((p, grad, out, state))
        grad_scale = None
        for (device, _, _, first_run), members in buckets.items():
            if scale != 1.0 and grad_scale is None:
                grad_scale = torch.full((1,), scale, dtype=torch.float32, device=device)
            torch.ops.apex_optimizers.fused_sgd(
                _CHUNK_SIZE,
                [o for _, _, o, _ in members],
                [g for _, g, _, _ in members],
                [s["momentum_buffer"] for _, _, _, s in members] if momentum != 0 else [],
                [p for p, _, _, _ in members],
                group["lr"],
                group["weight_decay"],
                momentum,
                group["dampening"],
                group["nesterov"],
                first_run,
                self.wd_after_momentum,
                grad_scale=None if grad_scale is None else grad_scale.to(device),
            )
