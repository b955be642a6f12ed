"""apex.contrib.peer_memory: ``PeerMemoryPool`` and ``PeerHaloExchanger1d``, upstream's API on torch.distributed.

Upstream shares CUDA memory between the GPUs of a node (IPC handles) and exchanges halos with a kernel
that writes into the neighbours' buffers. Ours keep the classes, arguments and in-place semantics; the
pool's tensors are ordinary local tensors and the halos travel by torch.distributed point-to-point
(apex-contrib-nccl-p2p's ``exchange_halos``), on any backend. The legacy module ``peer_memory_cuda`` maps
what it can (local raw buffers and views of them) and raises NotImplementedError for the IPC functions.
"""

from apex.contrib.peer_memory.peer_halo_exchanger_1d import PeerHaloExchanger1d
from apex.contrib.peer_memory.peer_memory import PeerMemoryPool

__all__ = ["PeerHaloExchanger1d", "PeerMemoryPool"]
