"""The contrib ``FP16_Optimizer``: fp32 masters and loss scaling for the contrib FusedAdam/FusedSGD."""

from __future__ import annotations

import torch

from apex.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler

_CHUNK_SIZE = 65536
_DYNAMIC_INIT_SCALE = 2.0**16


def _dynamic_scaling_attribute(name: str) -> property:
    """Upstream's attribute of dynamic scaling (absent with a static scale), kept by the scaler."""

    def check(self):
        if not self.dynamic_loss_scale:
            raise AttributeError(f"'FP16_Optimizer' with a static loss scale has no attribute '{name}'")

    def get(self):
        check(self)
        return getattr(self.loss_scaler, name)

    def set_(self, value):
        check(self)
        setattr(self.loss_scaler, name, value)

    return property(get, set_)


class FP16_Optimizer:
    """Wraps :class:`apex.contrib.optimizers.FusedAdam` or :class:`FusedSGD` built on a half-precision
    model (upstream: "only works with apex.contrib.optimizers.*").

    At construction each parameter of the wrapped optimizer's groups is replaced by an fp32 master
    copy (``fp32_groups``; the model's tensors stay in ``fp16_groups``). ``backward(loss)`` runs
    backward on ``loss * cur_scale``; ``step()`` takes the L2 norm of each group's model gradients,
    skips the step when one is not finite (and, with dynamic scaling, halves the scale), and
    otherwise calls the wrapped optimizer's legacy step with the model gradients, the model weights
    as ``output_params``, ``scale=cur_scale`` and the norms, so one fused pass unscales, clips,
    updates the masters and writes the model weights.

    Dynamic scaling as upstream: the scale starts at 2**16, halves on an overflow (not below 1)
    and doubles after 1000 steps without one (:class:`apex.fp16_utils.DynamicLossScaler`, whose
    rule this is); ``dynamic_loss_args`` is not supported and raises, as upstream.

    Args:
        init_optimizer: a contrib FusedAdam or FusedSGD on the model's parameters.
        static_loss_scale: the scale without ``dynamic_loss_scale``.
        dynamic_loss_scale: scale dynamically.
        dynamic_loss_args: must be None.
        verbose: print skipped steps.

    Differences from upstream, on purpose: nothing is printed at construction; gradients that are
    None are left out of the norms (upstream's kernel fails on them); ``load_state_dict`` copies the
    saved masters tensor by tensor (upstream's copy of whole lists fails).
    """

    def __init__(
        self,
        init_optimizer,
        static_loss_scale=1.0,
        dynamic_loss_scale=False,
        dynamic_loss_args=None,
        verbose=True,
    ):
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError(f"FP16_Optimizer: init_optimizer must be a torch.optim.Optimizer, got {init_optimizer!r}")
        self.optimizer = init_optimizer
        self.fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_groups: list[list[torch.Tensor]] = []
        for group in self.optimizer.param_groups:
            model_params = list(group["params"])
            masters = [p.detach().clone().float() for p in model_params]
            self.fp16_groups.append(model_params)
            self.fp32_groups.append(masters)
            group["params"] = masters
        if dynamic_loss_scale:
            if dynamic_loss_args is not None:
                raise SystemError("Do not support dynamic loss scale args for now (dynamic_loss_args).")
            self.loss_scaler: LossScaler = DynamicLossScaler(init_scale=_DYNAMIC_INIT_SCALE)
        else:
            self.loss_scaler = LossScaler(static_loss_scale)
            self._static_iter = 0
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self.verbose = verbose

    # upstream's attributes, read and written through the scaler
    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self.loss_scaler.cur_scale = value

    @property
    def cur_iter(self) -> int:
        return self.loss_scaler.cur_iter if self.dynamic_loss_scale else self._static_iter

    @cur_iter.setter
    def cur_iter(self, value: int) -> None:
        if self.dynamic_loss_scale:
            self.loss_scaler.cur_iter = value
        else:
            self._static_iter = value

    last_overflow_iter = _dynamic_scaling_attribute("last_overflow_iter")
    scale_factor = _dynamic_scaling_attribute("scale_factor")
    scale_window = _dynamic_scaling_attribute("scale_window")

    def zero_grad(self, set_grads_to_None=True):
        """Clears the model's gradients (to None by default, as upstream)."""
        for group in self.fp16_groups:
            for p in group:
                if set_grads_to_None:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()

    def backward(self, loss):
        """Backward of ``loss.float() * cur_scale``, accumulating scaled gradients into the model's ``.grad``."""
        (loss.float() * self.cur_scale).backward()

    def _group_norms(self):
        """Per group, the L2 norm of the model's (scaled) gradients as a one-element fp32 tensor, or None."""
        norms = []
        for group in self.fp16_groups:
            grads = [p.grad for p in group if p.grad is not None]
            if not grads:
                norms.append(None)
                continue
            by_kind = {}  # the norm op takes one dtype and device per call
            for g in grads:
                by_kind.setdefault((g.device, g.dtype), []).append(g)
            home = grads[0].device
            squares = []
            for (device, _), same in by_kind.items():
                noop = torch.zeros(1, dtype=torch.int32, device=device)
                norm, _ = torch.ops.apex_core.multi_tensor_l2norm(_CHUNK_SIZE, noop, same, False)
                squares.append(norm.to(home).square())
            norms.append(squares[0].sqrt() if len(squares) == 1 else torch.stack(squares).sum(0).sqrt())
        return norms

    def step(self, closure=None):
        """Steps the wrapped optimizer unless a gradient overflowed; updates the scale. No closure."""
        if closure is not None:
            raise NotImplementedError("FP16_Optimizer.step: closure is not supported (as upstream)")
        norms = self._group_norms()
        finite = [n for n in norms if n is not None]
        overflow = bool(finite) and not bool(torch.isfinite(torch.cat([n.to(finite[0].device) for n in finite])).all())
        if overflow:
            self._update_scale(True)
            return
        self.optimizer.step(
            grads=[[p.grad for p in group] for group in self.fp16_groups],
            output_params=self.fp16_groups,
            scale=self.cur_scale,
            grad_norms=norms,
        )
        self._update_scale(False)

    def _update_scale(self, skip: bool) -> None:
        if skip and self.verbose:
            kind = "dynamic" if self.dynamic_loss_scale else "static"
            print(f"\nGrad overflow on iteration {self.cur_iter}\nUsing {kind} loss scale of {self.cur_scale}")
        if self.dynamic_loss_scale:
            self.loss_scaler.update_scale(skip)
        else:
            self._static_iter += 1

    # The wrapped optimizer's state and param_groups, read and assigned through (schedulers, checkpoints).
    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    def state_dict(self) -> dict:
        """The scaling state, the wrapped optimizer's state dict and the fp32 masters (upstream's keys)."""
        state = {"dynamic_loss_scale": self.dynamic_loss_scale, "cur_scale": self.cur_scale, "cur_iter": self.cur_iter}
        if self.dynamic_loss_scale:
            state["last_overflow_iter"] = self.loss_scaler.last_overflow_iter
            state["scale_factor"] = self.loss_scaler.scale_factor
            state["scale_window"] = self.loss_scaler.scale_window
        state["optimizer_state_dict"] = self.optimizer.state_dict()
        state["fp32_groups"] = self.fp32_groups
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores what :meth:`state_dict` saved, the fp32 masters included (copied in place)."""
        if state_dict["dynamic_loss_scale"]:
            scaler = DynamicLossScaler(init_scale=state_dict["cur_scale"])
            scaler.last_overflow_iter = state_dict["last_overflow_iter"]
            scaler.scale_factor = state_dict["scale_factor"]
            scaler.scale_window = state_dict["scale_window"]
            self.loss_scaler = scaler
        else:
            self.loss_scaler = LossScaler(state_dict["cur_scale"])
        self.dynamic_loss_scale = bool(state_dict["dynamic_loss_scale"])
        self.cur_iter = state_dict["cur_iter"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        saved_groups = state_dict["fp32_groups"]
        if [len(g) for g in saved_groups] != [len(g) for g in self.fp32_groups]:
            raise ValueError("FP16_Optimizer.load_state_dict: fp32_groups does not match this optimizer's groups")
        for current_group, saved_group in zip(self.fp32_groups, saved_groups):
            for current, saved in zip(current_group, saved_group):
                current.copy_(saved)
