"""apex.fused_dense: FusedDense and FusedDenseGeluDense on cuBLASLt epilogues, and Megatron's fused
weight-gradient accumulation (the top-level module ``fused_weight_gradient_mlp_cuda``).

Importing it registers its ops (``torch.ops.apex_fused_dense.*``).
"""

from __future__ import annotations

from apex.fused_dense import _ops  # noqa: F401  (registers the ops)
from apex.fused_dense.fused_dense import (
    FusedDense,
    FusedDenseGeluDense,
    dense_no_bias_function,
    fused_dense_function,
    fused_dense_gelu_dense_function,
)

__all__ = [
    "FusedDense",
    "FusedDenseGeluDense",
    "dense_no_bias_function",
    "fused_dense_function",
    "fused_dense_gelu_dense_function",
]
