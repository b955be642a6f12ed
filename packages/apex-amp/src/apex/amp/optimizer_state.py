"""What ``amp.initialize`` does to an optimizer: master weights, gradient unscaling, the skipped step.

Each optimizer gets an :class:`AmpOptimizerState` (``optimizer._amp_stash``) and instance-level
``step``, ``zero_grad`` and ``add_param_group`` wrappers. Master weights take one of two forms:

* **amp's masters** (any ``torch.optim`` optimizer, and fp16 with loss scaling): as upstream, the
  optimizer's groups hold fp32 master copies of the model's fp16/bf16 parameters; at the end of
  ``amp.scale_loss`` the model's gradients are unscaled into the masters' fp32 ``.grad`` and
  after each step the masters are copied (rounded) into the model. The masters travel in the
  optimizer's ``state_dict()`` under ``"amp_master_params"``.
* **the optimizer's own masters** (an apex-optimizers fused optimizer that supports
  ``master_weights``, when the unscaled gradients are exact in the model's dtype: bf16 weights, or
  no loss scaling): the groups keep the model's parameters, the optimizer keeps fp32 masters in
  its state and updates them and the model in one kernel; gradients are unscaled in place.

Between two ``amp.scale_loss`` blocks without a step, the masters accumulate (as the model's
gradients would); a model gradient cleared or replaced in between (``model.zero_grad()``,
``p.grad = None``) clears its master's gradient too. Zeroing the model's gradients in place
(``set_to_none=False``) is not seen: use ``optimizer.zero_grad()``, which clears both.
Sparse COO gradients are unscaled as ``torch.amp.GradScaler`` does: coalesced, in place (into a
sparse fp32 copy for amp's masters).

A step after an overflow is skipped: optimizers that take ``found_inf`` through the
GradScaler protocol (``_step_supports_amp_scaling``: apex-optimizers' fused optimizers,
``torch.optim`` with ``fused=True``) skip it on the device without a host sync; for any other
optimizer the overflow flag is read on the host once per step, as upstream did.
"""

from __future__ import annotations

import inspect
import sys
import types
import weakref

import torch

from apex.amp._amp_state import _amp_state, maybe_print
from apex.amp._multi_tensor import copy_into

_HALF = (torch.float16, torch.bfloat16)


def _fused_optimizer_base():
    """apex-optimizers' base class if that package is already imported (an instance implies it is)."""
    module = sys.modules.get("apex.optimizers._base")
    return getattr(module, "FusedOptimizer", None)


def supports_own_master_weights(optimizer: torch.optim.Optimizer) -> bool:
    base = _fused_optimizer_base()
    if base is None or not isinstance(optimizer, base):
        return False
    if getattr(optimizer, "master_weights", False):
        return True
    return "master_weights" in inspect.signature(type(optimizer).__init__).parameters


def _add_after_unscale(param: torch.Tensor, existing: torch.Tensor, fresh: torch.Tensor, additions: list) -> None:
    """``param.grad`` becomes ``existing + fresh`` once ``fresh`` is unscaled (an in-place add on the
    dense one of the two: torch adds sparse into dense, not dense into sparse)."""
    if existing.is_sparse and not fresh.is_sparse:
        existing, fresh = fresh, existing
    param.grad = existing
    additions.append((existing, fresh))


class AmpOptimizerState:
    """amp's bookkeeping for one optimizer (``optimizer._amp_stash``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, amp_masters: bool, own_masters: bool):
        self.optimizer = optimizer
        self.amp_masters = amp_masters
        self.own_masters = own_masters
        self.model_of: dict[torch.Tensor, torch.Tensor] = {}  # amp master -> model parameter
        self.grads_are_scaled = False  # a delay_unscale backward left scaled gradients
        self.found_inf: torch.Tensor | None = None  # overflow seen since the last step (fp32, device)
        # param -> its (unscaled) gradient from before a backward, set aside so that the backward
        # writes a fresh one that can be unscaled alone; added back afterwards.
        self.stashed: dict[torch.Tensor, torch.Tensor] = {}
        self.sync_free = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self.checked_losses: dict = {}  # loss_id -> scaler, for the message of a skipped step
        self._loaded_masters: dict | None = None
        # model parameter (with an amp master) -> a weak reference to the gradient amp left in its
        # .grad after the last unscale (None: it had none). A gradient since cleared or replaced
        # (model.zero_grad(), p.grad = None) clears the master's accumulated gradient too.
        self.left_grads: dict[torch.Tensor, weakref.ref | None] = {}

    # --- parameters ------------------------------------------------------------------------

    def params(self):
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def describe(self, stepped: torch.Tensor) -> str:
        """Where ``stepped`` sits in the optimizer, for error messages."""
        for g, group in enumerate(self.optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if p is stepped:
                    what = f"{type(self.optimizer).__name__}.param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)})"
                    if stepped in self.model_of:
                        what += f", the fp32 master of a {self.model_of[stepped].dtype} model parameter"
                    return what
        return f"a parameter of shape {tuple(stepped.shape)}"

    def _checked(self, grad: torch.Tensor, stepped: torch.Tensor) -> torch.Tensor:
        """``grad`` if amp can unscale it: dense or sparse COO, with data (not on the meta device)."""
        if grad.is_meta:
            raise ValueError(
                f"amp.scale_loss: the gradient of {self.describe(stepped)} is on the meta device; meta tensors are "
                "not supported (materialize the parameters, e.g. with module.to_empty(device=...), before training)"
            )
        if grad.layout not in (torch.strided, torch.sparse_coo):
            raise ValueError(
                f"amp.scale_loss: the gradient of {self.describe(stepped)} has layout {grad.layout}; amp unscales "
                "dense (strided) and sparse COO gradients"
            )
        return grad

    def grad_pairs(self):
        """(model parameter, parameter the optimizer steps) for every parameter of the optimizer."""
        for p in self.params():
            yield self.model_of.get(p, p), p

    def master_pairs(self):
        """(model parameter, fp32 master) for every master, whichever form the masters take."""
        if self.amp_masters:
            for master, model in self.model_of.items():
                yield model, master
        elif self.own_masters:
            for p in self.params():
                master = self.optimizer.state.get(p, {}).get("master_param")
                if master is not None:
                    yield p, master

    def make_masters(self, group: dict) -> None:
        """Replace the group's fp16/bf16 parameters by fp32 masters (moving their optimizer state)."""
        params = group["params"]
        for i, p in enumerate(params):
            if p.dtype not in _HALF or p in self.model_of:
                continue
            master = torch.nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
            params[i] = master
            self.model_of[master] = p
            if p in self.optimizer.state:
                state = self.optimizer.state.pop(p)
                self.optimizer.state[master] = {
                    k: v.float() if isinstance(v, torch.Tensor) and v.dtype in _HALF else v for k, v in state.items()
                }

    # --- backward ---------------------------------------------------------------------------

    def prepare_backward(self, unscale_own_grads: bool) -> None:
        """Before a backward whose gradients will be unscaled: set aside the gradients that must not be rescaled."""
        if self.grads_are_scaled:
            return
        left_grads = self.left_grads
        for model, stepped in self.grad_pairs():
            if model is not stepped:
                left = left_grads.get(model)
                if left is not None:
                    current = left()  # None once the gradient amp left was released
                    if current is None or current is not model.grad:
                        stepped.grad = None  # the model's gradient was cleared since amp left it
                model.grad = None  # fresh model gradient; the master keeps what it accumulated
            elif unscale_own_grads and stepped.grad is not None:
                self.stashed[stepped] = stepped.grad
                stepped.grad = None

    def collect_unscale(self, inputs: list, outputs: list, additions: list, unscale_own_grads: bool) -> None:
        """After the backward: the (input, output) pairs to unscale and the (target, addend) sums to finish."""
        stashed = self.stashed
        for model, stepped in self.grad_pairs():
            if model is not stepped:
                grad = model.grad
                self.left_grads[model] = None if grad is None else weakref.ref(grad)
                if grad is None:
                    continue
                if self._checked(grad, stepped).is_sparse:
                    # A sparse fp32 copy, duplicates summed, unscaled in place.
                    fresh = grad.float().coalesce()
                    inputs.append(fresh)
                else:
                    fresh = torch.empty_like(stepped)
                    inputs.append(grad)
                outputs.append(fresh)
                if stepped.grad is None:
                    stepped.grad = fresh
                else:
                    _add_after_unscale(stepped, stepped.grad, fresh, additions)
            elif unscale_own_grads:
                old = stashed.pop(stepped, None)
                grad = stepped.grad
                if grad is None:
                    if old is not None:
                        stepped.grad = old
                    continue
                if self._checked(grad, stepped).is_sparse:
                    grad = stepped.grad = grad.coalesce()  # unscaled in place, duplicates summed
                inputs.append(grad)
                outputs.append(grad)
                if old is not None:
                    _add_after_unscale(stepped, old, grad, additions)
        stashed.clear()

    def restore_after_failed_backward(self) -> None:
        for param, grad in self.stashed.items():
            param.grad = grad
        self.stashed.clear()

    def note_overflow(self, found_inf: torch.Tensor, loss_id: int, scaler) -> None:
        """Remember a dynamic loss's overflow flag (on the device) for the next step."""
        if self.found_inf is None:
            self.found_inf = found_inf.clone()
        else:
            self.found_inf = torch.maximum(self.found_inf, found_inf.to(self.found_inf.device))
        self.checked_losses[loss_id] = scaler

    # --- after the step ---------------------------------------------------------------------

    def masters_to_model(self) -> None:
        if self.model_of:
            with torch.no_grad():
                models, masters = zip(*((model, master) for master, model in self.model_of.items()))
                copy_into(list(masters), list(models))

    def drop_master_grads(self) -> None:
        for master in self.model_of:
            master.grad = None


# --- the optimizer's wrapped methods ----------------------------------------------------------


def _step(self, closure=None):
    if closure is not None:
        raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
    stash: AmpOptimizerState = self._amp_stash
    found_inf, stash.found_inf = stash.found_inf, None
    checked, stash.checked_losses = stash.checked_losses, {}
    if found_inf is not None and not stash.sync_free:
        if found_inf.item():  # the one host read per step of an optimizer that cannot skip on the device
            if _amp_state.verbosity >= 1:
                scales = ", ".join(f"loss scaler {i}: {s.loss_scale()}" for i, s in sorted(checked.items()))
                maybe_print(f"Gradient overflow.  Skipping step; loss scale now {scales}", rank0=True)
            stash.drop_master_grads()
            return None
        found_inf = None
    if found_inf is None:
        result = stash.original_step()
    else:
        self.found_inf = found_inf.reshape(())  # 0-dim, as torch.amp.GradScaler hands it over
        try:
            result = stash.original_step()
        finally:
            del self.found_inf
    if stash.amp_masters:
        stash.masters_to_model()
        stash.drop_master_grads()
    return result


def _zero_grad(self, *args, **kwargs):
    stash: AmpOptimizerState = self._amp_stash
    result = stash.original_zero_grad(*args, **kwargs)
    set_to_none = kwargs.get("set_to_none", args[0] if args else None)
    if set_to_none is None:
        set_to_none = getattr(self, "set_grad_none", True)
    for model in stash.model_of.values():
        if set_to_none:
            model.grad = None
        elif model.grad is not None:
            model.grad.detach_()
            model.grad.zero_()
    stash.drop_master_grads()
    stash.grads_are_scaled = False
    return result


def _add_param_group(self, param_group):
    stash: AmpOptimizerState = self._amp_stash
    result = stash.original_add_param_group(param_group)
    if stash.amp_masters:
        stash.make_masters(self.param_groups[-1])
    return result


def process_optimizer(optimizer: torch.optim.Optimizer, properties) -> torch.optim.Optimizer:
    """Prepare ``optimizer`` (already holding the cast model's parameters) for amp; returns it."""
    from apex.amp.checkpoint import attach_optimizer_hooks

    if hasattr(optimizer, "_amp_stash"):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")
    own_masters = False
    amp_masters = False
    if properties.master_weights:
        half = properties.half_dtype()
        exact_in_model_dtype = half == torch.bfloat16 or properties.loss_scale == 1.0
        own_masters = exact_in_model_dtype and supports_own_master_weights(optimizer)
        amp_masters = not own_masters
    stash = AmpOptimizerState(optimizer, amp_masters=amp_masters, own_masters=own_masters)
    optimizer._amp_stash = stash
    stash.original_step = optimizer.step
    stash.original_zero_grad = optimizer.zero_grad
    stash.original_add_param_group = optimizer.add_param_group
    if own_masters:
        optimizer.master_weights = True
        for p in stash.params():
            state = optimizer.state.get(p)
            if state and p.dtype in _HALF and "master_param" not in state:
                state["master_param"] = p.detach().float().clone(memory_format=torch.contiguous_format)
    if amp_masters:
        for group in optimizer.param_groups:
            stash.make_masters(group)
    optimizer.step = types.MethodType(_step, optimizer)
    optimizer.zero_grad = types.MethodType(_zero_grad, optimizer)
    optimizer.add_param_group = types.MethodType(_add_param_group, optimizer)
    attach_optimizer_hooks(optimizer)
    _amp_state.optimizer_states.add(stash)
    form = "amp's fp32 masters" if amp_masters else "the optimizer's own fp32 masters" if own_masters else "none"
    skip = "on the device (found_inf)" if stash.sync_free else "after one host read per step"
    maybe_print(f"{type(optimizer).__name__}: master weights: {form}; overflow steps skipped {skip}", True, level=2)
    return optimizer
