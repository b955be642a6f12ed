"""Upstream Apex's ``focal_loss_cuda`` extension module, on apex-contrib-focal-loss's ops.

Upstream's functions, argument orders and returns; these run on the CPU too (the PyTorch
references), and take any class count and bfloat16 as well. The math is in
``apex.contrib.focal_loss._ops``.

- ``forward(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
  smoothing_factor) -> [loss, partial_grad]``: the 0-d float32 loss (already divided by
  ``num_positives_sum``) and the un-normalised gradient of the logits;
- ``backward(grad_output, partial_grad, num_positives_sum) -> partial_grad``: scales
  ``partial_grad`` in place by ``grad_output / num_positives_sum`` and returns it.
"""

from __future__ import annotations

import torch

import apex.contrib.focal_loss._ops  # noqa: F401  (registers the ops)

_ops = torch.ops.apex_contrib_focal_loss


def forward(
    cls_output: torch.Tensor,
    cls_targets_at_level: torch.Tensor,
    num_positives_sum: torch.Tensor,
    num_real_classes: int,
    alpha: float,
    gamma: float,
    smoothing_factor: float,
) -> list[torch.Tensor]:
    loss, partial_grad = _ops.focal_loss_forward(
        cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma, smoothing_factor
    )
    return [loss, partial_grad]


def backward(grad_output: torch.Tensor, partial_grad: torch.Tensor, num_positives_sum: torch.Tensor) -> torch.Tensor:
    _ops.focal_loss_backward_(partial_grad, grad_output, num_positives_sum)
    return partial_grad


__all__ = ["backward", "forward"]
