"""What every fused optimizer shares: bucketing, steps, master weights, GradScaler, state_dict.

Parameters are grouped into buckets of one device, parameter dtype and gradient dtype (and
"has a fp32 master copy"), and each bucket is one call of the optimizer's op, so fp32, fp16 and
bf16 parameters on several devices can share a parameter group.
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch
from torch.optim.optimizer import required

from apex.core import checks
from apex.optimizers import _ops

DEFAULT_CHUNK_SIZE = 65536
_REDUCED = (torch.float16, torch.bfloat16)
_SUPPORTED = (torch.float32, *_REDUCED)
_WITH_FLOAT64 = (*_SUPPORTED, torch.float64)
_UNSET = object()


def check_hyperparameters(owner: str, lr=_UNSET, **values) -> None:
    """Refuse invalid constructor hyperparameters as torch.optim does, naming the argument.

    ``lr``: a number >= 0, a one-element tensor, or ``required`` / None (then every parameter
    group must give its own). ``betas``: two numbers in [0, 1). Every other keyword (``eps``,
    ``weight_decay``, ``momentum``, ``dampening``): a number >= 0. NaN is refused everywhere.
    """
    if lr is not _UNSET and lr is not required and lr is not None:
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError(f"{owner}: invalid lr={lr}; a tensor lr must have one element")
        elif not isinstance(lr, numbers.Real) or isinstance(lr, bool):
            raise TypeError(f"{owner}: lr must be a float or a one-element tensor, got {type(lr).__name__}")
        elif not lr >= 0.0:
            raise ValueError(f"{owner}: invalid learning rate lr={lr}; expected a number >= 0")
    for name, value in values.items():
        if name == "betas":
            if not (
                isinstance(value, (tuple, list))
                and len(value) == 2
                and all(isinstance(b, numbers.Real) and 0.0 <= b < 1.0 for b in value)
            ):
                raise ValueError(f"{owner}: invalid betas={value}; expected two numbers in [0, 1)")
        elif not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise TypeError(f"{owner}: {name} must be a float, got {type(value).__name__}")
        elif not value >= 0.0 or math.isinf(value):
            raise ValueError(f"{owner}: invalid {name}={value}; expected a finite number >= 0")


class FusedOptimizer(torch.optim.Optimizer):
    """Base class; subclasses implement :meth:`_step_group`.

    ``torch.amp.GradScaler`` hands ``grad_scale`` and ``found_inf`` over through the public
    ``_step_supports_amp_scaling`` protocol: gradients are unscaled inside the kernel and the
    step is skipped on the device when ``found_inf`` is set, with no host sync.
    """

    _step_supports_amp_scaling = True
    chunk_size = DEFAULT_CHUNK_SIZE
    initial_step = 0
    # Parameter dtypes the optimizer's op takes (upstream's Adam and Adagrad also take float64).
    param_dtypes = _SUPPORTED
    # The state every stepped parameter has; a loaded state dict must have it (load_state_dict).
    state_keys: tuple[str, ...] = ()
    # Group keys added after the first release, filled with their default when a state dict lacks them.
    optional_group_keys: tuple[str, ...] = ("maximize",)

    def __init__(
        self, params, defaults: dict, set_grad_none: bool, capturable: bool = False, master_weights: bool = False
    ):
        if defaults.get("lr", required) is None:
            defaults["lr"] = required  # None: every group gives its lr, as with torch's ``required``
        self.set_grad_none = set_grad_none
        self.capturable = capturable
        self.master_weights = master_weights
        # group["step"] as upstream keeps it, per group: what this optimizer last wrote there, by
        # id(group); any other value was written from outside (a checkpoint, Megatron) and is
        # taken over by the parameters' steps.
        self._written_steps: dict[int, object] = {}
        super().__init__(params, defaults)

    # --- torch.optim.Optimizer API -------------------------------------------------------

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        return self._step(closure, None)

    def _step(self, closure, grad_scaler):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scaler = _ScalerInputs.of(self, grad_scaler)
        for group in self.param_groups:
            self._take_group_step(group)
        self._prepare(scaler)
        for group in self.param_groups:
            self._stepped = None
            self._step_group(group, scaler)
            self._record_group_step(group)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but optimizer state keeps its saved dtype (fp32 moments and master weights
        of fp16/bf16 parameters stay fp32), so a resumed run continues bitwise; a state dict of
        another optimizer class (other group hyperparameters or state) is refused by name."""
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        self._check_loadable(saved_groups, saved_state)
        super().load_state_dict(state_dict)
        for saved_group, group in zip(saved_groups, self.param_groups):
            for key in self.optional_group_keys:
                if key in self.defaults:
                    group.setdefault(key, self.defaults[key])
            for saved_id, param in zip(saved_group["params"], group["params"]):
                for key, value in saved_state.get(saved_id, {}).items():
                    if isinstance(value, torch.Tensor):
                        device = param.device if (key != "step" or value.device.type != "cpu") else "cpu"
                        self.state[param][key] = value.to(device=device, dtype=value.dtype, copy=True)
            # The saved group step agrees with the parameters' own when every state has one.
            states = [self.state[p] for p in group["params"] if self.state.get(p)]
            if "step" in group and all("step" in s for s in states):
                self._written_steps[id(group)] = group["step"]

    def _check_loadable(self, saved_groups, saved_state) -> None:
        where = f"{self._name()}.load_state_dict"
        needed = [k for k in self.defaults if k not in self.optional_group_keys]
        for i, group in enumerate(saved_groups):
            missing = [k for k in needed if k not in group]
            if missing:
                raise ValueError(
                    f"{where}: param_groups[{i}] lacks {', '.join(map(repr, missing))} (it has "
                    f"{', '.join(map(repr, sorted(k for k in group if k != 'params')))}): "
                    f"a state dict of another optimizer class?"
                )
        for index, state in saved_state.items():
            missing = [k for k in self.state_keys if k not in state]
            if state and missing:
                raise ValueError(
                    f"{where}: the state of parameter {index} lacks {', '.join(map(repr, missing))} (it has "
                    f"{', '.join(map(repr, sorted(state)))}), which {self._name()} keeps: "
                    f"a state dict of another optimizer class?"
                )

    # --- upstream Apex's attributes ------------------------------------------------------

    @property
    def param_groups_master(self) -> list[dict]:
        """Per group, the fp32 master copy of each parameter, as upstream's ``param_groups_master``:
        the master weight of an fp16/bf16 parameter (made now if it has none yet), the fp32
        parameter itself, or None for every parameter without ``master_weights``."""
        groups = []
        for group in self.param_groups:
            masters = []
            for p in group["params"]:
                if not self.master_weights:
                    masters.append(None)
                elif p.dtype in _REDUCED:
                    masters.append(self._master_param(p))
                else:
                    masters.append(p)
            groups.append({"params": masters})
        return groups

    def _take_group_step(self, group: dict) -> None:
        """A ``group["step"]`` written from outside becomes the step of every parameter with state."""
        if "step" not in group or self._written_steps.get(id(group), _UNSET) is group["step"]:
            return
        value = group["step"]
        for p in group["params"]:
            state = self.state.get(p)
            if not state:
                continue
            old = state.get("step")
            if isinstance(value, torch.Tensor):
                device = value.device if old is None else old.device
                new = value.detach().to(device=device, dtype=torch.float32).reshape(()).clone()
            else:
                device = "cpu" if old is None else old.device
                new = torch.tensor(float(value), dtype=torch.float32, device=device)
            state["step"] = new
        self._written_steps[id(group)] = value

    def _record_group_step(self, group: dict) -> None:
        """Upstream's ``group["step"]``: the group's step count after this step (an int, or the
        device step tensor of a capturable or GradScaler-driven step)."""
        if self._stepped is None:
            return
        group["step"] = self._stepped
        self._written_steps[id(group)] = self._stepped

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
        dtypes = self.param_dtypes
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(f"{self._name()} does not support sparse gradients")
            dtype = p.dtype
            if dtype not in dtypes:
                expected = ", ".join(str(d).replace("torch.", "") for d in dtypes)
                raise TypeError(f"{self._name()}: parameter of dtype {dtype}; expected one of {expected}")
            if p.is_meta or grad.is_meta:
                self._refuse_meta(group, p)
            if not (p.is_contiguous() and grad.is_contiguous()):
                self._check_layout(group, p)
            param_state = state.get(p)
            step = param_state.get("step") if param_state else None
            host_step = initial if step is None else (float(step) if step.is_cpu else None)
            buckets[(p.device, dtype, grad.dtype, master_weights and dtype in _REDUCED, host_step)].append(p)
        return buckets

    def _where(self, group: dict, p: torch.Tensor) -> str:
        g = next(i for i, other in enumerate(self.param_groups) if other is group)
        i = next(i for i, other in enumerate(group["params"]) if other is p)
        return f"param_groups[{g}]['params'][{i}]"

    def _check_layout(self, group: dict, p: torch.Tensor) -> None:
        """Dense layouts (channels-last, ...) are stepped over their storage: the parameter must
        be dense and its gradient laid out alike."""
        where = self._where(group, p)
        if not checks.is_dense(p):
            raise ValueError(
                f"{self._name()}: {where} is not contiguous and not dense (a strided view, shape "
                f"{tuple(p.shape)} strides {p.stride()}); optimize the tensor it views, or a contiguous copy"
            )
        if not (p.is_contiguous() and p.grad.is_contiguous()) and p.grad.stride() != p.stride():
            raise ValueError(
                f"{self._name()}: {where} has strides {p.stride()} but its gradient has {p.grad.stride()}; "
                "a non-contiguous parameter needs a gradient of the same layout"
            )

    def _refuse_meta(self, group: dict, p: torch.Tensor):
        where = self._where(group, p)
        devices = sorted({str(q.device) for q in group["params"]} | {str(p.grad.device)})
        raise ValueError(
            f"{self._name()}: {where} is on the meta device (or its gradient is): "
            f"it has no data to update (devices in this group: {', '.join(devices)}); "
            "materialize it (e.g. module.to_empty(device=...)) before building the optimizer"
        )

    def _state(self, p: torch.Tensor, *names: str) -> dict:
        """The parameter's state, made on first use (each part that is missing): a step, fp32
        zeros for ``names`` in the parameter's layout, a master copy."""
        state = self.state[p]
        if "step" not in state:
            on_device = self.capturable and p.device.type != "cpu"
            state["step"] = torch.full(
                (), float(self.initial_step), dtype=torch.float32, device=p.device if on_device else "cpu"
            )
        for name in names:
            if name not in state:
                state[name] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        if self.master_weights and p.dtype in _REDUCED:
            self._master_param(p)
        return state

    def _master_param(self, p: torch.Tensor) -> torch.Tensor:
        """The parameter's fp32 master copy in its state, made from the parameter on first use."""
        state = self.state[p]
        master = state.get("master_param")
        if master is None:
            master = state["master_param"] = p.detach().float().clone(memory_format=torch.preserve_format)
        return master

    def _bucket_inputs(self, group: dict, scaler, *state_names: str) -> Iterator[_Bucket]:
        """Per bucket of ``group``, what its op call takes; the states ``state_names`` are made on first use."""
        for (device, _, _, has_master, _), params in self._buckets(group).items():
            lr, lr_tensor = self._lr(group, device)
            grad_scale, found_inf = scaler.on(device)
            states = [self._state(p, *state_names) for p in params]
            masters = self._masters(params, states, has_master)
            yield _Bucket(device, params, states, state_names, masters, lr, lr_tensor, grad_scale, found_inf)

    def _advance(self, states: list[dict], device: torch.device, found_inf: torch.Tensor | None):
        step, step_tensor = self._advance_steps(states, device, found_inf)
        # the group's step for upstream's group["step"]: the highest host count, else a device count
        if step_tensor is not None:
            if not isinstance(self._stepped, torch.Tensor):
                self._stepped = step_tensor
        elif self._stepped is None or (not isinstance(self._stepped, torch.Tensor) and step > self._stepped):
            self._stepped = step
        return step, step_tensor

    @staticmethod
    def _advance_steps(states: list[dict], device: torch.device, found_inf: torch.Tensor | None):
        """Count one more step for a bucket; return (host step, device step tensor or None).

        Steps live on the host (no sync to read) unless the optimizer is capturable or a
        GradScaler hands over found_inf: then they move to the device and a skipped step is not
        counted, without a sync.
        """
        steps = [s["step"] for s in states]
        if found_inf is None and all(t.is_cpu for t in steps):
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

    @classmethod
    def of(cls, optimizer, grad_scaler) -> _ScalerInputs:
        """What ``torch.amp.GradScaler`` hands over: ``grad_scale``/``found_inf`` set on the
        optimizer, or (upstream's protocol, for ``step(grad_scaler=)``) the scaler itself, read
        as torch reads it for optimizers that unscale in their step."""
        if grad_scaler is None or not grad_scaler.is_enabled():
            return cls(getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None))
        from torch.amp.grad_scaler import OptState

        state = grad_scaler._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            grad_scaler._check_inf_per_device(optimizer)
        scale = grad_scaler._get_scale_async()
        found = [t.to(scale.device, non_blocking=True) for t in state["found_inf_per_device"].values()]
        found_inf = torch.stack(found).sum() if found else None
        return cls(None if state["stage"] is OptState.UNSCALED else scale, found_inf)

    def on(self, device: torch.device):
        if device not in self._cache:

            def move(t):
                return None if t is None else t.to(device=device, dtype=torch.float32, non_blocking=True).reshape(1)

            self._cache[device] = (move(self.grad_scale), move(self.found_inf))
        return self._cache[device]


def grads_of(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params]


__all__ = ["DEFAULT_CHUNK_SIZE", "FusedOptimizer", "_ops", "check_hyperparameters", "grads_of", "required"]
