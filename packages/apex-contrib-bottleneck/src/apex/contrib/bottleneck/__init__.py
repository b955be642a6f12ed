"""apex.contrib.bottleneck: ResNet bottleneck blocks with frozen batch norm, upstream's API.

``Bottleneck``, ``SpatialBottleneck`` (H split over ranks, halos exchanged for the 3x3 convolution),
``FrozenBatchNorm2d`` and the halo exchangers of :mod:`apex.contrib.bottleneck.halo_exchangers`. Built on
apex-contrib-conv-bias-relu's fused convolutions, PyTorch convolutions and torch.distributed (through
apex-contrib-nccl-p2p and apex-contrib-peer-memory); the legacy module is ``fast_bottleneck``.
"""

from apex.contrib.bottleneck.bottleneck import Bottleneck, FrozenBatchNorm2d, SpatialBottleneck
from apex.contrib.bottleneck.halo_exchangers import (
    HaloExchangerAllGather,
    HaloExchangerNoComm,
    HaloExchangerPeer,
    HaloExchangerSendRecv,
    HaloPadder,
)

__all__ = [
    "Bottleneck",
    "FrozenBatchNorm2d",
    "HaloExchangerAllGather",
    "HaloExchangerNoComm",
    "HaloExchangerPeer",
    "HaloExchangerSendRecv",
    "HaloPadder",
    "SpatialBottleneck",
]
