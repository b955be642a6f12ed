"""The loss scalers of the manual ``FP16_Optimizer`` workflow (host-side, as upstream's fp16_utils).

These keep the scale as a Python number and decide on the host; ``amp``'s scaler
(:class:`apex.amp.scaler.LossScaler`) keeps everything on the device instead.
"""

from __future__ import annotations

import torch


def _grads(params):
    return [p.grad for p in params if p.grad is not None]


class LossScaler:
    """A static loss scale (default 1: no scaling); never reports an overflow."""

    def __init__(self, scale: float = 1):
        self.cur_scale = scale

    def has_overflow(self, params) -> bool:
        return False

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        pass

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module, grad_in, grad_out):
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        (loss * self.loss_scale).backward(retain_graph=retain_graph)


class DynamicLossScaler(LossScaler):
    """A loss scale that halves (``/ scale_factor``, not below 1) on an overflow and grows
    (``* scale_factor``) after ``scale_window`` iterations without one.

    Args:
        init_scale: the first scale.
        scale_factor: the growth and backoff factor.
        scale_window: overflow-free iterations between growths.
    """

    def __init__(self, init_scale: float = 2**32, scale_factor: float = 2.0, scale_window: int = 1000):
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def has_overflow(self, params) -> bool:
        """Whether any gradient of ``params`` holds an inf or NaN (one host read)."""
        grads = _grads(params)
        if not grads:
            return False
        device = grads[0].device
        bad = torch.stack([(~torch.isfinite(g)).any().to(device) for g in grads]).any()
        return bool(bad)

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return not bool(torch.isfinite(x).all())

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1
