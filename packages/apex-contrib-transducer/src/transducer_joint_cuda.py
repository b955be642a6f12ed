"""Upstream Apex's ``transducer_joint_cuda`` extension module, on apex-contrib-transducer's ops.

- ``forward(f, g, f_len, g_len, batch_offset, packed_batch, opt, pack_output, relu, dropout,
  dropout_prob, tile_size) -> [h]``, or ``[h, mask]`` with ``relu`` or ``dropout`` (mask uint8,
  1 = kept). ``batch_offset`` is read only with ``pack_output`` (upstream passes an empty tensor
  otherwise). Dropout's seed is drawn from f's device's default generator.
- ``backward(inputs, f_len, g_len, batch_offset, max_f_len, max_g_len, pack_output, scale) ->
  [f_grad, g_grad]``: ``inputs`` is ``[grad]`` or ``[grad, mask]``; ``scale`` (upstream:
  ``1 / (1 - dropout_prob)``) multiplies the masked gradient, as upstream, and is ignored without a mask.

Runs on the CPU too (the PyTorch references) and takes float32, float16, bfloat16 and float64
(upstream: no bfloat16). ``opt`` and ``tile_size`` are checked as upstream, then unused.
"""

from __future__ import annotations

import torch

from apex.contrib.transducer import _ops

_SEED_BOUND = 1 << 62


def forward(f, g, f_len, g_len, batch_offset, packed_batch, opt, pack_output, relu, dropout, dropout_prob, tile_size):
    if opt not in (0, 1):
        raise ValueError(f"transducer_joint_cuda.forward: got an invalid optimization level {opt}")
    if tile_size not in (1, 2, 4):
        raise ValueError(f"transducer_joint_cuda.forward: expected tile_size to be in [1, 2, 4], but got {tile_size}")
    seed = torch.randint(_SEED_BOUND, (1,), dtype=torch.int64, device=f.device) if dropout else None
    h, mask = _ops.joint_forward(
        f,
        g,
        f_len,
        g_len,
        batch_offset if pack_output else None,
        packed_batch if pack_output else 0,
        relu,
        float(dropout_prob),
        seed,
    )
    return [h, mask] if relu or dropout else [h]


def backward(inputs, f_len, g_len, batch_offset, max_f_len, max_g_len, pack_output, scale):
    grad = inputs[0]
    mask = inputs[1] if len(inputs) > 1 else None
    f_grad, g_grad = _ops.joint_backward(
        grad,
        mask,
        f_len,
        g_len,
        batch_offset if pack_output else None,
        max_f_len,
        max_g_len,
        float(scale) if mask is not None else 1.0,
    )
    return [f_grad, g_grad]
