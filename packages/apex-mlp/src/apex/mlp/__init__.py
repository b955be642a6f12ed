"""apex.mlp: a multi-layer perceptron whose forward and backward are one op each, on cuBLASLt GEMMs
with fused bias and activation epilogues.

Importing it registers its ops (``torch.ops.apex_mlp.mlp_forward`` and ``mlp_backward``).
"""

from __future__ import annotations

from apex.mlp.mlp import MLP, MlpFunction, mlp_function

__all__ = ["MLP", "MlpFunction", "mlp_function"]
