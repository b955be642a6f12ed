"""apex.contrib.transducer: the RNN-T joint (with fused ReLU and dropout) and the RNN-T loss (with the
softmax's backward folded in), padded or packed, as upstream Apex's ``apex.contrib.transducer``.

Importing it registers its ops (``torch.ops.apex_contrib_transducer.*``).
"""

from __future__ import annotations

from apex.contrib.transducer.transducer import TransducerJoint, TransducerLoss

__all__ = ["TransducerJoint", "TransducerLoss"]
