"""``EncdecMultiheadAttn``: upstream Apex's encoder-decoder attention module, on public torch ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from apex.contrib.multihead_attn import _attention

_NAME = "EncdecMultiheadAttn"


class EncdecMultiheadAttn(nn.Module):
    r"""Multi-head encoder-decoder attention on time-major input: queries from ``query [Tq, B, E]``
    (the decoder), keys and values both from ``key [Tk, B, E]`` (the encoder; ``value`` is accepted
    and ignored, as upstream).

    With ``H = num_heads`` heads of ``d = E / H`` channels::

        h        = LayerNorm(query)                   if include_norm_add, else query
        q        = h W_q^T + b_q                      in_proj_weight_q:  [E, E]
        [k|v]    = key W_kv^T + b_kv                  in_proj_weight_kv: [2E, E], rows grouped per head as (k, v)
        o        = dropout(softmax(mask(q k^T / sqrt(d)))) v
        y        = o W_out^T + b_out
        out      = query + dropout(y)                 if include_norm_add, else y

    The key is not normalised (upstream's placement). Dropout (probability ``dropout``) applies
    only when ``forward``'s ``is_training`` is True; ``forward`` returns ``(out, None)``.
    ``impl="fast"`` uses ``scaled_dot_product_attention``, ``impl="default"`` explicit matmul,
    softmax and dropout; same math, any float dtype, any device (upstream's fast path: fp16 CUDA
    only). See ``SelfMultiheadAttn`` for the masks; here ``key_padding_mask`` is ``[B, Tk]`` bool or
    uint8 and ``attn_mask`` ``[Tq, Tk]`` (upstream required it square); there is no additive mask.

    Args:
        embed_dim, num_heads, dropout, include_norm_add, impl: as ``SelfMultiheadAttn``.
        bias: ``in_proj_bias_q``, ``in_proj_bias_kv``, ``out_proj_bias`` (zeros). Upstream
            supports biases with ``impl="default"`` only; ``bias=True`` with ``impl="fast"``
            raises ValueError, as there.

    Initialisation as upstream: Xavier-uniform ``in_proj_weight_q``, ``in_proj_weight_kv`` (gain 1)
    and ``out_proj_weight``, zero biases, LayerNorm weight 1 and bias 0.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=False, include_norm_add=False, impl="fast"):
        super().__init__()
        _attention.check_construction(_NAME, embed_dim, num_heads, dropout, impl)
        if bias and impl == "fast":
            raise ValueError(
                f"{_NAME}: bias=True is not supported with impl='fast' (upstream's rule); use impl='default'"
            )
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.bias = bias
        self.include_norm_add = include_norm_add
        self.impl = impl
        self.scaling = self.head_dim**-0.5

        self.in_proj_weight_q = nn.Parameter(torch.empty(embed_dim, embed_dim))
        self.in_proj_weight_kv = nn.Parameter(torch.empty(2 * embed_dim, embed_dim))
        self.out_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim))
        for name, width in (
            ("in_proj_bias_q", embed_dim),
            ("in_proj_bias_kv", 2 * embed_dim),
            ("out_proj_bias", embed_dim),
        ):
            self.register_parameter(name, nn.Parameter(torch.empty(width)) if bias else None)
        self.lyr_nrm = None
        if include_norm_add:
            if impl == "fast":
                self.lyr_nrm_gamma_weights = nn.Parameter(torch.empty(embed_dim))
                self.lyr_nrm_beta_weights = nn.Parameter(torch.empty(embed_dim))
            else:
                self.lyr_nrm_gamma_weights = None
                self.lyr_nrm_beta_weights = None
                self.lyr_nrm = nn.LayerNorm(embed_dim)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.xavier_uniform_(self.in_proj_weight_q)
        nn.init.xavier_uniform_(self.in_proj_weight_kv)
        nn.init.xavier_uniform_(self.out_proj_weight)
        if self.bias:
            for bias in (self.in_proj_bias_q, self.in_proj_bias_kv, self.out_proj_bias):
                nn.init.zeros_(bias)
        if self.include_norm_add:
            if self.impl == "fast":
                nn.init.ones_(self.lyr_nrm_gamma_weights)
                nn.init.zeros_(self.lyr_nrm_beta_weights)
            else:
                self.lyr_nrm.reset_parameters()

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None, is_training=True):
        """``(out [Tq, B, E], None)``; see the class docstring."""
        _attention.check_activation(_NAME, "query", query, self.embed_dim)
        _attention.check_activation(_NAME, "key", key, self.embed_dim, query.shape[1], query.device)
        _attention.check_dtype_matches(_NAME, query, self.out_proj_weight)
        if key.dtype != query.dtype and not torch.is_autocast_enabled(query.device.type):
            raise TypeError(f"{_NAME}: key has dtype {key.dtype}, the query {query.dtype}")
        _attention.check_masks(
            _NAME, query.shape[0], key.shape[0], query.shape[1], key_padding_mask, attn_mask, False, query.device
        )
        dropout = self.dropout if is_training else 0.0
        if self.include_norm_add:
            if self.impl == "fast":
                hidden = F.layer_norm(
                    query, (self.embed_dim,), self.lyr_nrm_gamma_weights, self.lyr_nrm_beta_weights, 1e-5
                )
            else:
                hidden = self.lyr_nrm(query)
        else:
            hidden = query
        (q,) = _attention.split_heads(F.linear(hidden, self.in_proj_weight_q, self.in_proj_bias_q), self.num_heads, 1)
        k, v = _attention.split_heads(F.linear(key, self.in_proj_weight_kv, self.in_proj_bias_kv), self.num_heads, 2)
        context = _attention.attend(q, k, v, key_padding_mask, attn_mask, False, dropout, use_sdpa=self.impl == "fast")
        out = F.linear(_attention.merge_heads(context), self.out_proj_weight, self.out_proj_bias)
        if self.include_norm_add:
            out = query + F.dropout(out, p=dropout, training=dropout > 0.0)
        return out, None
