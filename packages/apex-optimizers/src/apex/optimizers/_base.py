"""What every fused optimizer shares: bucketing, steps, master weights, GradScaler, state_dict.

Parameters are grouped into buckets of one device, parameter dtype and gradient dtype (and
"has a fp32 master copy"), and each bucket is one call of the optimizer's op, so fp32, fp16 and
bf16 parameters on several devices can share a parameter group.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch

from apex.optimizers import _ops

DEFAULT_CHUNK_SIZE = 65536
_REDUCED = (torch.float16, torch.bfloat16)
_SUPPORTED = (torch.float32, *_REDUCED)


class FusedOptimizer(torch.optim.Optimizer):
    """Base class; subclasses implement :meth:`_step_group`.

    ``torch.amp.GradScaler`` hands ``grad_scale`` and ``found_inf`` over through the public
    ``_step_supports_amp_scaling`` protocol: gradients are unscaled inside the kernel and the
    step is skipped on the device when ``found_inf`` is set, with no host sync.
    """

    _step_supports_amp_scaling = True
    chunk_size = DEFAULT_CHUNK_SIZE
    initial_step = 0

    def __init__(
        self, params, defaults: dict, set_grad_none: bool, capturable: bool = False, master_weights: bool = False
    ):
        self.set_grad_none = set_grad_none
        self.capturable = capturable
        self.master_weights = master_weights
        super().__init__(params, defaults)

    # --- torch.optim.Optimizer API -------------------------------------------------------

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scaler = _ScalerInputs(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        self._prepare(scaler)
        for group in self.param_groups:
            self._step_group(group, scaler)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but optimizer state keeps its saved dtype (fp32 moments and master weights
        of fp16/bf16 parameters stay fp32), so a resumed run continues bitwise."""
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        for saved_group, group in zip(saved_groups, self.param_groups):
            for saved_id, param in zip(saved_group["params"], group["params"]):
                for key, value in saved_state.get(saved_id, {}).items():
                    if isinstance(value, torch.Tensor):
                        device = param.device if (key != "step" or value.device.type != "cpu") else "cpu"
                        self.state[param][key] = value.to(device=device, dtype=value.dtype, copy=True)

    # --- helpers for subclasses ----------------------------------------------------------

    def _prepare(self, scaler) -> None:
        """Work over all groups before any is stepped (LAMB's global gradient norm)."""

    def _name(self) -> str:
        return type(self).__name__

    def _buckets(self, group: dict) -> dict[tuple, list[torch.Tensor]]:
        """Parameters with a gradient, by (device, param dtype, grad dtype, has master copy, step).

        An op call applies one step count to all its tensors, so parameters whose counts differ
        (one that got its first gradient late, one that had none on some steps) go to separate
        calls. Only counts kept on the host are read (no sync); counts on the device (capturable,
        or after a GradScaler step on a GPU) are not, and such parameters share a bucket.
        """
        # Runs once per step over every parameter: kept to plain attribute reads (a few hundred
        # parameters would otherwise cost a noticeable part of a millisecond on the host).
        buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        state = self.state
        master_weights = self.master_weights
        initial = float(self.initial_step)
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(f"{self._name()} does not support sparse gradients")
            dtype = p.dtype
            if dtype not in _SUPPORTED:
                raise TypeError(f"{self._name()}: parameter of dtype {dtype}; expected float32, float16 or bfloat16")
            param_state = state.get(p)
            step = param_state.get("step") if param_state else None
            host_step = initial if step is None else (float(step) if step.is_cpu else None)
            buckets[(p.device, dtype, grad.dtype, master_weights and dtype in _REDUCED, host_step)].append(p)
        return buckets

    def _state(self, p: torch.Tensor, *names: str) -> dict:
        """The parameter's state, created on first use: fp32 zeros for ``names``, a step, a master copy."""
        state = self.state[p]
        if not state:
            on_device = self.capturable and p.device.type != "cpu"
            state["step"] = torch.full(
                (), float(self.initial_step), dtype=torch.float32, device=p.device if on_device else "cpu"
            )
            for name in names:
                state[name] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            if self.master_weights and p.dtype in _REDUCED:
                state["master_param"] = p.detach().float().clone(memory_format=torch.contiguous_format)
        return state

    def _bucket_inputs(self, group: dict, scaler, *state_names: str) -> Iterator[_Bucket]:
        """Per bucket of ``group``, what its op call takes; the states ``state_names`` are made on first use."""
        for (device, _, _, has_master, _), params in self._buckets(group).items():
            lr, lr_tensor = self._lr(group, device)
            grad_scale, found_inf = scaler.on(device)
            states = [self._state(p, *state_names) for p in params]
            masters = self._masters(params, states, has_master)
            yield _Bucket(device, params, states, state_names, masters, lr, lr_tensor, grad_scale, found_inf)

    @staticmethod
    def _advance(states: list[dict], device: torch.device, found_inf: torch.Tensor | None):
        """Count one more step for a bucket; return (host step, device step tensor or None).

        Steps live on the host (no sync to read) unless the optimizer is capturable or a
        GradScaler hands over found_inf: then they move to the device and a skipped step is not
        counted, without a sync.
        """
        steps = [s["step"] for s in states]
        if found_inf is None and all(t.device.type == "cpu" for t in steps):
            torch._foreach_add_(steps, 1.0)
            return int(steps[0].item()), None
        if any(t.device != device for t in steps):
            for s in states:
                s["step"] = s["step"].to(device)
            steps = [s["step"] for s in states]
        if found_inf is None:
            torch._foreach_add_(steps, 1.0)
        else:
            # A list of one-element tensors, not one 0-dim tensor: the (TensorList, Tensor)
            # overload may read a 0-dim tensor on the host (a sync per step).
            increment = 1.0 - found_inf.reshape(())
            torch._foreach_add_(steps, [increment] * len(steps))
        return 0, steps[0]

    @staticmethod
    def _lr(group: dict, device: torch.device):
        """(host lr, device lr tensor or None): a tensor lr is read on the device."""
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            return 0.0, lr.to(device=device, dtype=torch.float32).reshape(1)
        return float(lr), None

    @staticmethod
    def _masters(params: list[torch.Tensor], states: list[dict], has_master: bool) -> list[torch.Tensor]:
        return [s["master_param"] for s in states] if has_master else []


class _Bucket(NamedTuple):
    """One op call's inputs, derived alike by every optimizer (see ``FusedOptimizer._bucket_inputs``)."""

    device: torch.device
    params: list[torch.Tensor]
    states: list[dict]
    state_names: tuple[str, ...]
    masters: list[torch.Tensor]
    lr: float
    lr_tensor: torch.Tensor | None
    grad_scale: torch.Tensor | None
    found_inf: torch.Tensor | None

    @property
    def grads(self) -> list[torch.Tensor]:
        return grads_of(self.params)

    @property
    def tensor_lists(self) -> tuple[list[torch.Tensor], ...]:
        """params, grads, one list per state name, master params: the order of every op's schema."""
        per_state = ([s[name] for s in self.states] for name in self.state_names)
        return (self.params, self.grads, *per_state, self.masters)


class _ScalerInputs:
    """grad_scale / found_inf from a GradScaler, moved once to each device that needs them."""

    def __init__(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None):
        self.grad_scale = grad_scale
        self.found_inf = found_inf
        self._cache: dict = {}

    def on(self, device: torch.device):
        if device not in self._cache:

            def move(t):
                return None if t is None else t.to(device=device, dtype=torch.float32, non_blocking=True).reshape(1)

            self._cache[device] = (move(self.grad_scale), move(self.found_inf))
        return self._cache[device]


def grads_of(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params]


__all__ = ["DEFAULT_CHUNK_SIZE", "FusedOptimizer", "_ops", "grads_of"]
