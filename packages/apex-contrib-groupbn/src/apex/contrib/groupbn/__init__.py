"""apex.contrib.groupbn: ``BatchNorm2d_NHWC``, batch norm of an ``(N, H, W, C)`` tensor with an optional
fused residual add + ReLU and statistics shared by groups of ranks, as upstream Apex.

Built on apex-parallel's SyncBatchNorm kernels (``torch.ops.apex_parallel``) and
``torch.distributed`` process groups, composed in ``apex.parallel.group_sync`` (which
apex-contrib-cudnn-gbn shares). Upstream's ``bnp`` extension is the top-level module ``bnp``.
"""

from apex.contrib.groupbn.batch_norm import BatchNorm2d_NHWC

__all__ = ["BatchNorm2d_NHWC"]
