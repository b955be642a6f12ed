"""apex.parallel: distributed data parallel training on torch.distributed, as upstream Apex.

- ``DistributedDataParallel`` and ``Reducer`` (apex.parallel.distributed): bucketed gradient
  all-reduce overlapped with backward;
- ``SyncBatchNorm`` (apex.parallel.sync_batchnorm; also apex.parallel.optimized_sync_batchnorm
  as upstream), ``convert_syncbn_model``, ``create_syncbn_process_group``: batch norm with
  statistics over all ranks, on the kernels in ``torch.ops.apex_parallel``;
- ``LARC`` (apex.parallel.LARC); ``apex.parallel.multiproc``, a launcher; ``ReduceOp``.
"""

from torch.distributed import ReduceOp

from apex.parallel.distributed import DistributedDataParallel, Reducer
from apex.parallel.LARC import LARC
from apex.parallel.sync_batchnorm import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group

__all__ = [
    "LARC",
    "DistributedDataParallel",
    "ReduceOp",
    "Reducer",
    "SyncBatchNorm",
    "convert_syncbn_model",
    "create_syncbn_process_group",
]
