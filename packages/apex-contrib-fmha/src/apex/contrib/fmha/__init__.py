"""apex.contrib.fmha: upstream Apex's fused multi-head attention for packed variable-length sequences
(BERT), ``FMHAFun`` and ``FMHA``, on public torch ops (FlashAttention varlen, nested-tensor SDPA, a
padded reference on the CPU). The legacy extension module ``fmhalib`` ships alongside."""

from __future__ import annotations

from apex.contrib.fmha.fmha import FMHA, FMHAFun

__all__ = ["FMHA", "FMHAFun"]
