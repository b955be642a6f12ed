"""apex.contrib.sparsity: ASP (automatic N:M structured sparsity) and channel permutation search.

``create_mask`` computes N:M masks (2:4 by default); ``ASP`` adds mask buffers to a model,
patches its optimizer so that pruned weights stay zero, and optionally permutes input channels
first (``permutation_lib.Permutation``) so that pruning keeps more magnitude. Importing it
registers its ops (``torch.ops.apex_contrib_sparsity.*``): pure PyTorch, on every device.
"""

from __future__ import annotations

from apex.contrib.sparsity.asp import ASP
from apex.contrib.sparsity.sparse_masklib import create_mask

__all__ = ["ASP", "create_mask"]
