from __future__ import annotations

import torch


class LARC:
    r"""Layer-wise adaptive rate clipping/scaling around any optimizer, as upstream Apex's ``LARC``.

    Before each step of the wrapped optimizer, every parameter :math:`\theta` with gradient
    :math:`g` in a group with learning rate :math:`\eta` and weight decay :math:`\lambda` gets

    .. math::
        a &= \frac{c\,\lVert\theta\rVert}{\lVert g\rVert + \lambda\lVert\theta\rVert + \epsilon}, \qquad
        a \leftarrow \min\!\left(\frac{a}{\eta},\, 1\right) \quad(\text{clip: the step is } \min(a\eta, \eta)) \\
        g &\leftarrow a\,(g + \lambda\theta)

    where :math:`c` is the trust coefficient; without ``clip`` the step is :math:`a\eta` (scaling).
    A parameter whose norm or gradient norm is zero is left alone. The weight decay is applied
    here, so the group's ``weight_decay`` is set to 0 while the wrapped optimizer steps and put
    back afterwards. Norms are computed in fp32 (fp64 for fp64), on the device (no host sync).

    ``param_groups``, ``state``, ``state_dict``, ``load_state_dict``, ``zero_grad`` and
    ``add_param_group`` are the wrapped optimizer's, and so are its hooks (``register_*_hook``),
    which then receive the LARC as their optimizer: ``amp.initialize`` takes a LARC-wrapped optimizer.

    Args:
        optimizer: the optimizer to wrap (for example ``torch.optim.SGD``).
        trust_coefficient: :math:`c`.
        clip: clip the adaptive rate at the group's learning rate (LARC) instead of scaling by it (LARS).
        eps: :math:`\epsilon`, keeps the denominator away from zero.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.02, clip: bool = True, eps: float = 1e-8
    ):
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
            raise TypeError(f"LARC: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if trust_coefficient <= 0:
            raise ValueError(f"LARC: trust_coefficient must be positive, got {trust_coefficient}")
        if eps < 0:
            raise ValueError(f"LARC: eps must be non-negative, got {eps}")
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.clip = clip
        self.eps = eps

    def __getstate__(self):
        return self.optim.__getstate__()

    def __setstate__(self, state):
        self.optim.__setstate__(state)

    def __repr__(self) -> str:
        return f"LARC(trust_coefficient={self.trust_coefficient}, clip={self.clip}, eps={self.eps}) of {self.optim!r}"

    @property
    def state(self):
        return self.optim.state

    @property
    def param_groups(self):
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optim.param_groups = value

    @property
    def defaults(self):
        return self.optim.defaults

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        self.optim.add_param_group(param_group)

    # The hooks of torch.optim.Optimizer, registered on the wrapped optimizer but called with this
    # LARC as their ``optimizer`` (amp.initialize keeps its bookkeeping on the LARC it is given, and
    # its state-dict hooks read it there). The step hooks run around the wrapped optimizer's step.

    def register_state_dict_pre_hook(self, hook, prepend: bool = False):
        return self.optim.register_state_dict_pre_hook(lambda _: hook(self), prepend=prepend)

    def register_state_dict_post_hook(self, hook, prepend: bool = False):
        return self.optim.register_state_dict_post_hook(lambda _, state_dict: hook(self, state_dict), prepend=prepend)

    def register_load_state_dict_pre_hook(self, hook, prepend: bool = False):
        return self.optim.register_load_state_dict_pre_hook(
            lambda _, state_dict: hook(self, state_dict), prepend=prepend
        )

    def register_load_state_dict_post_hook(self, hook, prepend: bool = False):
        return self.optim.register_load_state_dict_post_hook(lambda _: hook(self), prepend=prepend)

    def register_step_pre_hook(self, hook):
        return self.optim.register_step_pre_hook(lambda _, args, kwargs: hook(self, args, kwargs))

    def register_step_post_hook(self, hook):
        return self.optim.register_step_post_hook(lambda _, args, kwargs: hook(self, args, kwargs))

    @torch.no_grad()
    def _adapt(self, group: dict, weight_decay: float) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            compute = torch.promote_types(p.dtype, torch.float32)
            param_norm = torch.linalg.vector_norm(p, dtype=compute)
            grad_norm = torch.linalg.vector_norm(grad, dtype=compute)
            adaptive = self.trust_coefficient * param_norm / (grad_norm + param_norm * weight_decay + self.eps)
            if self.clip:
                adaptive = torch.clamp(adaptive / group["lr"], max=1.0)
            keep = (param_norm == 0) | (grad_norm == 0)
            adapted = (grad.to(compute) + weight_decay * p.to(compute)) * adaptive
            grad.copy_(torch.where(keep, grad.to(compute), adapted))

    def step(self):
        """Adapt the gradients, then step the wrapped optimizer (no closure: it would recompute them)."""
        weight_decays = [group.get("weight_decay", 0) for group in self.optim.param_groups]
        try:
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                group["weight_decay"] = 0
                self._adapt(group, weight_decay)
            return self.optim.step()
        finally:
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                group["weight_decay"] = weight_decay


__all__ = ["LARC"]
