"""apex.transformer: the attention-side kernels Megatron-Core and NeMo import from Apex.

- :mod:`apex.transformer.functional`: ``FusedScaleMaskSoftmax`` / ``GenericFusedScaleMaskSoftmax``
  and the fused softmax functions (``softmax(scale * x + mask)`` over the last dimension, causal or
  padding masks), and the fused rotary positional embeddings (``fused_apply_rotary_pos_emb`` and
  its cached, ``thd`` and 2-D variants); ``fused_swiglu``, the gated activation of Llama-style MLPs
  (not in upstream Apex);
- :mod:`apex.transformer.enums`: ``AttnMaskType`` and the other enums upstream had there.

Importing it registers the ops (``torch.ops.apex_transformer.*``). The package also installs
upstream's top-level extension modules: ``scaled_upper_triang_masked_softmax_cuda``,
``scaled_masked_softmax_cuda``, ``scaled_softmax_cuda``, ``generic_scaled_masked_softmax_cuda`` and
``fused_rotary_positional_embedding``, calling these ops (so they also run on the CPU).
"""

from __future__ import annotations

from apex.transformer import _ops, enums, functional  # noqa: F401
from apex.transformer.enums import AttnMaskType

__all__ = ["AttnMaskType", "enums", "functional"]
