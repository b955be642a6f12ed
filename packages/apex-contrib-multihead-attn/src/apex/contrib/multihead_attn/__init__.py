"""apex.contrib.multihead_attn: upstream Apex's multi-head attention modules, on public torch ops.

- ``SelfMultiheadAttn``, ``EncdecMultiheadAttn``: time-major ``[T, B, E]`` attention with upstream's
  parameters, masks and optional pre-LayerNorm + residual add; ``impl="fast"`` runs
  ``torch.nn.functional.scaled_dot_product_attention``, ``impl="default"`` explicit softmax.
- ``fast_mask_softmax_dropout_func``: masked softmax + dropout of ``[batch * heads, Tq, Tk]`` scores.

Upstream's extension module ``fast_multihead_attn`` is installed as a top-level module too.
"""

from __future__ import annotations

from apex.contrib.multihead_attn.encdec_multihead_attn import EncdecMultiheadAttn
from apex.contrib.multihead_attn.mask_softmax_dropout_func import fast_mask_softmax_dropout_func
from apex.contrib.multihead_attn.self_multihead_attn import SelfMultiheadAttn

__all__ = ["EncdecMultiheadAttn", "SelfMultiheadAttn", "fast_mask_softmax_dropout_func"]
