"""``FP16_Optimizer``: the manual mixed-precision wrapper of upstream's fp16_utils."""

from __future__ import annotations

import torch

from apex.amp._multi_tensor import copy_into, scale_into
from apex.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler

_HALF = (torch.float16, torch.bfloat16)


def _wrapped_optimizer_attribute(name: str) -> property:
    """``name`` read and assigned through to the wrapped optimizer, so code written for a plain
    optimizer (schedulers, checkpointing) sees and changes the one that steps."""
    return property(
        lambda self: getattr(self.optimizer, name),
        lambda self, value: setattr(self.optimizer, name, value),
    )


class FP16_Optimizer:
    """Wraps an optimizer built on a half-precision model: fp32 master weights and loss scaling.

    Half (fp16/bf16) parameters of ``init_optimizer`` are replaced in its groups by fp32 master
    copies; fp32 parameters stay. The training loop calls ``optimizer.backward(loss)`` instead of
    ``loss.backward()``, then ``optimizer.step()``::

        optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)
        optimizer.zero_grad()
        optimizer.backward(loss_fn(model(x), y))
        optimizer.step()

    ``backward`` scales the loss, runs backward and (by default) writes the unscaled gradients into
    the masters' ``.grad``, noting an overflow; ``step`` updates the scale, skips the step on an
    overflow, else steps the wrapped optimizer and copies the masters into the model.

    Args:
        init_optimizer: the optimizer, built on the model's (half and/or fp32) parameters.
        static_loss_scale: the scale when ``dynamic_loss_scale`` is False.
        dynamic_loss_scale: use a :class:`DynamicLossScaler`.
        dynamic_loss_args: keyword arguments of that scaler (``init_scale``, ``scale_factor``, ``scale_window``).
        verbose: print what was wrapped and each skipped step.
    """

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict | None = None,
        verbose: bool = True,
    ):
        self.verbose = verbose
        self.optimizer = init_optimizer
        self.fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.Tensor]] = []
        for index, group in enumerate(self.optimizer.param_groups):
            self.maybe_print(f"FP16_Optimizer processing param group {index}:")
            halves, masters, fp32s = [], [], []
            for i, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in _HALF:
                    self.maybe_print(f"FP16_Optimizer received {param.dtype} param with {tuple(param.shape)}")
                    master = torch.nn.Parameter(param.detach().float())
                    group["params"][i] = master
                    halves.append(param)
                    masters.append(master)
                    if param in self.optimizer.state:
                        self.optimizer.state[master] = self.optimizer.state.pop(param)
                elif param.dtype == torch.float32:
                    self.maybe_print(f"FP16_Optimizer received float32 param with {tuple(param.shape)}")
                    fp32s.append(param)
                else:
                    raise TypeError(f"Wrapped parameters must be float32, float16 or bfloat16; received {param.dtype}")
            self.fp16_groups.append(halves)
            self.fp32_from_fp16_groups.append(masters)
            self.fp32_from_fp32_groups.append(fp32s)
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]
        # Recast any pre-existing per-parameter state (moments) to the masters' fp32.
        self.optimizer.load_state_dict(self.optimizer.state_dict())

        self.dynamic_loss_scale = dynamic_loss_scale
        if dynamic_loss_scale:
            self.loss_scaler = DynamicLossScaler(**(dynamic_loss_args or {}))
        else:
            self.loss_scaler = LossScaler(static_loss_scale)
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm = torch.nn.utils.clip_grad_norm_

    def maybe_print(self, msg: str) -> None:
        if self.verbose:
            print(msg)

    def __getstate__(self):
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state):
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    # --- gradients -------------------------------------------------------------------------

    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        """Zero (or drop) the gradients of the masters, the fp32 parameters and the model's half parameters."""
        for param in [*self.all_fp16_params, *(p for g in self.optimizer.param_groups for p in g["params"])]:
            if set_grads_to_None:
                param.grad = None
            elif param.grad is not None:
                param.grad.detach_()
                param.grad.zero_()

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """``(loss * loss_scale).backward()``, then (by default) :meth:`update_master_grads`.

        With ``update_master_grads=False`` gradients of several backward calls accumulate, scaled,
        in the model until :meth:`update_master_grads` is called once before :meth:`step`.
        """
        (loss.float() * self.loss_scaler.loss_scale).backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale the model's gradients into the masters' (fp32) and note whether any overflowed."""
        inputs, outputs = [], []
        for model, master in zip(self.all_fp16_params, self.all_fp32_from_fp16_params):
            if model.grad is None:
                master.grad = None
                continue
            if master.grad is None:
                master.grad = torch.empty_like(master)
            inputs.append(model.grad)
            outputs.append(master.grad)
        for param in self.all_fp32_from_fp32_params:
            if param.grad is not None:
                inputs.append(param.grad)
                outputs.append(param.grad)
        flags: dict[torch.device, torch.Tensor] = {}

        def flag_on(device):
            if device not in flags:
                flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
            return flags[device]

        inv = 1.0 / self.loss_scaler.loss_scale
        scale_into(inputs, outputs, lambda device: torch.full((1,), inv, dtype=torch.float32, device=device), flag_on)
        if self.dynamic_loss_scale:
            self.overflow = any(bool(flag.item()) for flag in flags.values())
        else:
            self.overflow = False

    def inspect_master_grad_data(self):
        """The masters' gradients, per group (None entries where a master has none); None after an overflow."""
        if self.overflow:
            print("Warning: calling FP16_Optimizer.inspect_master_grad_data while in an overflow state.")
            return None
        return [[None if p.grad is None else p.grad.detach() for p in g["params"]] for g in self.optimizer.param_groups]

    def clip_master_grads(self, max_norm: float, norm_type: float = 2):
        """Clip the masters' gradient norm; returns the norm before clipping, or -1 after an overflow."""
        if self.overflow:
            return -1
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return self.clip_grad_norm(params, max_norm, norm_type)

    # --- the step --------------------------------------------------------------------------

    def _master_params_to_model_params(self) -> None:
        if self.all_fp16_params:
            with torch.no_grad():
                copy_into(self.all_fp32_from_fp16_params, self.all_fp16_params)

    def _update_scale(self, has_overflow: bool) -> None:
        self.loss_scaler.update_scale(has_overflow)

    def step(self, closure=None):
        """Update the scale; on an overflow skip the step, else step the wrapped optimizer and refresh the model."""
        scale = self.loss_scaler.loss_scale
        self._update_scale(self.overflow)
        if self.overflow:
            self.maybe_print(
                f"OVERFLOW! Skipping step. Attempted loss scale: {scale}, reducing to {self.loss_scaler.loss_scale}"
            )
            return None
        retval = self._step_with_closure(closure) if closure is not None else self.optimizer.step()
        self._master_params_to_model_params()
        return retval

    def _step_with_closure(self, closure):
        def wrapped_closure():
            # The model is fresh on the first call; later calls (L-BFGS) follow master updates.
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                self._master_params_to_model_params()
            loss = closure()
            while self.overflow:
                scale = self.loss_scaler.loss_scale
                self._update_scale(self.overflow)
                self.maybe_print(
                    f"OVERFLOW within closure! Skipping step. Attempted loss scale: {scale}, "
                    f"reducing to {self.loss_scaler.loss_scale}"
                )
                loss = closure()
            return loss

        retval = self.optimizer.step(wrapped_closure)
        self.first_closure_call_this_step = True
        return retval

    # --- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Loss scaler, overflow state, the wrapped optimizer's state and the fp32 masters."""
        return {
            "loss_scaler": self.loss_scaler,
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": self.fp32_from_fp16_groups,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`'s output; the masters are restored exactly (not from the half model)."""
        self.loss_scaler = state_dict["loss_scaler"]
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.overflow = state_dict["overflow"]
        self.first_closure_call_this_step = state_dict["first_closure_call_this_step"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        with torch.no_grad():
            for current_group, saved_group in zip(self.fp32_from_fp16_groups, state_dict["fp32_from_fp16"]):
                for current, saved in zip(current_group, saved_group):
                    current.copy_(saved)

    # --- the wrapped optimizer's attributes ------------------------------------------------

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler.cur_scale = value

    state = _wrapped_optimizer_attribute("state")
    param_groups = _wrapped_optimizer_attribute("param_groups")
