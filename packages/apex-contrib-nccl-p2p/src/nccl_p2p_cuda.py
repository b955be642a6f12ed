"""Upstream Apex's ``nccl_p2p_cuda`` extension module, on torch.distributed (apex-contrib-nccl-p2p).

Upstream's functions and argument orders:

- ``get_unique_nccl_id(n) -> uint8 [n, 128]`` (random bytes: only compared across ranks);
- ``init_nccl_comm(unique_nccl_id, my_rank, num_ranks) -> int`` handle: a torch.distributed group over
  the default group's ranks (collective; the id must agree on every rank);
- ``left_right_halo_exchange_inplace(handle, left_rank, right_rank, left_output_halo,
  right_output_halo, left_input_halo, right_input_halo) -> None`` (negative rank: zero that input);
- ``left_right_halo_exchange(handle, left_rank, right_rank, left_output_halo, right_output_halo)
  -> [left_input_halo, right_input_halo]``;
- ``add_delay(delay) -> None`` (checked, otherwise a no-op).

Details and differences: :mod:`apex.contrib.nccl_p2p.halo_exchange`.
"""

from apex.contrib.nccl_p2p.halo_exchange import (
    add_delay,
    get_unique_nccl_id,
    init_nccl_comm,
    left_right_halo_exchange,
    left_right_halo_exchange_inplace,
)

__all__ = [
    "add_delay",
    "get_unique_nccl_id",
    "init_nccl_comm",
    "left_right_halo_exchange",
    "left_right_halo_exchange_inplace",
]
