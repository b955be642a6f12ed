"""Upstream Apex's ``distributed_lamb_cuda`` extension module (DistributedFusedLAMB's kernels), on
apex-contrib-optimizers' ops.

- ``multi_tensor_lamb_compute_update_term(chunk_size, noop_flag, tensor_lists, per_tensor_beta1,
  per_tensor_beta2, per_tensor_beta3, per_tensor_bias_correction, step, per_tensor_epsilon, mode,
  per_tensor_decay, global_scale, global_grad_norm, max_grad_norm)``: lists ``[g, p, m, v, u]``
  (``torch.ops.apex_contrib_optimizers.lamb_compute_update_term``).
- ``multi_tensor_lamb_update_weights(chunk_size, noop_flag, tensor_lists, per_tensor_param_norm,
  per_tensor_update_norm, update_norm_offset, learning_rate, per_tensor_decay, global_grad_norm,
  use_nvlamb)``: lists ``[u, p, p_copy]`` (``...lamb_update_weights``).

Tensor arguments as upstream's current kernels take them (``step`` int32, ``global_scale``,
``global_grad_norm`` and ``learning_rate`` one-element fp32 device tensors, ``update_norm_offset``
int64). CUDA kernels on GPUs, the PyTorch references elsewhere. Differences from upstream:
``per_tensor_beta3`` is used (upstream's kernel ignores it and takes ``1 - beta1``, so its
``grad_averaging=False`` had no effect); ``m``/``v``/``u`` must be fp32.
"""

from __future__ import annotations

from apex.contrib.optimizers import _ops
from apex.core import __version__

__all__ = ["__version__", "multi_tensor_lamb_compute_update_term", "multi_tensor_lamb_update_weights"]


def multi_tensor_lamb_compute_update_term(
    chunk_size, noop_flag, tensor_lists, per_tensor_beta1, per_tensor_beta2, per_tensor_beta3,
    per_tensor_bias_correction, step, per_tensor_epsilon, mode, per_tensor_decay, global_scale,
    global_grad_norm, max_grad_norm,
):  # fmt: skip
    if len(tensor_lists) != 5:
        raise ValueError(
            f"multi_tensor_lamb_compute_update_term: expected lists [g, p, m, v, u], got {len(tensor_lists)}"
        )
    g, p, m, v, u = (list(t) for t in tensor_lists)
    _ops.lamb_compute_update_term(
        noop_flag, g, p, m, v, u, per_tensor_beta1, per_tensor_beta2, per_tensor_beta3,
        per_tensor_bias_correction, step, per_tensor_epsilon, int(mode), per_tensor_decay, global_scale,
        global_grad_norm, float(max_grad_norm),
    )  # fmt: skip


def multi_tensor_lamb_update_weights(
    chunk_size, noop_flag, tensor_lists, per_tensor_param_norm, per_tensor_update_norm, update_norm_offset,
    learning_rate, per_tensor_decay, global_grad_norm, use_nvlamb,
):  # fmt: skip
    if len(tensor_lists) != 3:
        raise ValueError(f"multi_tensor_lamb_update_weights: expected lists [u, p, p_copy], got {len(tensor_lists)}")
    u, p, p_copy = (list(t) for t in tensor_lists)
    _ops.lamb_update_weights(
        noop_flag, u, p, p_copy, per_tensor_param_norm, per_tensor_update_norm, update_norm_offset,
        learning_rate, per_tensor_decay, global_grad_norm, bool(use_nvlamb),
    )  # fmt: skip
