"""apex.contrib.optimizers: upstream's contrib optimizers.

Here: the deprecated :class:`FusedAdam`, :class:`FusedLAMB` and :class:`FusedSGD` and their
:class:`FP16_Optimizer`. ``DistributedFusedAdam`` and ``DistributedFusedLAMB`` are imported from
their modules (``apex.contrib.optimizers.distributed_fused_adam`` / ``distributed_fused_lamb``), as
upstream. Importing this registers the ops ``torch.ops.apex_contrib_optimizers.*``.
"""

from __future__ import annotations

from apex.contrib.optimizers import _ops  # noqa: F401  (registers the ops)
from apex.contrib.optimizers.fp16_optimizer import FP16_Optimizer
from apex.contrib.optimizers.fused_adam import FusedAdam
from apex.contrib.optimizers.fused_lamb import FusedLAMB
from apex.contrib.optimizers.fused_sgd import FusedSGD

__all__ = ["FP16_Optimizer", "FusedAdam", "FusedLAMB", "FusedSGD"]
