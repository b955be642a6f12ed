"""Upstream Apex's ``fast_multihead_attn`` extension module, in torch ops (``apex.contrib.multihead_attn._legacy``).

Every function upstream's pybind module exported, with its argument order and returned list:
``self_attn_{forward,backward}``, ``self_attn_bias_*``, ``self_attn_bias_additive_mask_*``,
``self_attn_norm_add_*``, ``encdec_multihead_attn_*``, ``encdec_multihead_attn_norm_add_*``,
``mask_softmax_dropout_*``, ``additive_mask_softmax_dropout_*``. The forwards return the tensors
upstream's kernels saved for their backward; the backwards consume them.

Differences from upstream: any float dtype and any device (upstream: fp16 CUDA); all math in float32
(float64 for float64 input), rounded once; ``dropout_mask`` is uint8, 1 = kept, and all ones
without ``is_training`` (upstream left it unwritten), so a backward after a non-training forward
must be given ``dropout_prob=0.0``; ``bmm1_results`` (additive-mask family) are the scaled scores
before the mask; the time mask may be ``[Tq, Tk]`` (upstream: square). See ``_legacy`` for the
layouts.
"""

from __future__ import annotations

from apex.contrib.multihead_attn import _legacy
from apex.core import __version__

__all__ = [
    "__version__",
    "additive_mask_softmax_dropout_backward",
    "additive_mask_softmax_dropout_forward",
    "encdec_multihead_attn_backward",
    "encdec_multihead_attn_forward",
    "encdec_multihead_attn_norm_add_backward",
    "encdec_multihead_attn_norm_add_forward",
    "mask_softmax_dropout_backward",
    "mask_softmax_dropout_forward",
    "self_attn_backward",
    "self_attn_bias_additive_mask_backward",
    "self_attn_bias_additive_mask_forward",
    "self_attn_bias_backward",
    "self_attn_bias_forward",
    "self_attn_forward",
    "self_attn_norm_add_backward",
    "self_attn_norm_add_forward",
]

_CORE = ("input_lin_results", "softmax_results", "dropout_results", "dropout_mask", "matmul2_results", "outputs")


def _pick(saved, names):
    return [saved[name] for name in names]


# masked softmax + dropout -----------------------------------------------------------------------


def mask_softmax_dropout_forward(use_mask, is_training, heads, input, pad_mask, dropout_prob):
    """-> [dropout_results, dropout_mask, softmax_results]; ``pad_mask [B, Tk]`` nonzero = padding."""
    return _legacy.softmax_dropout_forward(
        "mask_softmax_dropout_forward", use_mask, is_training, heads, input, pad_mask, dropout_prob, False
    )


def mask_softmax_dropout_backward(
    use_mask, heads, output_grads, softmax_results, dropout_mask, padding_mask, dropout_prob
):
    """-> input_grads (masked positions have probability 0, hence gradient 0; ``padding_mask`` is not needed)."""
    return _legacy.softmax_dropout_backward(
        "mask_softmax_dropout_backward", output_grads, softmax_results, dropout_mask, dropout_prob
    )


def additive_mask_softmax_dropout_forward(use_mask, is_training, heads, input, pad_mask, dropout_prob):
    """-> [dropout_results, dropout_mask, softmax_results]; ``pad_mask [B, Tk]`` float, added to the scores."""
    return _legacy.softmax_dropout_forward(
        "additive_mask_softmax_dropout_forward", use_mask, is_training, heads, input, pad_mask, dropout_prob, True
    )


def additive_mask_softmax_dropout_backward(use_mask, heads, output_grads, softmax_results, dropout_mask, dropout_prob):
    """-> input_grads."""
    return _legacy.softmax_dropout_backward(
        "additive_mask_softmax_dropout_backward", output_grads, softmax_results, dropout_mask, dropout_prob
    )


# self-attention ---------------------------------------------------------------------------------


def self_attn_forward(
    use_mask, use_time_mask, is_training, heads, inputs, input_weights, output_weights, pad_mask, dropout_prob
):
    """-> [input_lin_results, softmax_results, dropout_results, dropout_mask, matmul2_results, outputs]."""
    saved = _legacy.attention_forward(
        "self_attn_forward",
        use_mask=use_mask,
        use_time_mask=use_time_mask,
        is_training=is_training,
        heads=heads,
        inputs_q=inputs,
        inputs_kv=None,
        weights_q=input_weights,
        weights_kv=None,
        output_weights=output_weights,
        pad_mask=pad_mask,
        dropout_prob=dropout_prob,
    )
    return _pick(saved, _CORE)


def _self_backward(
    name,
    heads,
    output_grads,
    matmul2_results,
    dropout_results,
    softmax_results,
    input_lin_results,
    inputs,
    input_weights,
    output_weights,
    dropout_mask,
    dropout_prob,
    biases,
):
    return _legacy.attention_backward(
        name,
        heads=heads,
        output_grads=output_grads,
        matmul2_results=matmul2_results,
        dropout_results=dropout_results,
        softmax_results=softmax_results,
        inputs_q=inputs,
        inputs_kv=None,
        lin_q=input_lin_results,
        lin_kv=None,
        weights_q=input_weights,
        weights_kv=None,
        output_weights=output_weights,
        dropout_mask=dropout_mask,
        dropout_prob=dropout_prob,
        biases=biases,
    )


def self_attn_backward(
    heads,
    output_grads,
    matmul2_results,
    dropout_results,
    softmax_results,
    input_lin_results,
    inputs,
    input_weights,
    output_weights,
    dropout_mask,
    dropout_prob,
):
    """-> [input_grads, input_weight_grads, output_weight_grads]."""
    grads = _self_backward(
        "self_attn_backward",
        heads,
        output_grads,
        matmul2_results,
        dropout_results,
        softmax_results,
        input_lin_results,
        inputs,
        input_weights,
        output_weights,
        dropout_mask,
        dropout_prob,
        False,
    )
    return _pick(grads, ("input_grads", "input_weight_grads", "output_weight_grads"))


def _bias_forward(
    name,
    use_mask,
    use_time_mask,
    is_training,
    heads,
    inputs,
    input_weights,
    output_weights,
    input_biases,
    output_biases,
    pad_mask,
    dropout_prob,
    additive,
):
    return _legacy.attention_forward(
        name,
        use_mask=use_mask,
        use_time_mask=use_time_mask,
        is_training=is_training,
        heads=heads,
        inputs_q=inputs,
        inputs_kv=None,
        weights_q=input_weights,
        weights_kv=None,
        output_weights=output_weights,
        biases_q=input_biases,
        output_biases=output_biases,
        pad_mask=pad_mask,
        additive=additive,
        dropout_prob=dropout_prob,
    )


_BIAS_GRADS = ("input_grads", "input_weight_grads", "output_weight_grads", "input_bias_grads", "output_bias_grads")


def self_attn_bias_forward(
    use_mask,
    use_time_mask,
    is_training,
    heads,
    inputs,
    input_weights,
    output_weights,
    input_biases,
    output_biases,
    pad_mask,
    dropout_prob,
):
    """-> [input_lin_results, softmax_results, dropout_results, dropout_mask, matmul2_results, outputs]."""
    saved = _bias_forward(
        "self_attn_bias_forward",
        use_mask,
        use_time_mask,
        is_training,
        heads,
        inputs,
        input_weights,
        output_weights,
        input_biases,
        output_biases,
        pad_mask,
        dropout_prob,
        False,
    )
    return _pick(saved, _CORE)


def self_attn_bias_backward(
    heads,
    output_grads,
    matmul2_results,
    dropout_results,
    softmax_results,
    input_lin_results,
    inputs,
    input_weights,
    output_weights,
    dropout_mask,
    dropout_prob,
):
    """-> [input_grads, input_weight_grads, output_weight_grads, input_bias_grads, output_bias_grads]."""
    grads = _self_backward(
        "self_attn_bias_backward",
        heads,
        output_grads,
        matmul2_results,
        dropout_results,
        softmax_results,
        input_lin_results,
        inputs,
        input_weights,
        output_weights,
        dropout_mask,
        dropout_prob,
        True,
    )
    return _pick(grads, _BIAS_GRADS)


def self_attn_bias_additive_mask_forward(
    use_mask,
    use_time_mask,
    is_training,
    heads,
    inputs,
    input_weights,
    output_weights,
    input_biases,
    output_biases,
    pad_mask,
    dropout_prob,
):
    """-> [input_lin_results, bmm1_results, dropout_results, dropout_mask, matmul2_results, outputs];
    ``pad_mask [B, Tk]`` float, added to the scaled scores ``bmm1_results``. ``use_mask`` must be True."""
    saved = _bias_forward(
        "self_attn_bias_additive_mask_forward",
        use_mask,
        use_time_mask,
        is_training,
        heads,
        inputs,
        input_weights,
        output_weights,
        input_biases,
        output_biases,
        pad_mask,
        dropout_prob,
        True,
    )
    return _pick(saved, ("input_lin_results", "bmm1_results", *_CORE[2:]))


def self_attn_bias_additive_mask_backward(
    heads,
    output_grads,
    matmul2_results,
    dropout_results,
    bmm1_results,
    pad_mask,
    input_lin_results,
    inputs,
    input_weights,
    output_weights,
    dropout_mask,
    dropout_prob,
):
    """-> [input_grads, input_weight_grads, output_weight_grads, input_bias_grads, output_bias_grads]; the
    softmax is recomputed from ``bmm1_results`` and ``pad_mask``."""
    name = "self_attn_bias_additive_mask_backward"
    softmax_results = _legacy.additive_softmax(name, bmm1_results, heads, pad_mask)
    grads = _self_backward(
        name,
        heads,
        output_grads,
        matmul2_results,
        dropout_results,
        softmax_results,
        input_lin_results,
        inputs,
        input_weights,
        output_weights,
        dropout_mask,
        dropout_prob,
        True,
    )
    return _pick(grads, _BIAS_GRADS)


def self_attn_norm_add_forward(
    use_mask,
    use_time_mask,
    is_training,
    heads,
    inputs,
    lyr_nrm_gamma_weights,
    lyr_nrm_beta_weights,
    input_weights,
    output_weights,
    pad_mask,
    dropout_prob,
):
    """-> [lyr_nrm_results, lyr_nrm_mean, lyr_nrm_invvar, input_lin_results, softmax_results, dropout_results,
    dropout_mask, matmul2_results, dropout_add_mask, outputs]."""
    saved = _legacy.attention_forward(
        "self_attn_norm_add_forward",
        use_mask=use_mask,
        use_time_mask=use_time_mask,
        is_training=is_training,
        heads=heads,
        inputs_q=inputs,
        inputs_kv=None,
        weights_q=input_weights,
        weights_kv=None,
        output_weights=output_weights,
        norm=(lyr_nrm_gamma_weights, lyr_nrm_beta_weights),
        pad_mask=pad_mask,
        dropout_prob=dropout_prob,
    )
    return _pick(
        saved, ("lyr_nrm_results", "lyr_nrm_mean", "lyr_nrm_invvar", *_CORE[:5], "dropout_add_mask", "outputs")
    )


def self_attn_norm_add_backward(
    heads,
    output_grads,
    matmul2_results,
    dropout_results,
    softmax_results,
    input_lin_results,
    lyr_nrm_results,
    lyr_nrm_mean,
    lyr_nrm_invvar,
    inputs,
    lyr_nrm_gamma_weights,
    lyr_nrm_beta_weights,
    input_weights,
    output_weights,
    dropout_mask,
    dropout_add_mask,
    dropout_prob,
):
    """-> [input_grads, lyr_nrm_gamma_grads, lyr_nrm_beta_grads, input_weight_grads, output_weight_grads]."""
    grads = _legacy.attention_backward(
        "self_attn_norm_add_backward",
        heads=heads,
        output_grads=output_grads,
        matmul2_results=matmul2_results,
        dropout_results=dropout_results,
        softmax_results=softmax_results,
        inputs_q=inputs,
        inputs_kv=None,
        lin_q=input_lin_results,
        lin_kv=None,
        weights_q=input_weights,
        weights_kv=None,
        output_weights=output_weights,
        dropout_mask=dropout_mask,
        dropout_prob=dropout_prob,
        norm=(lyr_nrm_gamma_weights, lyr_nrm_beta_weights),
        norm_saved=(lyr_nrm_results, lyr_nrm_mean, lyr_nrm_invvar),
        dropout_add_mask=dropout_add_mask,
    )
    return _pick(
        grads, ("input_grads", "lyr_nrm_gamma_grads", "lyr_nrm_beta_grads", "input_weight_grads", "output_weight_grads")
    )


# encoder-decoder attention ----------------------------------------------------------------------

_ENCDEC_CORE = ("input_lin_q_results", "input_lin_kv_results", *_CORE[1:])


def encdec_multihead_attn_forward(
    use_mask,
    use_time_mask,
    is_training,
    heads,
    inputs_q,
    inputs_kv,
    input_weights_q,
    input_weights_kv,
    output_weights,
    pad_mask,
    dropout_prob,
):
    """-> [input_lin_q_results, input_lin_kv_results, softmax_results, dropout_results, dropout_mask,
    matmul2_results, outputs]."""
    saved = _legacy.attention_forward(
        "encdec_multihead_attn_forward",
        use_mask=use_mask,
        use_time_mask=use_time_mask,
        is_training=is_training,
        heads=heads,
        inputs_q=inputs_q,
        inputs_kv=inputs_kv,
        weights_q=input_weights_q,
        weights_kv=input_weights_kv,
        output_weights=output_weights,
        pad_mask=pad_mask,
        dropout_prob=dropout_prob,
    )
    return _pick(saved, _ENCDEC_CORE)


_ENCDEC_GRADS = ("input_grads", "input_kv_grads", "input_weight_grads", "input_weight_kv_grads", "output_weight_grads")


def encdec_multihead_attn_backward(
    heads,
    output_grads,
    matmul2_results,
    dropout_results,
    softmax_results,
    input_lin_q_results,
    input_lin_kv_results,
    inputs_q,
    inputs_kv,
    input_weights_q,
    input_weights_kv,
    output_weights,
    dropout_mask,
    dropout_prob,
):
    """-> [input_q_grads, input_kv_grads, input_weight_q_grads, input_weight_kv_grads, output_weight_grads]."""
    grads = _legacy.attention_backward(
        "encdec_multihead_attn_backward",
        heads=heads,
        output_grads=output_grads,
        matmul2_results=matmul2_results,
        dropout_results=dropout_results,
        softmax_results=softmax_results,
        inputs_q=inputs_q,
        inputs_kv=inputs_kv,
        lin_q=input_lin_q_results,
        lin_kv=input_lin_kv_results,
        weights_q=input_weights_q,
        weights_kv=input_weights_kv,
        output_weights=output_weights,
        dropout_mask=dropout_mask,
        dropout_prob=dropout_prob,
    )
    return _pick(grads, _ENCDEC_GRADS)


def encdec_multihead_attn_norm_add_forward(
    use_mask,
    use_time_mask,
    is_training,
    heads,
    inputs_q,
    inputs_kv,
    lyr_nrm_gamma_weights,
    lyr_nrm_beta_weights,
    input_weights_q,
    input_weights_kv,
    output_weights,
    pad_mask,
    dropout_prob,
):
    """-> [lyr_nrm_results, lyr_nrm_mean, lyr_nrm_invvar, input_lin_q_results, input_lin_kv_results,
    softmax_results, dropout_results, dropout_mask, matmul2_results, dropout_add_mask, outputs]."""
    saved = _legacy.attention_forward(
        "encdec_multihead_attn_norm_add_forward",
        use_mask=use_mask,
        use_time_mask=use_time_mask,
        is_training=is_training,
        heads=heads,
        inputs_q=inputs_q,
        inputs_kv=inputs_kv,
        weights_q=input_weights_q,
        weights_kv=input_weights_kv,
        output_weights=output_weights,
        norm=(lyr_nrm_gamma_weights, lyr_nrm_beta_weights),
        pad_mask=pad_mask,
        dropout_prob=dropout_prob,
    )
    return _pick(
        saved, ("lyr_nrm_results", "lyr_nrm_mean", "lyr_nrm_invvar", *_ENCDEC_CORE[:6], "dropout_add_mask", "outputs")
    )


def encdec_multihead_attn_norm_add_backward(
    heads,
    output_grads,
    matmul2_results,
    dropout_results,
    softmax_results,
    input_lin_q_results,
    input_lin_kv_results,
    lyr_nrm_results,
    lyr_nrm_mean,
    lyr_nrm_invvar,
    inputs_q,
    inputs_kv,
    lyr_nrm_gamma_weights,
    lyr_nrm_beta_weights,
    input_weights_q,
    input_weights_kv,
    output_weights,
    dropout_mask,
    dropout_add_mask,
    dropout_prob,
):
    """-> [input_q_grads, input_kv_grads, lyr_nrm_gamma_grads, lyr_nrm_beta_grads, input_weight_q_grads,
    input_weight_kv_grads, output_weight_grads]."""
    grads = _legacy.attention_backward(
        "encdec_multihead_attn_norm_add_backward",
        heads=heads,
        output_grads=output_grads,
        matmul2_results=matmul2_results,
        dropout_results=dropout_results,
        softmax_results=softmax_results,
        inputs_q=inputs_q,
        inputs_kv=inputs_kv,
        lin_q=input_lin_q_results,
        lin_kv=input_lin_kv_results,
        weights_q=input_weights_q,
        weights_kv=input_weights_kv,
        output_weights=output_weights,
        dropout_mask=dropout_mask,
        dropout_prob=dropout_prob,
        norm=(lyr_nrm_gamma_weights, lyr_nrm_beta_weights),
        norm_saved=(lyr_nrm_results, lyr_nrm_mean, lyr_nrm_invvar),
        dropout_add_mask=dropout_add_mask,
    )
    return _pick(
        grads,
        (
            "input_grads",
            "input_kv_grads",
            "lyr_nrm_gamma_grads",
            "lyr_nrm_beta_grads",
            "input_weight_grads",
            "input_weight_kv_grads",
            "output_weight_grads",
        ),
    )
