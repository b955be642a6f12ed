"""apex.contrib.xentropy: fused softmax cross entropy with label smoothing (``SoftmaxCrossEntropyLoss``).

Importing it registers its ops (``torch.ops.apex_contrib_xentropy.*``, see ``_ops.py``).
"""

from __future__ import annotations

from apex.contrib.xentropy.softmax_xentropy import SoftmaxCrossEntropyLoss

__all__ = ["SoftmaxCrossEntropyLoss"]
