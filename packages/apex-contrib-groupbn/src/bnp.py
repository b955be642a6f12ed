"""Upstream Apex's ``bnp`` extension module (contrib groupbn), on apex-parallel's SyncBatchNorm ops.

Upstream's names and argument orders; ``x``, ``z``, ``dy`` and outputs are ``(N, H, W, C)``
tensors (made contiguous first, as upstream); ``s``/``b`` (weight, bias), ``rm``/``riv`` (running
mean and running *variance*, despite the name) and ``mini_m``/``mini_riv`` (the batch's mean and
inverse standard deviation) are per-channel float32 tensors:

- ``bn_fwd_nhwc(x, s, b, rm, riv, mini_m, mini_riv, ret_cta, mom, epsilon, fuse_relu, my_data,
  pair_data, pair_data2, pair_data3, bn_group, magic, fwd_occup, fwd_grid_x, multi_stream) -> y``:
  training forward; writes ``mini_m``/``mini_riv`` and updates ``rm``/``riv`` in place;
- ``bn_fwd_eval_nhwc(x, s, b, rm, riv, ret_cta, bn_group, mom, epsilon, fuse_relu) -> y``;
- ``bn_bwd_nhwc(x, dy, s, b, rm, riv, mini_m, mini_riv, ret_cta, mom, epsilon, fuse_relu, my_data,
  pair_data, pair_data2, pair_data3, bn_group, magic, bwd_occup, bwd_grid_x, multi_stream)
  -> [dx, dscale, dbias]`` (with ``fuse_relu`` the ReLU mask is recomputed from ``x``);
- ``bn_addrelu_fwd_nhwc(x, z, s, b, rm, riv, mini_m, mini_riv, bitmask, ret_cta, mom, epsilon,
  my_data, pair_data, pair_data2, pair_data3, bn_group, magic, fwd_occup, fwd_grid_x, multi_stream)
  -> y = relu(bn(x) + z)``; writes the ReLU mask into the int32 ``bitmask`` (bit ``i % 32`` of
  word ``i // 32`` for element ``i``; it needs ``ceil(numel / 32)`` words, upstream's allocation
  has more);
- ``bn_addrelu_fwd_eval_nhwc(x, z, s, b, rm, riv, ret_cta, bn_group, mom, epsilon) -> y``;
- ``bn_addrelu_bwd_nhwc(x, dy, s, b, rm, riv, mini_m, mini_riv, bitmask, ret_cta, mom, epsilon,
  my_data, pair_data, pair_data2, pair_data3, bn_group, magic, bwd_occup, bwd_grid_x,
  multi_stream) -> [dx, dz, dscale, dbias]``;
- ``bn_fwd_nhwc_occupancy()``, ``bn_bwd_nhwc_occupancy()``, ``bn_addrelu_fwd_nhwc_occupancy()``,
  ``bn_addrelu_bwd_nhwc_occupancy()``: 2, upstream's largest; a launch hint our kernels do not use;
- ``get_buffer_size(bn_sync_steps)``: 0, our groups need no IPC buffer.

``bn_group`` > 1 synchronizes over this rank's group of ``bn_group`` consecutive ranks through
``torch.distributed`` (made on first use, collectively: every rank calls with the same sizes in the
same order); the backward functions assume every rank of the group holds a batch of ``x``'s size,
as upstream's kernels do. The IPC pointers, ``ret_cta``, ``magic``, occupancies, grid sizes and
``multi_stream`` are accepted and ignored. ``get_data_ptr``, ``get_remote_data_ptr`` and
``close_remote_data`` (CUDA IPC) raise NotImplementedError. Inputs may also be bfloat16, float32
or float64 (upstream: float16), any ``C``; runs on the CPU too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from apex.core import __version__
from apex.parallel.group_sync import backward_train, consecutive_group, forward_train, local_counts

__all__ = [
    "__version__",
    "bn_addrelu_bwd_nhwc",
    "bn_addrelu_bwd_nhwc_occupancy",
    "bn_addrelu_fwd_eval_nhwc",
    "bn_addrelu_fwd_nhwc",
    "bn_addrelu_fwd_nhwc_occupancy",
    "bn_bwd_nhwc",
    "bn_bwd_nhwc_occupancy",
    "bn_fwd_eval_nhwc",
    "bn_fwd_nhwc",
    "bn_fwd_nhwc_occupancy",
    "close_remote_data",
    "get_buffer_size",
    "get_data_ptr",
    "get_remote_data_ptr",
]

_MAX_OCCUPANCY = 2
_BITS = 32


def _nhwc(name: str, op: str, t: torch.Tensor) -> torch.Tensor:
    if t.dim() != 4:
        raise ValueError(f"bnp.{op}: {name} must be an (N, H, W, C) tensor, got shape {tuple(t.shape)}")
    return t.contiguous()


def _group(bn_group: int, op: str):
    return consecutive_group(int(bn_group), f"bnp.{op}")


def _fwd(op, x, z, s, b, rm, riv, mini_m, mini_riv, mom, epsilon, fuse_relu, bn_group):
    x = _nhwc("x", op, x)
    z = None if z is None else _nhwc("z", op, z)
    group, world = _group(bn_group, op)
    y, mean, invstd, _ = forward_train(x, z, s, b, rm, riv, mom, epsilon, fuse_relu, group, world)
    mini_m.copy_(mean)
    mini_riv.copy_(invstd)
    return y


def _eval(op, x, z, s, b, rm, riv, epsilon, fuse_relu):
    x = _nhwc("x", op, x)
    y = F.batch_norm(x.permute(0, 3, 1, 2), rm, riv, s, b, False, 0.0, epsilon).permute(0, 2, 3, 1)
    if z is not None:
        y = y + _nhwc("z", op, z)
    return (torch.relu(y) if fuse_relu else y).contiguous()


def bn_fwd_nhwc(x, s, b, rm, riv, mini_m, mini_riv, ret_cta, mom, epsilon, fuse_relu, my_data, pair_data,
                pair_data2, pair_data3, bn_group, magic, fwd_occup, fwd_grid_x, multi_stream):  # fmt: skip
    return _fwd("bn_fwd_nhwc", x, None, s, b, rm, riv, mini_m, mini_riv, mom, epsilon, fuse_relu, bn_group)


def bn_fwd_eval_nhwc(x, s, b, rm, riv, ret_cta, bn_group, mom, epsilon, fuse_relu):
    return _eval("bn_fwd_eval_nhwc", x, None, s, b, rm, riv, epsilon, fuse_relu)


def _stats(x, mini_m, mini_riv):
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return mini_m.to(dtype).contiguous(), mini_riv.to(dtype).contiguous()


def bn_bwd_nhwc(x, dy, s, b, rm, riv, mini_m, mini_riv, ret_cta, mom, epsilon, fuse_relu, my_data, pair_data,
                pair_data2, pair_data3, bn_group, magic, bwd_occup, bwd_grid_x, multi_stream):  # fmt: skip
    op = "bn_bwd_nhwc"
    x, dy = _nhwc("x", op, x), _nhwc("dy", op, dy)
    group, world = _group(bn_group, op)
    mean, invstd = _stats(x, mini_m, mini_riv)
    counts = local_counts(x, world, mean.dtype)
    dx, _, dscale, dbias = backward_train(dy, x, None, s, b, mean, invstd, counts, fuse_relu, group, world)
    return [dx, dscale, dbias]


def _pack(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as int32 words, bit ``i % 32`` of word ``i // 32`` for element ``i``."""
    flat = mask.reshape(-1).to(torch.int64)
    flat = F.pad(flat, (0, -flat.numel() % _BITS))
    words = (flat.view(-1, _BITS) << torch.arange(_BITS, device=mask.device)).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack(words: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    bits = (words.to(torch.int64).unsqueeze(1) >> torch.arange(_BITS, device=words.device)) & 1
    return bits.reshape(-1)[: like.numel()].view(like.shape).bool()


def _check_bitmask(op: str, bitmask: torch.Tensor, x: torch.Tensor) -> None:
    words = -(-x.numel() // _BITS)
    if not isinstance(bitmask, torch.Tensor) or bitmask.dtype != torch.int32:
        raise TypeError(f"bnp.{op}: bitmask must be an int32 tensor")
    if bitmask.numel() < words or not bitmask.is_contiguous() or bitmask.device != x.device:
        raise ValueError(
            f"bnp.{op}: bitmask must be a contiguous tensor on {x.device} of at least {words} elements, got "
            f"{bitmask.numel()} on {bitmask.device}"
        )


def bn_addrelu_fwd_nhwc(x, z, s, b, rm, riv, mini_m, mini_riv, bitmask, ret_cta, mom, epsilon, my_data,
                        pair_data, pair_data2, pair_data3, bn_group, magic, fwd_occup, fwd_grid_x,
                        multi_stream):  # fmt: skip
    op = "bn_addrelu_fwd_nhwc"
    _check_bitmask(op, bitmask, x)
    y = _fwd(op, x, z, s, b, rm, riv, mini_m, mini_riv, mom, epsilon, True, bn_group)
    words = _pack(y > 0)
    bitmask.view(-1)[: words.numel()].copy_(words)
    return y


def bn_addrelu_fwd_eval_nhwc(x, z, s, b, rm, riv, ret_cta, bn_group, mom, epsilon):
    return _eval("bn_addrelu_fwd_eval_nhwc", x, z, s, b, rm, riv, epsilon, True)


def bn_addrelu_bwd_nhwc(x, dy, s, b, rm, riv, mini_m, mini_riv, bitmask, ret_cta, mom, epsilon, my_data,
                        pair_data, pair_data2, pair_data3, bn_group, magic, bwd_occup, bwd_grid_x,
                        multi_stream):  # fmt: skip
    op = "bn_addrelu_bwd_nhwc"
    x, dy = _nhwc("x", op, x), _nhwc("dy", op, dy)
    _check_bitmask(op, bitmask, x)
    masked = torch.where(_unpack(bitmask.view(-1)[: -(-x.numel() // _BITS)], x), dy, 0).contiguous()
    group, world = _group(bn_group, op)
    mean, invstd = _stats(x, mini_m, mini_riv)
    counts = local_counts(x, world, mean.dtype)
    dx, dz, dscale, dbias = backward_train(masked, x, None, s, b, mean, invstd, counts, False, group, world, True)
    return [dx, dz, dscale, dbias]


def bn_fwd_nhwc_occupancy() -> int:
    return _MAX_OCCUPANCY


def bn_bwd_nhwc_occupancy() -> int:
    return _MAX_OCCUPANCY


def bn_addrelu_fwd_nhwc_occupancy() -> int:
    return _MAX_OCCUPANCY


def bn_addrelu_bwd_nhwc_occupancy() -> int:
    return _MAX_OCCUPANCY


def get_buffer_size(bn_sync_steps: int) -> int:
    if int(bn_sync_steps) < 0:
        raise ValueError(f"bnp.get_buffer_size: bn_sync_steps must be non-negative, got {bn_sync_steps}")
    return 0


_NO_IPC = (
    "bnp.{}: CUDA IPC buffers are not used here: BatchNorm2d_NHWC's bn_group synchronizes statistics "
    "through a torch.distributed process group (apex.parallel.group_sync), so there is no peer "
    "buffer to share"
)


def get_data_ptr(data):
    raise NotImplementedError(_NO_IPC.format("get_data_ptr"))


def get_remote_data_ptr(handle, offset):
    raise NotImplementedError(_NO_IPC.format("get_remote_data_ptr"))


def close_remote_data(handle):
    raise NotImplementedError(_NO_IPC.format("close_remote_data"))
