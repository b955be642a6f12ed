"""What ``amp.init`` does to ``torch.Tensor``'s methods.

Besides the operators below, every function of :mod:`.torch_overrides` that is also a Tensor
method joins the same list here (``x.sum()`` as ``torch.sum(x)``).
"""

import torch

from apex.amp.lists import torch_overrides

MODULE = torch.Tensor

FP16_FUNCS = ["__matmul__"]

FP32_FUNCS = [
    "__ipow__",
    "__pow__",
    "__rpow__",
    # a reduced-precision tensor is cast to fp32 before it leaves the GPU
    "cpu",
]

CASTS = [
    "__add__",
    "__div__",
    "__eq__",
    "__ge__",
    "__gt__",
    "__iadd__",
    "__idiv__",
    "__imul__",
    "__isub__",
    "__itruediv__",
    "__le__",
    "__lt__",
    "__mul__",
    "__ne__",
    "__radd__",
    "__rdiv__",
    "__rmul__",
    "__rsub__",
    "__rtruediv__",
    "__sub__",
    "__truediv__",
]

SEQUENCE_CASTS: list = []

for _list_name in ("FP16_FUNCS", "FP32_FUNCS", "CASTS", "SEQUENCE_CASTS"):
    _ours = globals()[_list_name]
    _ours.extend(name for name in getattr(torch_overrides, _list_name) if hasattr(MODULE, name))
