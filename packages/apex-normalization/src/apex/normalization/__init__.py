"""apex.normalization: fused layer norm and RMS norm with upstream Apex's modules and functions.

The modules are here, as upstream; the functions (``fused_layer_norm_affine``, ...,
``mixed_dtype_fused_rms_norm_affine`` and the ``fused_add_*`` residual forms) are in
``apex.normalization.fused_layer_norm`` (upstream's module) and ``apex.normalization.functional``.
"""

from apex.normalization import functional
from apex.normalization.fused_layer_norm import FusedLayerNorm, MixedFusedLayerNorm
from apex.normalization.fused_rms_norm import FusedRMSNorm, MixedFusedRMSNorm

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm", "functional"]
