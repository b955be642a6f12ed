"""``SelfMultiheadAttn``: upstream Apex's self-attention module, on public torch ops."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from apex.contrib.multihead_attn import _attention

_NAME = "SelfMultiheadAttn"


class SelfMultiheadAttn(nn.Module):
    r"""Multi-head self-attention ("Attention Is All You Need") on time-major ``[T, B, embed_dim]`` input.

    For ``x = query`` (``key`` and ``value`` are accepted and ignored, as upstream: this is
    self-attention), with ``H = num_heads`` heads of ``d = embed_dim / H`` channels::

        h        = LayerNorm(x)                       if include_norm_add, else x
        [q|k|v]  = h W_in^T + b_in                    W_in: [3E, E], rows grouped per head as (q, k, v)
        P        = softmax(mask(q k^T / sqrt(d)))     per head, over the keys
        o        = dropout(P) v                       heads concatenated, [T, B, E]
        y        = o W_out^T + b_out
        out      = x + dropout(y)                     if include_norm_add, else y

    Both dropouts have probability ``dropout`` and apply only when ``is_training=True`` (the
    ``forward`` argument, upstream's switch; the module's ``train()``/``eval()`` state is not read).
    ``forward`` returns ``(out, None)`` whatever ``need_weights`` is (upstream never returned the
    attention weights).

    ``impl="fast"`` computes ``o`` with one ``torch.nn.functional.scaled_dot_product_attention``
    call (flash or memory-efficient kernels where the device, dtype and mask allow; every mask
    below is passed to it, so no case needs another path). ``impl="default"`` is the explicit
    path: matmul, softmax (accumulated in float32 for 16-bit input), dropout, matmul. The math is
    the same; with dropout the two draw different random masks. Both run on any device in any
    float dtype (upstream's fast path was fp16 CUDA only) and are differentiable by autograd and
    traceable by ``torch.compile(fullgraph=True)``.

    Args:
        embed_dim: ``E``, a multiple of ``num_heads``.
        num_heads: ``H``.
        dropout: probability of dropping an attention probability (and, with ``include_norm_add``,
            an output element before the residual add). Default 0.0.
        bias: add the biases ``in_proj_bias`` (or ``q_bias``, ``k_bias``, ``v_bias``) and
            ``out_proj_bias``, initialised to 0. Default False.
        include_norm_add: pre-LayerNorm on the query (eps 1e-5) and residual add of the query after
            the output projection's dropout. Parameters ``lyr_nrm_gamma_weights`` /
            ``lyr_nrm_beta_weights`` with ``impl="fast"``, a ``torch.nn.LayerNorm`` ``lyr_nrm``
            with ``impl="default"`` (upstream: apex's ``FusedLayerNorm``; same parameters, same
            ``state_dict`` keys). Default False.
        impl: ``"fast"`` or ``"default"``, as above.
        separate_qkv_params: keep ``q_weight``, ``k_weight``, ``v_weight`` (each ``[E, E]``, and
            ``q_bias``, ``k_bias``, ``v_bias``) instead of ``in_proj_weight [3E, E]``; they are
            interleaved per head into upstream's ``in_proj`` layout at each call.
        mask_additive: ``key_padding_mask`` is a float ``[B, T]`` tensor added to the scores (e.g. 0
            and -10000) rather than a boolean one. Upstream's rules hold: not with
            ``include_norm_add``, with ``impl="fast"`` only together with ``bias=True``, and never
            with an ``attn_mask``; each raises ValueError here (upstream: AssertionError).

    ``forward(query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None, is_training=True)``:

    - ``query`` ``[T, B, E]`` in the parameters' dtype (or any float dtype under ``torch.autocast``).
    - ``key_padding_mask`` ``[B, T]``: bool or uint8, nonzero marks a padding key; float with
      ``mask_additive``.
    - ``attn_mask`` ``[T, T]`` bool or uint8, nonzero marks a pair a query may not attend to (e.g.
      future steps). Not together with ``key_padding_mask`` (upstream's rule). Float masks raise
      TypeError (upstream converted them to bool).
    - A query row whose every key is masked has no defined output (NaN, or zeros on some
      ``scaled_dot_product_attention`` backends).

    Parameters are initialised as upstream: Xavier-uniform ``in_proj_weight`` with gain
    ``sqrt(2)`` (it is three ``[E, E]`` matrices), Xavier-uniform ``q/k/v_weight`` and
    ``out_proj_weight``, zero biases, LayerNorm weight 1 and bias 0.
    """

    def __init__(
        self,
        embed_dim,
        num_heads,
        dropout=0.0,
        bias=False,
        include_norm_add=False,
        impl="fast",
        separate_qkv_params=False,
        mask_additive=False,
    ):
        super().__init__()
        _attention.check_construction(_NAME, embed_dim, num_heads, dropout, impl)
        if mask_additive:
            if include_norm_add:
                raise ValueError(f"{_NAME}: mask_additive is not supported with include_norm_add (upstream's rule)")
            if impl == "fast" and not bias:
                raise ValueError(f"{_NAME}: mask_additive with impl='fast' needs bias=True (upstream's rule)")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.bias = bias
        self.include_norm_add = include_norm_add
        self.impl = impl
        self.scaling = self.head_dim**-0.5
        self.separate_qkv_params = separate_qkv_params
        self.mask_additive = mask_additive

        def square():
            return nn.Parameter(torch.empty(embed_dim, embed_dim))

        def vector():
            return nn.Parameter(torch.empty(embed_dim))

        if separate_qkv_params:
            self.q_weight, self.k_weight, self.v_weight = square(), square(), square()
        else:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.out_proj_weight = square()
        bias_names = ("q_bias", "k_bias", "v_bias") if separate_qkv_params else ("in_proj_bias",)
        for name in bias_names:
            if bias:
                width = embed_dim if separate_qkv_params else 3 * embed_dim
                self.register_parameter(name, nn.Parameter(torch.empty(width)))
            else:
                self.register_parameter(name, None)
        self.register_parameter("out_proj_bias", vector() if bias else None)
        self.lyr_nrm = None
        if include_norm_add:
            if impl == "fast":
                self.lyr_nrm_gamma_weights = vector()
                self.lyr_nrm_beta_weights = vector()
            else:
                self.lyr_nrm_gamma_weights = None
                self.lyr_nrm_beta_weights = None
                self.lyr_nrm = nn.LayerNorm(embed_dim)
        self.reset_parameters()

    def reset_parameters(self):
        if self.separate_qkv_params:
            for weight in (self.q_weight, self.k_weight, self.v_weight):
                nn.init.xavier_uniform_(weight)
        else:
            # [3E, E] holds three [E, E] matrices: gain sqrt(2) gives each the bound of an [E, E] Xavier init.
            nn.init.xavier_uniform_(self.in_proj_weight, gain=math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj_weight)
        if self.bias:
            for name in ("q_bias", "k_bias", "v_bias") if self.separate_qkv_params else ("in_proj_bias",):
                nn.init.zeros_(getattr(self, name))
            nn.init.zeros_(self.out_proj_bias)
        if self.include_norm_add:
            if self.impl == "fast":
                nn.init.ones_(self.lyr_nrm_gamma_weights)
                nn.init.zeros_(self.lyr_nrm_beta_weights)
            else:
                self.lyr_nrm.reset_parameters()

    def _input_projection(self):
        """``(weight [3E, E], bias [3E] or None)`` in upstream's per-head (q, k, v) interleaved layout."""
        if not self.separate_qkv_params:
            return self.in_proj_weight, self.in_proj_bias
        heads, head_dim, embed_dim = self.num_heads, self.head_dim, self.embed_dim
        weight = torch.stack(
            [w.view(heads, head_dim, embed_dim) for w in (self.q_weight, self.k_weight, self.v_weight)], dim=1
        ).reshape(3 * embed_dim, embed_dim)
        bias = None
        if self.bias:
            bias = torch.stack([b.view(heads, head_dim) for b in (self.q_bias, self.k_bias, self.v_bias)], dim=1)
            bias = bias.reshape(3 * embed_dim)
        return weight, bias

    def _layer_norm(self, x):
        if self.impl == "fast":
            return F.layer_norm(x, (self.embed_dim,), self.lyr_nrm_gamma_weights, self.lyr_nrm_beta_weights, 1e-5)
        return self.lyr_nrm(x)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None, is_training=True):
        """``(out [T, B, E], None)``; see the class docstring."""
        _attention.check_activation(_NAME, "query", query, self.embed_dim)
        _attention.check_dtype_matches(_NAME, query, self.out_proj_weight)
        length, batch, _ = query.shape
        _attention.check_masks(
            _NAME, length, length, batch, key_padding_mask, attn_mask, self.mask_additive, query.device
        )
        dropout = self.dropout if is_training else 0.0
        hidden = self._layer_norm(query) if self.include_norm_add else query
        weight, bias = self._input_projection()
        q, k, v = _attention.split_heads(F.linear(hidden, weight, bias), self.num_heads, 3)
        context = _attention.attend(
            q, k, v, key_padding_mask, attn_mask, self.mask_additive, dropout, use_sdpa=self.impl == "fast"
        )
        out = F.linear(_attention.merge_heads(context), self.out_proj_weight, self.out_proj_bias)
        if self.include_norm_add:
            out = query + F.dropout(out, p=dropout, training=dropout > 0.0)
        return out, None
