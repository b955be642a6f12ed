"""Upstream Apex's multi-tensor apply entry point: ``multi_tensor_applier(op, noop_flag, tensor_lists, *args)``."""

from apex.multi_tensor_apply.multi_tensor_apply import DEFAULT_CHUNK_SIZE, MultiTensorApply, multi_tensor_applier

__all__ = ["DEFAULT_CHUNK_SIZE", "MultiTensorApply", "multi_tensor_applier"]
