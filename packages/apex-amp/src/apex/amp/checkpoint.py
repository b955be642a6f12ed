"""Checkpoints: amp's own state, and the hooks that keep model and optimizer state dicts whole.

Upstream's workflow resumes bitwise::

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    ...
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}, path)
    # later, in a new process:
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])

* ``amp.state_dict()`` holds each loss scaler's scale and counters.
* A cast model's ``state_dict()`` gives fp32 tensors (so it also loads into an fp32 model); loading
  it into the cast model rounds them back, exactly.
* The fp32 master weights travel with the optimizer: in its state (the optimizer's own masters) or
  under ``"amp_master_params"`` (amp's masters), and are restored exactly; masters are never
  rebuilt from the rounded model unless the checkpoint has none.
* Loading a model after ``amp.initialize`` refreshes the masters of the parameters it changed, so
  the model can be loaded before or after the optimizer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import torch

from apex.amp._amp_state import _amp_state, maybe_print
from apex.amp.scaler import LossScaler

MASTERS_KEY = "amp_master_params"


# --- amp's state --------------------------------------------------------------------------


def state_dict(destination: dict | None = None) -> dict:
    """``{"loss_scaler<i>": {"loss_scale", "unskipped", "hysteresis_left"}}`` for every loss (reads the device)."""
    if destination is None:
        destination = OrderedDict()
    for index, scaler in enumerate(_amp_state.loss_scalers):
        destination[f"loss_scaler{index}"] = scaler.state_dict()
    return destination


def load_state_dict(state_dict: dict) -> None:
    """Restore the loss scalers from :func:`state_dict`'s output (call after ``amp.initialize``).

    Every entry is checked before any is loaded: a missing ``loss_scale``, or one that is not a
    positive finite number (a NaN scale would skip every later step), raises and loads nothing.
    """
    properties = _amp_state.opt_properties
    if properties is None:
        raise RuntimeError(
            "amp.load_state_dict was called before amp.initialize: there are no loss scalers to load into. "
            "Call amp.initialize(models, optimizers, ...) first, then amp.load_state_dict(checkpoint['amp'])."
        )
    if not properties.enabled:
        maybe_print("amp.load_state_dict: amp was initialized with enabled=False; nothing to load")
        return
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"amp.load_state_dict expects the dict amp.state_dict() returned, got {type(state_dict).__name__}"
        )
    scalers = _amp_state.loss_scalers
    if len(state_dict) != len(scalers):
        print(f"Warning: state_dict contains {len(state_dict)} entries, while {len(scalers)} loss_scalers are used")
    unexpected = [key for key in state_dict if "loss_scaler" not in key]
    if unexpected:
        names = ", ".join(f'"{k}"' for k in unexpected)
        raise RuntimeError(f"Error(s) in loading state_dict. Unexpected key(s) in state_dict: {names}. ")
    for index, key in enumerate(state_dict):
        if index < len(scalers):
            LossScaler.checked_state(state_dict[key], f'amp.load_state_dict: state_dict["{key}"]')
    for index, key in enumerate(state_dict):
        if index >= len(scalers):
            print(f"Skipping loss_scaler[{index}], since num_losses was set to {len(scalers)}")
            break
        scalers[index].load_state_dict(state_dict[key])


# --- the model's hooks --------------------------------------------------------------------


class FloatStateDict:
    """``state_dict`` post-hook of a cast model: tensors in the cast dtype come out as fp32."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        for key, value in state_dict.items():
            if key.startswith(prefix) and isinstance(value, torch.Tensor) and value.dtype == self.dtype:
                state_dict[key] = value.float()


@torch.no_grad()
def refresh_masters(module: torch.nn.Module, incompatible_keys) -> None:
    """``load_state_dict`` post-hook: masters that no longer round to their model parameter take its value."""
    params = set(module.parameters())
    for stash in list(_amp_state.optimizer_states):
        for model, master in stash.master_pairs():
            if model in params and not torch.equal(master.to(model.dtype), model):
                master.copy_(model)


def attach_model_hooks(model: torch.nn.Module, cast_dtype: torch.dtype | None) -> None:
    previous = getattr(model, "_amp_state_hooks", [])
    for handle in previous:
        handle.remove()
    handles = [model.register_load_state_dict_post_hook(refresh_masters)]
    if cast_dtype is not None and cast_dtype != torch.float32:
        handles.append(model.register_state_dict_post_hook(FloatStateDict(cast_dtype)))
    model._amp_state_hooks = handles


# --- the optimizer's hooks ----------------------------------------------------------------


def _master_indices(optimizer):
    """(state_dict index, parameter) for every parameter of the optimizer, in state_dict order."""
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield index, p
            index += 1


def _save_masters(optimizer, state_dict: dict):
    stash = optimizer._amp_stash
    if stash.amp_masters:
        state_dict[MASTERS_KEY] = {i: p.detach() for i, p in _master_indices(optimizer) if p in stash.model_of}
    return state_dict


def _take_masters(optimizer, state_dict: dict):
    optimizer._amp_stash._loaded_masters = state_dict.pop(MASTERS_KEY, None)
    return state_dict


@torch.no_grad()
def _restore_masters(optimizer) -> None:
    stash = optimizer._amp_stash
    saved, stash._loaded_masters = stash._loaded_masters or {}, None
    if stash.amp_masters:
        for i, p in _master_indices(optimizer):
            if p in stash.model_of:
                p.copy_(saved[i] if i in saved else stash.model_of[p])
        stash.masters_to_model()
    elif stash.own_masters:
        for i, p in _master_indices(optimizer):
            state = optimizer.state.get(p)
            if state and p.dtype != torch.float32 and "master_param" not in state:
                source = saved[i] if i in saved else p
                state["master_param"] = source.detach().float().clone(memory_format=torch.contiguous_format)
    if saved and not stash.amp_masters:
        maybe_print("amp: the checkpoint's separate master weights were used where the optimizer had none")


def attach_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    optimizer.register_state_dict_post_hook(_save_masters)
    optimizer.register_load_state_dict_pre_hook(_take_masters)
    optimizer.register_load_state_dict_post_hook(_restore_masters)
