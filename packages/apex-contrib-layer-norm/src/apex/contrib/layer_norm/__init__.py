"""apex.contrib.layer_norm: upstream Apex's ``FastLayerNorm`` and ``FastLayerNormFN``, on
apex-normalization's layer norm kernels (``torch.ops.apex_normalization``), for every hidden size."""

from apex.contrib.layer_norm.layer_norm import FastLayerNorm, FastLayerNormFN

__all__ = ["FastLayerNorm", "FastLayerNormFN"]
