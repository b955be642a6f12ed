"""Channel-permutation searches for 2:4 sparsity (upstream's ``permutation_search_kernels``).

Upstream runs them with NumPy and an optional pybind11 CUDA extension (``permutation_search_cuda``);
here they are batched tensor ops (``torch.ops.apex_contrib_sparsity.build_permute_map``,
``build_swap_map``, ``sum_after_2_to_4``) on the matrix's own device, CPU or GPU.
"""

from apex.contrib.sparsity.permutation_search_kernels.call_permutation_search_kernels import (
    accelerated_search_for_good_permutation,
)
from apex.contrib.sparsity.permutation_search_kernels.channel_swap import Channel_Swap
from apex.contrib.sparsity.permutation_search_kernels.exhaustive_search import Exhaustive_Search
from apex.contrib.sparsity.permutation_search_kernels.permutation_utilities import sum_after_2_to_4

__all__ = ["Channel_Swap", "Exhaustive_Search", "accelerated_search_for_good_permutation", "sum_after_2_to_4"]
