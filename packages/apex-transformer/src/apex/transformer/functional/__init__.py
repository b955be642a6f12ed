"""Upstream Apex's ``apex.transformer.functional``: the fused scale-mask softmax family and the
fused rotary positional embeddings, on ``torch.ops.apex_transformer``; and ``fused_swiglu`` (ours: not
in upstream Apex)."""

from apex.transformer.functional.fused_rope import (
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_2d,
    fused_apply_rotary_pos_emb_cached,
    fused_apply_rotary_pos_emb_thd,
)
from apex.transformer.functional.fused_softmax import (
    FusedScaleMaskSoftmax,
    GenericFusedScaleMaskSoftmax,
    generic_scaled_masked_softmax,
    scaled_masked_softmax,
    scaled_softmax,
    scaled_upper_triang_masked_softmax,
)
from apex.transformer.functional.fused_swiglu import fused_swiglu

__all__ = [
    "FusedScaleMaskSoftmax",
    "GenericFusedScaleMaskSoftmax",
    "fused_apply_rotary_pos_emb",
    "fused_apply_rotary_pos_emb_2d",
    "fused_apply_rotary_pos_emb_cached",
    "fused_apply_rotary_pos_emb_thd",
    "fused_swiglu",
    "generic_scaled_masked_softmax",
    "scaled_masked_softmax",
    "scaled_softmax",
    "scaled_upper_triang_masked_softmax",
]
