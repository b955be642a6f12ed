"""The options amp runs with (:class:`Properties`) and the four presets O0-O3, as a table.

A preset fills every option; ``amp.initialize``'s keyword arguments then override single options,
and each assignment is checked against the level in force, as upstream Apex does.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from apex.amp._amp_state import warn_or_err

HALF_DTYPES = (torch.float16, torch.bfloat16)
MODEL_DTYPES = (torch.float32, *HALF_DTYPES)


class Properties:
    """The option set of one ``amp.initialize`` call; options read and write as attributes.

    ``autocast_dtype`` is this package's addition to upstream's options: the dtype O1 casts to
    (``torch.float16`` or ``torch.bfloat16``); it is None at the other levels, whose model dtype
    is ``cast_model_type``.
    """

    def __init__(self) -> None:
        self.options = {
            "enabled": False,
            "opt_level": None,
            "cast_model_type": None,
            "patch_torch_functions": False,
            "keep_batchnorm_fp32": None,
            "master_weights": None,
            "loss_scale": 1.0,
            "autocast_dtype": None,
        }

    def __getattr__(self, name):
        options = self.__dict__.get("options")
        if options is not None and name in options:
            return options[name]
        raise AttributeError(f"'Properties' object has no attribute '{name}'")

    def __setattr__(self, name, value):
        options = self.__dict__.get("options")
        if options is None or name not in options:
            super().__setattr__(name, value)
            return
        level = options["opt_level"]
        if name == "cast_model_type":
            if level == "O1" and value is not None and value is not False and value is not torch.float32:
                warn_or_err(
                    "O1 inserts casts around Torch functions rather than model weights, so with O1 the model "
                    "weights themselves should remain FP32. To cast the model itself, use opt_level='O2' or "
                    f"'O3'; to choose O1's cast dtype, use autocast_dtype. cast_model_type was {value}"
                )
            if value is not None and value is not False and value not in MODEL_DTYPES:
                raise TypeError(f"cast_model_type must be torch.float16, torch.bfloat16 or torch.float32, got {value}")
        elif name == "patch_torch_functions":
            if level != "O1" and value:
                warn_or_err("Currently, patch_torch_functions=True should only be set by selecting opt_level='O1'.")
        elif name == "keep_batchnorm_fp32":
            if level == "O1" and value is not None:
                warn_or_err(
                    "With opt_level O1, batchnorm functions are automatically patched to run in FP32, so "
                    f"keep_batchnorm_fp32 should be None. keep_batchnorm_fp32 was {value}"
                )
            if value == "False":
                value = False
            elif value == "True":
                value = True
            if value not in (True, False, None):
                raise ValueError(
                    "keep_batchnorm_fp32 must be a boolean, the string 'True' or 'False', or None, "
                    f"found keep_batchnorm_fp32={value}"
                )
        elif name == "master_weights":
            if level == "O1" and value is not None:
                warn_or_err(
                    "It doesn't make sense to use master_weights with O1. With O1, your model weights "
                    "themselves should be FP32."
                )
        elif name == "loss_scale":
            if value != "dynamic":
                try:
                    number = float(value)
                except (TypeError, ValueError):
                    number = math.nan
                if not 0.0 < number < math.inf:
                    raise ValueError(f"loss_scale must be 'dynamic' or a positive finite number, got {value!r}")
                if number < torch.finfo(torch.float32).tiny:
                    raise ValueError(
                        f"loss_scale={value!r} is below fp32's smallest normal number: 1/loss_scale is inf in fp32, "
                        "so the gradients could not be unscaled"
                    )
                value = number
        elif name == "autocast_dtype":
            if level != "O1" and value is not None:
                warn_or_err(
                    "autocast_dtype chooses the dtype O1 casts functions to; with O0, O2 and O3 the model "
                    f"itself is cast, so use cast_model_type. autocast_dtype was {value}"
                )
            if value is not None and value not in HALF_DTYPES:
                raise TypeError(f"autocast_dtype must be torch.float16 or torch.bfloat16, got {value}")
        options[name] = value

    def half_dtype(self) -> torch.dtype | None:
        """The reduced-precision dtype this configuration computes in, if any."""
        if self.patch_torch_functions and self.autocast_dtype is not None:
            return self.autocast_dtype
        if self.cast_model_type in HALF_DTYPES:
            return self.cast_model_type
        return None


class OptLevel(NamedTuple):
    """One preset: how ``amp.initialize`` describes it, and the value it gives every option."""

    brief: str
    more: str
    options: dict

    def __call__(self, properties: Properties) -> Properties:
        # opt_level is set before the rest: each later assignment is checked against it.
        for name, value in self.options.items():
            setattr(properties, name, value)
        return properties


_COLUMNS = (
    "cast_model_type",
    "patch_torch_functions",
    "keep_batchnorm_fp32",
    "master_weights",
    "loss_scale",
    "autocast_dtype",
)

# fmt: off
_PRESETS = {
    #      cast_model_type  patch_torch_functions  keep_batchnorm_fp32  master_weights  loss_scale  autocast_dtype
    "O0": (torch.float32,   False,                 None,                False,          1.0,        None),
    "O1": (None,            True,                  None,                None,           "dynamic",  torch.float16),
    "O2": (torch.float16,   False,                 True,                True,           "dynamic",  None),
    "O3": (torch.float16,   False,                 False,               False,          1.0,        None),
}
# fmt: on

_DESCRIPTIONS = {
    "O0": (
        "Pure FP32 training.",
        "The model and its inputs are FP32 and the loss is not scaled: an accuracy baseline\n"
        "to compare the other levels against.\n",
    ),
    "O1": (
        "Insert automatic casts around PyTorch functions and Tensor methods.",
        "The model's weights stay FP32. Each model's forward runs under torch.autocast, which runs\n"
        "tensor-core-friendly operations (matmul, convolution) in FP16 and precision-sensitive ones\n"
        "(softmax, norms, losses) in FP32; outputs come back FP32. The loss is scaled dynamically.\n",
    ),
    "O2": (
        "FP16 training with FP32 batchnorm and FP32 master weights.",
        "Casts the model to FP16 except batchnorm layers, which stay FP32; casts floating-point inputs\n"
        "to FP16 and outputs back to FP32; keeps FP32 master weights that the optimizer updates and\n"
        "copies into the model after each step; scales the loss dynamically.\n",
    ),
    "O3": (
        "Pure FP16 training.",
        "Calls .half() on your model, converting the entire model (batchnorm included) to FP16,\n"
        "with a static loss scale of 1.0. A speed baseline: O2 is usually as fast and more stable.\n",
    ),
}


def _preset(level: str, values: tuple) -> OptLevel:
    summary, more = _DESCRIPTIONS[level]
    return OptLevel(f"{level}:  {summary}", more, {"enabled": True, "opt_level": level, **dict(zip(_COLUMNS, values))})


opt_levels = {level: _preset(level, values) for level, values in _PRESETS.items()}
