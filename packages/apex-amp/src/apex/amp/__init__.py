"""apex.amp: automatic mixed precision with upstream Apex's API.

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

Opt levels O0-O3, overrides, dynamic loss scaling per loss on the device (apex-core's
multi-tensor ops), fp32 master weights, bf16 as well as fp16, and checkpoints through
``amp.state_dict()``/``amp.load_state_dict()``. See :func:`initialize` and :func:`scale_loss`.
"""

from apex.amp._amp_state import _amp_state, master_params
from apex.amp.amp import (
    AmpHandle,
    NoOpHandle,
    float_function,
    half_function,
    init,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from apex.amp.casting import disable_casts
from apex.amp.checkpoint import load_state_dict, state_dict
from apex.amp.frontend import initialize
from apex.amp.handle import scale_loss
from apex.amp.scaler import LossScaler

__all__ = [
    "AmpHandle",
    "LossScaler",
    "NoOpHandle",
    "_amp_state",
    "disable_casts",
    "float_function",
    "half_function",
    "init",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]
