"""apex.fp16_utils: manual mixed precision (upstream Apex's fp16_utils).

``FP16_Optimizer`` wraps an optimizer built on a half-precision model with fp32 master weights
and a static or dynamic loss scale; the helpers cast networks and copy between model and
master parameters. ``apex.amp`` does all of this automatically and is the recommended API.
"""

from apex.fp16_utils.fp16_optimizer import FP16_Optimizer
from apex.fp16_utils.fp16util import (
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)
from apex.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler

__all__ = [
    "BN_convert_float",
    "DynamicLossScaler",
    "FP16Model",
    "FP16_Optimizer",
    "LossScaler",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]
