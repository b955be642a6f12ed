from __future__ import annotations

DEFAULT_CHUNK_SIZE = 2048 * 32


class MultiTensorApply:
    """Calls ``op(chunk_size, noop_flag, tensor_lists, *args)``; ``chunk_size`` is elements per CUDA block.

    Always available: the ops dispatch to apex's CUDA kernels when loaded and to their PyTorch
    reference otherwise (``apex report`` says which), so ``available`` is kept only for code
    written against upstream Apex.
    """

    available = True
    warned = False

    def __init__(self, chunk_size: int):
        if chunk_size <= 0:
            raise ValueError(f"MultiTensorApply: chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size

    @staticmethod
    def check_avail() -> None:
        """Kept for upstream compatibility; there is nothing to check."""

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(DEFAULT_CHUNK_SIZE)
