"""Upstream Apex's module path for the kernel-backed SyncBatchNorm; the same class as apex.parallel.SyncBatchNorm."""

from apex.parallel.sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
