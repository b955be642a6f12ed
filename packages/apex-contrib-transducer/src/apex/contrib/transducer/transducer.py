"""``TransducerJoint`` and ``TransducerLoss``: upstream Apex's RNN-T modules on apex_contrib_transducer's ops.

Both take upstream's constructor and forward arguments. Lengths and labels may be int32 or int64
(converted to int32, the ops' type); everything else must be on the input's device.
"""

from __future__ import annotations

import torch

from apex.contrib.transducer import _ops

__all__ = ["TransducerJoint", "TransducerLoss"]

_SEED_BOUND = 1 << 62


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _check_opt(module: str, opt, allowed) -> None:
    if opt not in allowed:
        raise ValueError(f"{module}: opt must be one of {allowed}, got {opt}")


class TransducerJoint(torch.nn.Module):
    """The RNN-T joint ``h[b, t, u, :] = f[b, t, :] + g[b, u, :]`` (Graves, "Sequence Transduction
    with Recurrent Neural Networks"), with optional fused ReLU and dropout.

    Args:
        pack_output: return only the valid rows ``t < f_len[b]``, ``u < g_len[b]`` as ``[rows, H]``
            (``forward`` then needs ``batch_offset = cumsum(f_len * g_len)`` and ``packed_batch``,
            the total). Otherwise the output is ``[B, T, U, H]`` with -1 in the rows outside the lengths.
        relu: apply ReLU to the output.
        dropout: apply dropout with ``dropout_prob`` in training mode. The mask is a hash of a seed
            drawn from the device's default generator and of each element's index: reproducible
            under ``torch.manual_seed`` and the same on the CPU and the GPU for one seed.
        opt: upstream's kernel choice, 0 or 1. Accepted for compatibility; one kernel serves both,
            but ReLU and dropout need ``opt=1``, as upstream.
        fwd_tile_size: upstream's forward tile, 1, 2 or 4 (checked, otherwise unused).
        dropout_prob: the probability of zeroing an element.
        probe_mask: keep each forward's uint8 mask (1 = kept) in ``self.mask_probe``.
    """

    def __init__(
        self, pack_output=False, relu=False, dropout=False, opt=1, fwd_tile_size=4, dropout_prob=0, probe_mask=False
    ):
        super().__init__()
        _check_opt("TransducerJoint", opt, (0, 1))
        if fwd_tile_size not in (1, 2, 4):
            raise ValueError(f"TransducerJoint: fwd_tile_size must be 1, 2 or 4, got {fwd_tile_size}")
        if not 0 <= dropout_prob <= 1:
            raise ValueError(f"TransducerJoint: dropout_prob must lie in [0, 1], got {dropout_prob}")
        masked = relu or dropout
        if masked and opt != 1:
            raise NotImplementedError("ReLU and dropout fusion is only supported with opt=1")
        self.pack_output = pack_output
        self.relu = relu
        self.dropout = dropout
        self.dropout_prob = dropout_prob
        self.opt = opt
        self.fwd_tile_size = fwd_tile_size
        self.mask_probe = [] if masked and probe_mask else None

    def forward(self, f, g, f_len, g_len, batch_offset=None, packed_batch=0):
        """``f [B, T, H]`` (encoder), ``g [B, U, H]`` (predictor), ``f_len``/``g_len [B]`` the valid
        lengths; ``batch_offset`` and ``packed_batch`` only with ``pack_output``."""
        if self.pack_output:
            if batch_offset is None or packed_batch == 0:
                raise ValueError("TransducerJoint: pack_output needs batch_offset and packed_batch")
        else:
            batch_offset, packed_batch = None, 0
        seed = None
        if self.dropout and self.training:
            seed = torch.randint(_SEED_BOUND, (1,), dtype=torch.int64, device=f.device)
        out, mask = _ops.joint(
            f, g, _int32(f_len), _int32(g_len), batch_offset, packed_batch, self.relu, float(self.dropout_prob), seed
        )
        if self.mask_probe is not None and (self.relu or seed is not None):
            self.mask_probe.append(mask)
        return out


class TransducerLoss(torch.nn.Module):
    """The RNN-T loss ``-log P(y | x)`` per batch element, over the softmax of the joint's logits.

    Args:
        fuse_softmax_backward: fold the softmax's backward into the loss's: the logits are
            normalised inside the op (their log-softmax is never stored) and the backward writes the
            gradient w.r.t. the logits in one pass. Otherwise ``log_softmax`` runs as a separate
            PyTorch op and autograd goes through it (upstream's two-step path).
        opt: upstream's kernel choice, -1, 0 or 1 (checked, otherwise unused).
        packed_input: x is packed ``[rows, V]`` (``forward`` then needs ``batch_offset =
            cumsum(f_len * (y_len + 1))`` and ``max_f_len``).
    """

    def __init__(self, fuse_softmax_backward=True, opt=1, packed_input=False):
        super().__init__()
        _check_opt("TransducerLoss", opt, (-1, 0, 1))
        self.fuse_softmax_backward = fuse_softmax_backward
        self.opt = opt
        self.packed_input = packed_input

    def forward(self, x, label, f_len, y_len, blank_idx, batch_offset=None, max_f_len=None, debug_list=None):
        """``x [B, T, U, V]`` logits (or packed ``[rows, V]``), ``label [B, U - 1]``, ``f_len``/``y_len
        [B]``; returns the loss per batch element ``[B]`` in x's dtype. An empty ``debug_list``
        receives ``alpha`` and ``beta`` (``[B, max_f_len, U]``, float32; float64 for float64 x)."""
        if self.packed_input:
            if batch_offset is None or max_f_len is None:
                raise ValueError("TransducerLoss: packed_input needs batch_offset and max_f_len")
        else:
            batch_offset, max_f_len = None, x.size(1)
        if self.fuse_softmax_backward:
            inputs, normalize = x, True
        else:
            inputs, normalize = torch.nn.functional.log_softmax(x, dim=-1), False
        alpha, beta, loss, _ = _ops.loss(
            inputs, _int32(label), _int32(f_len), _int32(y_len), batch_offset, max_f_len, blank_idx, normalize
        )
        if debug_list == []:
            debug_list += [alpha, beta]
        return loss
