"""apex.contrib.nccl_p2p: left/right halo exchanges between neighbouring ranks on torch.distributed.

Upstream's ``nccl_p2p_cuda`` functions (``get_unique_nccl_id``, ``init_nccl_comm``,
``left_right_halo_exchange``, ``left_right_halo_exchange_inplace``, ``add_delay``; also importable
as the top-level module ``nccl_p2p_cuda``) and ``exchange_halos``, the point-to-point exchange they
and the peer-memory and bottleneck halo exchangers share. See
:mod:`apex.contrib.nccl_p2p.halo_exchange` for where they differ from upstream.
"""

from apex.contrib.nccl_p2p.halo_exchange import (
    add_delay,
    exchange_halos,
    get_unique_nccl_id,
    init_nccl_comm,
    left_right_halo_exchange,
    left_right_halo_exchange_inplace,
)

__all__ = [
    "add_delay",
    "exchange_halos",
    "get_unique_nccl_id",
    "init_nccl_comm",
    "left_right_halo_exchange",
    "left_right_halo_exchange_inplace",
]
