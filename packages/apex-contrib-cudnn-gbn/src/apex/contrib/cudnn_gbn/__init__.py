"""apex.contrib.cudnn_gbn: ``GroupBatchNorm2d``, batch norm of a channels_last ``(N, C, H, W)`` tensor
whose training statistics cover groups of consecutive ranks, as upstream Apex.

Built on apex-parallel's SyncBatchNorm kernels (``torch.ops.apex_parallel``) and ``torch.distributed``
process groups, through apex-parallel's ``group_sync``; upstream's extension module is the
top-level ``cudnn_gbn_lib``.
"""

from apex.contrib.cudnn_gbn.batch_norm import GroupBatchNorm2d

__all__ = ["GroupBatchNorm2d"]
