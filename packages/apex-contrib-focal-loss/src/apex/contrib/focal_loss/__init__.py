"""apex.contrib.focal_loss: the sigmoid focal loss of RetinaNet as one forward and one backward kernel.

As in upstream Apex, ``apex.contrib.focal_loss.focal_loss`` is the module holding the function
``focal_loss(cls_output, cls_targets_at_level, num_positive_sum, num_real_classes, alpha, gamma,
label_smoothing=0.0)`` and ``FocalLoss`` (``FocalLoss.apply`` with the same arguments)::

    from apex.contrib.focal_loss import focal_loss
    loss = focal_loss.focal_loss(logits, targets, num_pos, num_real_classes, 0.25, 2.0)

Importing it registers the ops (``torch.ops.apex_contrib_focal_loss.*``); the package also
installs upstream's top-level extension module ``focal_loss_cuda`` on them.
"""

from __future__ import annotations

from apex.contrib.focal_loss import _ops, focal_loss  # noqa: F401
from apex.contrib.focal_loss.focal_loss import FocalLoss

__all__ = ["FocalLoss", "focal_loss"]
