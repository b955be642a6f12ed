"""apex.contrib.index_mul_2d: a row gather fused with an element-wise product.

``index_mul_2d(in1, in2, idx1)`` returns ``out`` with ``out[i] = in1[idx1[i]] * in2[i]`` for
``in1 [N1, F]``, ``in2 [N2, F]`` and int64 ``idx1 [N2]``, differentiable twice in ``in1`` and
``in2`` (as upstream Apex's). Importing it registers the ops
(``torch.ops.apex_contrib_index_mul_2d.*``); the package also installs upstream's top-level
extension module ``fused_index_mul_2d`` on them.
"""

from __future__ import annotations

import torch

from apex.contrib.index_mul_2d import _ops

__all__ = ["index_mul_2d"]


def index_mul_2d(in1: torch.Tensor, in2: torch.Tensor, idx1: torch.Tensor) -> torch.Tensor:
    """``in1[idx1] * in2``: row ``i`` of the result is row ``idx1[i]`` of ``in1`` times row ``i`` of ``in2``.

    Args:
        in1: ``[N1, F]``, float32, float16, bfloat16 or float64.
        in2: ``[N2, F]``, in1's dtype and device.
        idx1: ``[N2]`` int64, every value in ``[0, N1)``. Unlike PyTorch's indexing, a negative
            index is out of range, not counted from the end.

    Non-contiguous arguments are made contiguous (as upstream). Products are computed in float32
    for 16-bit inputs and rounded once. Differentiable in ``in1`` and ``in2``, twice (the
    gradient's own gradient, e.g. forces from an energy, as upstream); a third derivative raises.
    The gradient of ``in1`` sums the rows sharing an index with atomics on CUDA (in float32 for
    16-bit inputs), so its last bits can differ between runs. ``torch.compile(fullgraph=True)``
    traces it as the op ``torch.ops.apex_contrib_index_mul_2d.index_mul_2d``.
    """
    return _ops.differentiable_index_mul_2d(in1.contiguous(), in2.contiguous(), idx1.contiguous())
