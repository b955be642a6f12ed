"""apex.optimizers: fused multi-tensor optimizers with upstream Apex's constructors."""

from apex.optimizers.fused_adagrad import FusedAdagrad
from apex.optimizers.fused_adam import FusedAdam
from apex.optimizers.fused_lamb import FusedLAMB
from apex.optimizers.fused_mixed_precision_lamb import FusedMixedPrecisionLamb
from apex.optimizers.fused_novograd import FusedNovoGrad
from apex.optimizers.fused_sgd import FusedSGD

__all__ = ["FusedAdagrad", "FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad", "FusedSGD"]
