"""apex.contrib.group_norm: GroupNorm for channels-last (NHWC) tensors with an optional fused SiLU/Swish.

Importing it registers its ops (``torch.ops.apex_contrib_group_norm.group_norm_forward`` and
``group_norm_backward``). Upstream's functions live in :mod:`apex.contrib.group_norm.group_norm`
and are re-exported here.
"""

from __future__ import annotations

from apex.contrib.group_norm.group_norm import (
    GroupNorm,
    cuda_group_norm_nhwc_one_pass,
    cuda_group_norm_nhwc_two_pass,
    cuda_group_norm_v2_nhwc,
    get_cc_and_sm_count,
    group_norm_nhwc_bprop,
    group_norm_nhwc_fprop,
    torch_group_norm,
)

__all__ = [
    "GroupNorm",
    "cuda_group_norm_nhwc_one_pass",
    "cuda_group_norm_nhwc_two_pass",
    "cuda_group_norm_v2_nhwc",
    "get_cc_and_sm_count",
    "group_norm_nhwc_bprop",
    "group_norm_nhwc_fprop",
    "torch_group_norm",
]
