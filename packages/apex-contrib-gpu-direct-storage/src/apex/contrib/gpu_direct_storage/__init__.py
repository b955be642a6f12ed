"""apex.contrib.gpu_direct_storage: an example op, scale, from tools/new_package.py (replace it).

Importing it registers its ops (``torch.ops.apex_contrib_gpu_direct_storage.*``).
"""

from __future__ import annotations

import torch

from apex.contrib.gpu_direct_storage import _ops

__all__ = ["scale"]


def scale(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """Return ``x * alpha``, computed in float32 and rounded once to ``x``'s dtype.

    Args:
        x: a contiguous float32, float16 or bfloat16 tensor, on any device.
        alpha: the factor, a finite Python float.

    Differentiable in ``x``; ``torch.compile(fullgraph=True)`` traces it as the op
    ``torch.ops.apex_contrib_gpu_direct_storage.scale``.
    """
    return _ops.differentiable_scale(x, alpha)
