"""Process-wide amp state (upstream's ``apex.amp._amp_state``) and the helpers everything shares.

``amp.initialize`` fills it: the options in force, one loss scaler per loss, and the optimizers it
prepared. ``amp.scale_loss``, ``amp.state_dict`` and ``amp.load_state_dict`` read it.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Iterator

import torch


class AmpState:
    def __init__(self) -> None:
        # Turn the consistency errors of the options into warnings (upstream's escape hatch).
        self.hard_override = False
        # Accept models whose parameters are not fp32 on the way in.
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1
        self.opt_properties = None
        self.loss_scalers: list = []
        self.min_loss_scale: float | None = None
        self.max_loss_scale: float = 2.0**24
        # AmpOptimizerState of every optimizer prepared by initialize (for model load hooks).
        self.optimizer_states: weakref.WeakSet = weakref.WeakSet()


_amp_state = AmpState()


def warn_or_err(msg: str) -> None:
    """Raise ``RuntimeError(msg)``, or only warn when ``_amp_state.hard_override`` is set."""
    if _amp_state.hard_override:
        warnings.warn("Warning: " + msg, stacklevel=3)
    else:
        raise RuntimeError(msg)


def _is_rank0() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def maybe_print(msg: str, rank0: bool = False, level: int = 1) -> None:
    """Print when ``verbosity >= level`` (and, with ``rank0``, only on rank 0 of a process group)."""
    if _amp_state.verbosity >= level and (not rank0 or _is_rank0()):
        print(msg)


def is_optimizer(obj) -> bool:
    """A ``torch.optim.Optimizer``, or apex.parallel's ``LARC`` wrapper around one.

    apex-parallel is optional: a LARC instance implies its module is already imported.
    """
    if isinstance(obj, torch.optim.Optimizer):
        return True
    module = sys.modules.get("apex.parallel.LARC")
    larc = getattr(module, "LARC", None)
    return larc is not None and isinstance(obj, larc)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every parameter ``optimizer`` steps, group by group: the ones whose ``.grad`` to clip.

    After ``amp.initialize`` with master weights these are the fp32 masters for a ``torch.optim``
    optimizer, and after the ``amp.scale_loss`` block their gradients are unscaled fp32. With
    apex-optimizers' own master-weight path (see ``amp.initialize``) they are the model's
    bf16/fp16 parameters, whose gradients the ``scale_loss`` block left unscaled as well.
    """
    for group in optimizer.param_groups:
        yield from group["params"]
