"""Upstream Apex's ``apex._autocast_utils`` (NeMo and Megatron import it).

The pattern of a fused module under autocast: cast the arguments with
:func:`_cast_if_autocast_enabled`, then run the function with autocast disabled. As upstream's,
only CUDA autocast counts: under ``torch.autocast("cpu")`` the arguments are returned unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _get_autocast_dtypes() -> Sequence[torch.dtype]:
    """The dtypes CUDA autocast can run in here: fp16, and bf16 where the GPU supports it."""
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return [torch.half, torch.bfloat16]
    return [torch.half]


def _get_current_dtype(dtype: torch.dtype | None = None) -> torch.dtype:
    """CUDA autocast's dtype when it is enabled, else float32 (``dtype`` is ignored, as upstream's)."""
    if not torch.is_autocast_enabled("cuda"):
        return torch.float
    return torch.get_autocast_dtype("cuda")


def _cast_if_autocast_enabled(*args):
    """``args`` with their CUDA floating tensors (not float64; inside tuples, lists and dicts too)
    cast to CUDA autocast's dtype when it is enabled; ``args`` unchanged otherwise."""
    if not torch.is_autocast_enabled("cuda"):
        return args
    return torch.amp.autocast_mode._cast(args, "cuda", torch.get_autocast_dtype("cuda"))
