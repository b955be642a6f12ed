"""``fast_mask_softmax_dropout_func``: upstream Apex's fused masked softmax + dropout, on public torch ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from apex.contrib.multihead_attn import _attention

_NAME = "fast_mask_softmax_dropout_func"


def fast_mask_softmax_dropout_func(is_training, heads, inputs, pad_mask, mask_additive, dropout_prob):
    """``dropout(softmax(mask(inputs)))`` over the last dimension of attention scores.

    Args (upstream's order, all positional as there):
        is_training: apply dropout (otherwise ``dropout_prob`` is ignored).
        heads: attention heads per sequence; ``inputs``' first dimension is ``batch * heads``.
        inputs: scores ``[batch * heads, Tq, Tk]``, any float dtype, any device (upstream: fp16
            CUDA). Not scaled here. The softmax accumulates in float32 for 16-bit input.
        pad_mask: None, or ``[batch, Tk]``: bool/uint8 (nonzero = padding key, score ``-inf``)
            or, with ``mask_additive``, float (added to the scores), shared by a sequence's heads.
        mask_additive: how ``pad_mask`` is read, as above.
        dropout_prob: probability of zeroing an output; kept ones are scaled by
            ``1 / (1 - dropout_prob)``.

    Returns ``[batch * heads, Tq, Tk]`` in ``inputs``' dtype, differentiable in ``inputs`` by
    autograd (upstream: an ``autograd.Function`` over its kernels; here composite torch ops, which
    ``torch.compile(fullgraph=True)`` traces and whose dropout uses torch's generator, so
    ``torch.manual_seed`` makes it reproducible). A row whose every key is masked gives NaN.
    """
    if not isinstance(inputs, torch.Tensor) or not inputs.dtype.is_floating_point or inputs.dim() != 3:
        described = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
        raise ValueError(f"{_NAME}: inputs must be a float [batch * heads, Tq, Tk] tensor, got {described}")
    if heads <= 0 or inputs.shape[0] % heads != 0:
        raise ValueError(f"{_NAME}: inputs' first dimension ({inputs.shape[0]}) is not a multiple of heads ({heads})")
    if not 0.0 <= dropout_prob < 1.0:
        raise ValueError(f"{_NAME}: dropout_prob must be in [0, 1), got {dropout_prob}")
    attn_batches, query_len, key_len = inputs.shape
    batch = attn_batches // heads
    _attention.check_masks(_NAME, query_len, key_len, batch, pad_mask, None, bool(mask_additive), inputs.device)
    scores = inputs.view(batch, heads, query_len, key_len)
    probs = _attention.softmax(_attention.masked_scores(scores, pad_mask, None, bool(mask_additive)))
    if is_training and dropout_prob > 0.0:
        probs = F.dropout(probs, p=dropout_prob, training=True)
    return probs.reshape(attn_batches, query_len, key_len)
