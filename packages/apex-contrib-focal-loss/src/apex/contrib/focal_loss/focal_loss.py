"""Upstream Apex's ``apex.contrib.focal_loss.focal_loss`` module: ``focal_loss`` and ``FocalLoss``.

The math (sigmoid focal loss of RetinaNet, ignored rows, padding classes, label smoothing, the
normaliser) is in ``apex.contrib.focal_loss._ops``.
"""

from __future__ import annotations

import torch

from apex.contrib.focal_loss import _ops


def focal_loss(
    cls_output: torch.Tensor,
    cls_targets_at_level: torch.Tensor,
    num_positive_sum: torch.Tensor,
    num_real_classes: int,
    alpha: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    r"""Sigmoid focal loss, summed over every element and divided by ``num_positive_sum``.

    With ``p = sigmoid(x)`` for each logit, each element adds
    ``alpha * (1 - p)^gamma * -log(p)`` when its class is the row's target and
    ``(1 - alpha) * p^gamma * -log(1 - p)`` otherwise (``torchvision.ops.sigmoid_focal_loss`` with
    one-hot targets, ``reduction="sum"``, divided by the normaliser). With ``label_smoothing = s``
    the cross-entropy term takes the targets ``1 - s/2`` and ``s/2`` instead of 1 and 0 (the
    modulating factor keeps the hard ones).

    Args:
        cls_output: logits ``[..., C]``, float32, float16, bfloat16 or float64, contiguous. Any
            class count ``C`` (upstream needed a multiple of 8 for float16, 4 for float32).
        cls_targets_at_level: int64 ``[...]`` (``cls_output``'s shape without ``C``): the class
            of each row; ``-2`` ignores the row, ``-1`` (or any value outside
            ``[0, num_real_classes)``) makes every class of the row negative.
        num_positive_sum: the normaliser, a one-element float32 tensor on ``cls_output``'s
            device; read on the device (no host sync).
        num_real_classes: classes ``>= num_real_classes`` are padding and contribute nothing
            (``0 <= num_real_classes <= C``).
        alpha, gamma: the focal loss's weights.
        label_smoothing: ``s`` above; 0 by default.

    Returns a 0-d float32 tensor (float64 for float64 logits), differentiable in ``cls_output``
    (and ``num_positive_sum``, which upstream ignored), once: the forward also computes the
    un-normalised gradient, which the backward scales. ``torch.compile(fullgraph=True)`` traces
    it as the op ``torch.ops.apex_contrib_focal_loss.focal_loss_forward``.
    """
    loss, _ = _ops.differentiable_focal_loss(
        cls_output, cls_targets_at_level, num_positive_sum, num_real_classes, alpha, gamma, label_smoothing
    )
    return loss


class FocalLoss:
    """Upstream's ``FocalLoss.apply(cls_output, cls_targets_at_level, num_positives_sum,
    num_real_classes, alpha, gamma, label_smoothing=0.0)``: :func:`focal_loss`."""

    @staticmethod
    def apply(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma, label_smoothing=0.0):
        return focal_loss(
            cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma, label_smoothing
        )


__all__ = ["FocalLoss", "focal_loss"]
