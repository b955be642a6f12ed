"""The math of upstream's ``fast_multihead_attn`` extension functions, in torch ops (any device, any float dtype).

Each ``*_forward`` returns upstream's list of saved tensors and each ``*_backward`` consumes them,
so upstream's ``autograd.Function`` wrappers (and code that called the extension directly) work
unchanged. Conventions, as upstream's kernels:

- activations time-major ``[T, B, E]``; attention batches ordered ``b * heads + h``;
  ``softmax_results``, ``dropout_results``, ``dropout_mask`` are ``[B * heads, Tq, Tk]``;
  ``matmul2_results`` (the heads' concatenated context) ``[Tq, B, E]``.
- ``pad_mask`` (read when ``use_mask``): ``[B, Tk]`` nonzero = padding key; with ``use_time_mask``
  ``[Tq, Tk]`` nonzero = forbidden pair; in the additive families a float ``[B, Tk]`` added to
  the scores.
- ``dropout_mask`` / ``dropout_add_mask``: uint8, 1 = kept (scaled by ``1 / (1 - dropout_prob)``).
  Without ``is_training`` they are all ones and ``dropout_results`` is ``softmax_results``; a
  backward after such a forward must be given ``dropout_prob=0.0``.
- LayerNorm (the ``norm_add`` families): eps 1e-5; ``lyr_nrm_mean`` and ``lyr_nrm_invvar`` are
  float32 ``[Tq * B]``. Residual: ``outputs = inputs + dropout(attention(LayerNorm(inputs)))``.

Everything is computed in float32 (float64 for float64 input) and each result rounded once to
the inputs' dtype.
"""

from __future__ import annotations

import torch

_EPS = 1e-5


def _compute(t):
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def _check(name, arg, t, dims):
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: {arg} must be a {dims}-D tensor, got {shape}")


def _heads(name, heads, embed_dim):
    heads = int(heads)
    if heads <= 0 or embed_dim % heads:
        raise ValueError(f"{name}: heads ({heads}) must divide the embedding width ({embed_dim})")
    return heads


# the attention core: [T, B*H, d] views in, [B*H, Tq, Tk] probabilities ----------------------------


def _apply_mask(name, scores, heads, use_mask, use_time_mask, pad_mask, additive):
    if not use_mask:
        if additive:
            raise ValueError(f"{name}: the additive-mask functions need a mask (use_mask=True), as upstream")
        return scores
    _check(name, "pad_mask", pad_mask, 2)
    attn_batches, tq, tk = scores.shape
    if use_time_mask:
        if tuple(pad_mask.shape) != (tq, tk):
            raise ValueError(f"{name}: the time mask pad_mask has shape {tuple(pad_mask.shape)}; expected {(tq, tk)}")
        return scores.masked_fill(pad_mask.to(scores.device) != 0, float("-inf"))
    batch = attn_batches // heads
    if tuple(pad_mask.shape) != (batch, tk):
        raise ValueError(f"{name}: pad_mask has shape {tuple(pad_mask.shape)}; expected (batch, Tk) = {(batch, tk)}")
    view = scores.view(batch, heads, tq, tk)
    if additive:
        view = view + _compute(pad_mask)[:, None, None, :].to(scores.dtype)
    else:
        view = view.masked_fill(pad_mask[:, None, None, :] != 0, float("-inf"))
    return view.reshape(attn_batches, tq, tk)


def additive_softmax(name, bmm1_results, heads, pad_mask):
    """The softmax of the scaled scores ``bmm1_results [B * heads, Tq, Tk]`` plus the additive ``pad_mask [B, Tk]``."""
    _check(name, "bmm1_results", bmm1_results, 3)
    return torch.softmax(_apply_mask(name, _compute(bmm1_results), int(heads), True, False, pad_mask, True), dim=-1)


def _dropout(name, probs, is_training, dropout_prob):
    """``(dropped, keep mask uint8)``; without training the probabilities themselves and all ones."""
    if not is_training:
        return probs, torch.ones(probs.shape, dtype=torch.uint8, device=probs.device)
    if not 0.0 <= dropout_prob < 1.0:
        raise ValueError(f"{name}: dropout_prob must be in [0, 1), got {dropout_prob}")
    keep = torch.empty(probs.shape, dtype=torch.uint8, device=probs.device).bernoulli_(1.0 - dropout_prob)
    return probs * keep / (1.0 - dropout_prob), keep


def _undropout(grad, mask, dropout_prob):
    return grad * _compute(mask) / (1.0 - float(dropout_prob))


def _softmax_backward(grad, probs):
    return probs * (grad - (grad * probs).sum(-1, keepdim=True))


def _core_forward(name, q, k, v, heads, use_mask, use_time_mask, pad_mask, additive, is_training, dropout_prob):
    """q [Tq, BH, d], k and v [Tk, BH, d] -> (bmm1 (the scaled scores), softmax, dropout_results,
    dropout_mask, context [Tq, BH, d])."""
    scale = q.shape[-1] ** -0.5
    bmm1 = torch.bmm(q.transpose(0, 1), k.permute(1, 2, 0)) * scale
    probs = torch.softmax(_apply_mask(name, bmm1, heads, use_mask, use_time_mask, pad_mask, additive), dim=-1)
    dropped, keep = _dropout(name, probs, is_training, dropout_prob)
    context = torch.bmm(dropped, v.transpose(0, 1)).transpose(0, 1)
    return bmm1, probs, dropped, keep, context


def _core_backward(grad_context, q, k, v, probs, dropped, keep, dropout_prob):
    """grad_context [Tq, BH, d] -> (grad q [Tq, BH, d], grad k, grad v [Tk, BH, d])."""
    scale = q.shape[-1] ** -0.5
    g = grad_context.transpose(0, 1)
    grad_v = torch.bmm(dropped.transpose(1, 2), g)
    grad_scores = _softmax_backward(_undropout(torch.bmm(g, v.permute(1, 2, 0)), keep, dropout_prob), probs)
    grad_q = torch.bmm(grad_scores, k.transpose(0, 1)) * scale
    grad_k = torch.bmm(grad_scores.transpose(1, 2), q.transpose(0, 1)) * scale
    return grad_q.transpose(0, 1), grad_k.transpose(0, 1), grad_v.transpose(0, 1)


# layer norm -----------------------------------------------------------------------------------


def _layer_norm(x, gamma, beta):
    mean = x.mean(-1, keepdim=True)
    invvar = torch.rsqrt(((x - mean) ** 2).mean(-1, keepdim=True) + _EPS)
    return (x - mean) * invvar * gamma + beta, mean, invvar


def _layer_norm_backward(grad, x, mean, invvar, gamma):
    xhat = (x - mean) * invvar
    grad_gamma = (grad * xhat).flatten(0, -2).sum(0)
    grad_beta = grad.flatten(0, -2).sum(0)
    gx = grad * gamma
    grad_x = invvar * (gx - gx.mean(-1, keepdim=True) - xhat * (gx * xhat).mean(-1, keepdim=True))
    return grad_x, grad_gamma, grad_beta


# the families -----------------------------------------------------------------------------------


def attention_forward(
    name,
    *,
    use_mask,
    use_time_mask,
    is_training,
    heads,
    inputs_q,
    inputs_kv,
    weights_q,
    weights_kv,
    output_weights,
    biases_q=None,
    biases_kv=None,
    output_biases=None,
    norm=None,
    pad_mask=None,
    additive=False,
    dropout_prob=0.0,
):
    """Every forward family: self-attention when ``inputs_kv`` is None (``weights_q`` is then the
    ``[3E, E]`` in_proj), encoder-decoder otherwise. Returns a dict of all saved tensors."""
    _check(name, "inputs" if inputs_kv is None else "inputs_q", inputs_q, 3)
    tq, batch, embed = inputs_q.shape
    heads = _heads(name, heads, embed)
    dtype = inputs_q.dtype
    x = _compute(inputs_q)
    saved = {}
    if norm is not None:
        normed, mean, invvar = _layer_norm(x, _compute(norm[0]), _compute(norm[1]))
        saved.update(
            lyr_nrm_results=normed.to(dtype),
            lyr_nrm_mean=mean.reshape(-1).float(),
            lyr_nrm_invvar=invvar.reshape(-1).float(),
        )
        x = normed

    def linear(t, w, b):
        out = t @ _compute(w).T
        return out if b is None else out + _compute(b)

    lin_q = linear(x, weights_q, biases_q)
    d = embed // heads
    if inputs_kv is None:
        grouped = lin_q.view(tq, batch * heads, 3, d)
        q, k, v = grouped[:, :, 0], grouped[:, :, 1], grouped[:, :, 2]
        saved["input_lin_results"] = lin_q.to(dtype)
    else:
        _check(name, "inputs_kv", inputs_kv, 3)
        lin_kv = linear(_compute(inputs_kv), weights_kv, biases_kv)
        grouped = lin_kv.view(inputs_kv.shape[0], batch * heads, 2, d)
        q, k, v = lin_q.view(tq, batch * heads, d), grouped[:, :, 0], grouped[:, :, 1]
        saved["input_lin_q_results"] = lin_q.to(dtype)
        saved["input_lin_kv_results"] = lin_kv.to(dtype)
    bmm1, probs, dropped, keep, context = _core_forward(
        name, q, k, v, heads, use_mask, use_time_mask, pad_mask, additive, is_training, dropout_prob
    )
    context = context.reshape(tq, batch, embed)
    out = linear(context, output_weights, output_biases)
    saved.update(
        bmm1_results=bmm1.to(dtype),
        softmax_results=probs.to(dtype),
        dropout_results=dropped.to(dtype),
        dropout_mask=keep,
        matmul2_results=context.to(dtype),
    )
    if norm is not None:
        dropped_out, add_keep = _dropout(name, out, is_training, dropout_prob)
        saved["dropout_add_mask"] = add_keep
        out = _compute(inputs_q) + dropped_out
    saved["outputs"] = out.to(dtype)
    return saved


def attention_backward(
    name,
    *,
    heads,
    output_grads,
    matmul2_results,
    dropout_results,
    softmax_results,
    inputs_q,
    inputs_kv,
    lin_q,
    lin_kv,
    weights_q,
    weights_kv,
    output_weights,
    dropout_mask,
    dropout_prob,
    norm=None,
    norm_saved=None,
    dropout_add_mask=None,
    biases=False,
):
    """Every backward family; returns a dict of gradients."""
    _check(name, "output_grads", output_grads, 3)
    tq, batch, embed = output_grads.shape
    heads = _heads(name, heads, embed)
    dtype = inputs_q.dtype
    d = embed // heads
    grad = _compute(output_grads)
    grads = {}
    if norm is not None:
        grad_attention = _undropout(grad, dropout_add_mask, dropout_prob)
    else:
        grad_attention = grad
    g2 = grad_attention.reshape(-1, embed)
    grads["output_weight_grads"] = g2.T @ _compute(matmul2_results).reshape(-1, embed)
    if biases:
        grads["output_bias_grads"] = g2.sum(0)
    grad_context = (g2 @ _compute(output_weights)).view(tq, batch * heads, d)
    probs, dropped = _compute(softmax_results), _compute(dropout_results)
    if norm is not None:
        lyr_nrm_results, mean, invvar = norm_saved
        x = _compute(lyr_nrm_results)
    else:
        x = _compute(inputs_q)
    if inputs_kv is None:
        grouped = _compute(lin_q).view(tq, batch * heads, 3, d)
        q, k, v = grouped[:, :, 0], grouped[:, :, 1], grouped[:, :, 2]
    else:
        grouped = _compute(lin_kv).view(inputs_kv.shape[0], batch * heads, 2, d)
        q, k, v = _compute(lin_q).view(tq, batch * heads, d), grouped[:, :, 0], grouped[:, :, 1]
    grad_q, grad_k, grad_v = _core_backward(grad_context, q, k, v, probs, dropped, dropout_mask, dropout_prob)
    if inputs_kv is None:
        grad_lin = torch.stack([grad_q, grad_k, grad_v], dim=2).reshape(tq * batch, 3 * embed)
    else:
        grad_lin = grad_q.reshape(tq * batch, embed)
        grad_lin_kv = torch.stack([grad_k, grad_v], dim=2).reshape(-1, 2 * embed)
        grads["input_kv_grads"] = (grad_lin_kv @ _compute(weights_kv)).view(inputs_kv.shape)
        grads["input_weight_kv_grads"] = grad_lin_kv.T @ _compute(inputs_kv).reshape(-1, embed)
    grad_x = (grad_lin @ _compute(weights_q)).view(tq, batch, embed)
    grads["input_weight_grads"] = grad_lin.T @ x.reshape(-1, embed)
    if biases:
        grads["input_bias_grads"] = grad_lin.sum(0)
    if norm is not None:
        x_in = _compute(inputs_q)
        mean = mean.to(x_in.dtype).view(tq, batch, 1)
        invvar = invvar.to(x_in.dtype).view(tq, batch, 1)
        grad_x, grads["lyr_nrm_gamma_grads"], grads["lyr_nrm_beta_grads"] = _layer_norm_backward(
            grad_x, x_in, mean, invvar, _compute(norm[0])
        )
        grad_x = grad_x + grad
    grads["input_grads"] = grad_x
    return {key: value.to(dtype) for key, value in grads.items()}


def softmax_dropout_forward(name, use_mask, is_training, heads, inputs, pad_mask, dropout_prob, additive):
    _check(name, "input", inputs, 3)
    heads = int(heads)
    if heads <= 0 or inputs.shape[0] % heads:
        raise ValueError(f"{name}: heads ({heads}) must divide input's first dimension ({inputs.shape[0]})")
    x = _compute(inputs)
    probs = torch.softmax(_apply_mask(name, x, heads, use_mask, False, pad_mask, additive), dim=-1)
    dropped, keep = _dropout(name, probs, is_training, dropout_prob)
    return [dropped.to(inputs.dtype), keep, probs.to(inputs.dtype)]


def softmax_dropout_backward(name, output_grads, softmax_results, dropout_mask, dropout_prob):
    _check(name, "output_grads", output_grads, 3)
    grad = _undropout(_compute(output_grads), dropout_mask, dropout_prob)
    return _softmax_backward(grad, _compute(softmax_results)).to(output_grads.dtype)
