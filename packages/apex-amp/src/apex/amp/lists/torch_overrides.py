"""What ``amp.init`` does to the ``torch`` namespace.

The batched matmuls are always on the reduced-precision list: upstream moved them to the fp32 list
only for CUDA older than 9.1, which no supported torch runs on.
"""

import torch

MODULE = torch

FP16_FUNCS = [
    # the functions torch.nn's layers call with their weights
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "conv_tbc",
    "prelu",
    # BLAS
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "mm",
    "mv",
    "addbmm",
    "baddbmm",
    "bmm",
]

FP32_FUNCS = [
    # pointwise
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    # reductions
    "cumprod",
    "cumsum",
    "dist",
    "norm",
    "prod",
    "std",
    "sum",
    "var",
    "renorm",
]

CASTS = [
    # several tensor operands
    "addcdiv",
    "addcmul",
    "atan2",
    "cross",
    "bilinear",
    "dot",
    # elementwise or whole-tensor arithmetic
    "add",
    "div",
    "mul",
    # comparisons
    "eq",
    "equal",
    "ge",
    "gt",
    "le",
    "lt",
    "ne",
]

SEQUENCE_CASTS = ["cat", "stack"]
