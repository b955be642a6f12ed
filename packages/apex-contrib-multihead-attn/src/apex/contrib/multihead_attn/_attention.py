"""The math behind ``SelfMultiheadAttn``, ``EncdecMultiheadAttn`` and ``fast_mask_softmax_dropout_func``.

Layout (upstream's): activations are time-major ``[T, B, E]``; a self-attention input projection
``[T, B, 3E]`` is read as ``[T, B, heads, 3, head_dim]`` (each head's q, k, v rows side by side, not
three ``[E, E]`` blocks as in ``torch.nn.MultiheadAttention``), an encoder-decoder key/value projection
``[Tk, B, 2E]`` as ``[Tk, B, heads, 2, head_dim]``. Scores are ``q k^T / sqrt(head_dim)``.

Masks (at most one per call, as upstream):

- ``key_padding_mask [B, Tk]``, bool or uint8: nonzero marks a padding key (score ``-inf``);
- an additive ``key_padding_mask [B, Tk]`` (float, ``mask_additive``): added to the scores;
- ``attn_mask [Tq, Tk]``, bool or uint8 (upstream's "time mask"): nonzero marks a forbidden pair.

A query row whose every key is masked has no defined result (the softmax of only ``-inf``): the
softmax path gives NaN, ``scaled_dot_product_attention`` NaN or zeros depending on its backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_INTEGER_MASK_DTYPES = (torch.bool, torch.uint8)


def check_masks(name, query_len, key_len, batch, key_padding_mask, attn_mask, mask_additive, device):
    """Raise on a mask upstream did not accept (or accepted only to compute garbage with)."""
    if key_padding_mask is not None and attn_mask is not None:
        raise ValueError(f"{name}: key_padding_mask and attn_mask may not both be given (upstream's rule)")
    if key_padding_mask is not None:
        mask = key_padding_mask
        if mask_additive:
            if not mask.dtype.is_floating_point:
                raise TypeError(
                    f"{name}: key_padding_mask has dtype {mask.dtype}; with mask_additive=True it is added "
                    "to the scores and must be a float tensor"
                )
        elif mask.dtype not in _INTEGER_MASK_DTYPES:
            raise TypeError(
                f"{name}: key_padding_mask has dtype {mask.dtype}; expected torch.bool or torch.uint8 "
                "(nonzero = padding), or a float mask with mask_additive=True"
            )
        if tuple(mask.shape) != (batch, key_len):
            raise ValueError(
                f"{name}: key_padding_mask has shape {tuple(mask.shape)}; expected (batch, key length) = "
                f"{(batch, key_len)}"
            )
        if mask.device != device:
            raise ValueError(f"{name}: key_padding_mask is on {mask.device}, the query on {device}")
    if attn_mask is not None:
        if mask_additive:
            raise ValueError(f"{name}: attn_mask (upstream's time mask) is not supported with mask_additive=True")
        if attn_mask.dtype not in _INTEGER_MASK_DTYPES:
            raise TypeError(
                f"{name}: attn_mask has dtype {attn_mask.dtype}; expected torch.bool or torch.uint8 (nonzero = masked)"
            )
        if tuple(attn_mask.shape) != (query_len, key_len):
            raise ValueError(
                f"{name}: attn_mask has shape {tuple(attn_mask.shape)}; expected (query length, key length) = "
                f"{(query_len, key_len)}"
            )
        if attn_mask.device != device:
            raise ValueError(f"{name}: attn_mask is on {attn_mask.device}, the query on {device}")


def _sdpa_mask(key_padding_mask, attn_mask, mask_additive, dtype):
    """The mask as ``scaled_dot_product_attention`` takes it (bool True = attend, or additive float),
    broadcastable to ``[B, heads, Tq, Tk]``; None without a mask."""
    if key_padding_mask is not None:
        if mask_additive:
            return key_padding_mask.to(dtype)[:, None, None, :]
        return (key_padding_mask == 0)[:, None, None, :]
    if attn_mask is not None:
        return attn_mask == 0
    return None


def masked_scores(scores, key_padding_mask, attn_mask, mask_additive):
    """``scores [B, heads, Tq, Tk]`` with the mask applied (``-inf`` where masked, or the additive mask added)."""
    if key_padding_mask is not None:
        if mask_additive:
            return scores + key_padding_mask.to(scores.dtype)[:, None, None, :]
        return scores.masked_fill(key_padding_mask[:, None, None, :] != 0, float("-inf"))
    if attn_mask is not None:
        return scores.masked_fill(attn_mask != 0, float("-inf"))
    return scores


def softmax(scores):
    """Softmax over the last dimension, accumulated in float32 for 16-bit scores, rounded once."""
    if scores.dtype in (torch.float16, torch.bfloat16):
        return torch.softmax(scores.float(), dim=-1).to(scores.dtype)
    return torch.softmax(scores, dim=-1)


def attend(q, k, v, key_padding_mask, attn_mask, mask_additive, dropout_p, use_sdpa):
    """``dropout(softmax(mask(q k^T / sqrt(d)))) v`` for ``q [B, H, Tq, d]``, ``k, v [B, H, Tk, d]``.

    ``dropout_p`` is the probability of dropping an attention probability (0 for none). With
    ``use_sdpa`` the whole of it is one ``scaled_dot_product_attention`` call (flash or
    memory-efficient kernels where the device, dtype and mask allow, the math backend otherwise);
    without, explicit matmul, softmax and dropout (upstream's ``impl="default"``)."""
    if use_sdpa:
        mask = _sdpa_mask(key_padding_mask, attn_mask, mask_additive, q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    probs = softmax(masked_scores(scores, key_padding_mask, attn_mask, mask_additive))
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, v)


def split_heads(projected, heads, parts):
    """``[T, B, heads * parts * d]`` -> ``parts`` tensors ``[B, heads, T, d]`` (upstream's interleaving)."""
    length, batch, width = projected.shape
    grouped = projected.view(length, batch, heads, parts, width // (heads * parts))
    return [grouped[:, :, :, i].permute(1, 2, 0, 3) for i in range(parts)]


def merge_heads(context):
    """``[B, heads, T, d]`` -> ``[T, B, heads * d]``."""
    batch, heads, length, head_dim = context.shape
    return context.permute(2, 0, 1, 3).reshape(length, batch, heads * head_dim)


def check_activation(name, arg, x, embed_dim, batch=None, device=None):
    """``x`` must be a float ``[T, B, embed_dim]`` tensor (on ``device``, with ``batch`` sequences)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: {arg} must be a tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name}: {arg} has dtype {x.dtype}; expected a floating point dtype")
    if x.dim() != 3 or x.shape[2] != embed_dim:
        raise ValueError(
            f"{name}: {arg} has shape {tuple(x.shape)}; expected time-major [T, B, embed_dim] "
            f"with embed_dim={embed_dim}"
        )
    if batch is not None and x.shape[1] != batch:
        raise ValueError(f"{name}: {arg} has batch size {x.shape[1]}, the query {batch}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: {arg} is on {x.device}, the query on {device}")


def check_dtype_matches(name, x, weight):
    """Outside autocast the activations must have the parameters' dtype (as for torch.nn.Linear)."""
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"{name}: query has dtype {x.dtype} but the parameters {weight.dtype}; convert the module "
            "(.half(), .bfloat16(), .to(dtype)) or run under torch.autocast"
        )


def check_construction(name, embed_dim, num_heads, dropout, impl):
    if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads != 0:
        raise ValueError(f"{name}: embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})")
    if not 0.0 <= dropout < 1.0:  # false for NaN too
        raise ValueError(f"{name}: dropout must be in [0, 1), got {dropout}")
    if impl not in ("fast", "default"):
        raise ValueError(f"{name}: impl must be 'fast' or 'default', got {impl!r}")
