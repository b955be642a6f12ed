"""The loss scaler amp keeps per loss: static, or dynamic with growth, backoff, clamps and hysteresis.

The scale, its trackers and the overflow flags live on the device of the loss. A dynamic update
is apex-core's ``update_scale_hysteresis`` followed by a clamp to ``[min_loss_scale,
max_loss_scale]``, both on the device, so a training step never waits for the host. Reading
``loss_scale()`` (logging, checkpoints) is the only host read.
"""

from __future__ import annotations

import torch

import apex.core  # noqa: F401  (registers torch.ops.apex_core.*)


class LossScaler:
    """Scale for one loss.

    Args:
        loss_scale: ``"dynamic"``, or a number for a static scale.
        init_scale: first dynamic scale (clamped to ``max_loss_scale``).
        scale_factor: growth factor; a backoff divides by it.
        scale_window: consecutive overflow-free updates after which the scale grows.
        min_loss_scale: lower clamp of a dynamic scale (None: none).
        max_loss_scale: upper clamp of a dynamic scale.
        hysteresis: consecutive overflows needed before the scale backs off (1: every one). An
            overflow always resets the growth count and skips the step.
    """

    def __init__(
        self,
        loss_scale,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
        hysteresis: int = 1,
    ):
        self.dynamic = loss_scale == "dynamic"
        if scale_factor <= 1.0:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor}")
        if scale_window < 1:
            raise ValueError(f"scale_window must be positive, got {scale_window}")
        if hysteresis < 1:
            raise ValueError(f"hysteresis must be positive, got {hysteresis}")
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_loss_scale = None if min_loss_scale is None else float(min_loss_scale)
        self.max_loss_scale = float(max_loss_scale)
        self.hysteresis = int(hysteresis)
        initial = min(self.max_loss_scale, float(init_scale)) if self.dynamic else float(loss_scale)
        if not initial > 0.0:
            raise ValueError(f"the loss scale must be positive, got {initial}")
        # Host copies until the first use on a device, then device tensors.
        self._host = (initial, 0, self.hysteresis)
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_tracker: torch.Tensor | None = None
        self._flags: dict[torch.device, torch.Tensor] = {}

    # --- device state --------------------------------------------------------------------

    def _tensors_on(self, device: torch.device) -> None:
        if self._scale is None:
            scale, unskipped, hysteresis_left = self._host
            self._scale = torch.full((1,), scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.full((1,), unskipped, dtype=torch.int32, device=device)
            self._hysteresis_tracker = torch.full((1,), hysteresis_left, dtype=torch.int32, device=device)
        elif self._scale.device != device:
            self._scale = self._scale.to(device)
            self._growth_tracker = self._growth_tracker.to(device)
            self._hysteresis_tracker = self._hysteresis_tracker.to(device)

    @property
    def device(self) -> torch.device | None:
        return None if self._scale is None else self._scale.device

    def scale_tensor(self, device: torch.device | None = None) -> torch.Tensor:
        """The scale as a one-element fp32 tensor; the scaler settles on ``device`` at its first use."""
        if self._scale is None:
            self._tensors_on(torch.device("cpu") if device is None else torch.device(device))
        if device is None or self._scale.device == torch.device(device):
            return self._scale
        return self._scale.to(device, non_blocking=True)

    def inv_scale_tensor(self, device: torch.device) -> torch.Tensor:
        return self.scale_tensor(device).reciprocal()

    def begin_check(self) -> None:
        """Zero the overflow flags before a new round of checks."""
        for flag in self._flags.values():
            flag.zero_()

    def flag_on(self, device: torch.device) -> torch.Tensor:
        """This scaler's int32 overflow flag on ``device`` (zero since ``begin_check``, until an overflow)."""
        flag = self._flags.get(device)
        if flag is None:
            flag = self._flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return flag

    def found_inf(self) -> torch.Tensor:
        """1.0 if any flag was set since ``begin_check``, else 0.0: fp32, one element, on the scaler's device."""
        device = self.scale_tensor().device
        found = None
        for flag in self._flags.values():
            f = flag.to(device, non_blocking=True).float()
            found = f if found is None else torch.maximum(found, f)
        return found if found is not None else torch.zeros(1, dtype=torch.float32, device=device)

    def is_static_one(self) -> bool:
        """A static scale of 1.0: gradients need no unscaling and overflows are not acted on."""
        return not self.dynamic and self._host[0] == 1.0

    # --- the update ----------------------------------------------------------------------

    def update_scale(self, found_inf: torch.Tensor) -> None:
        """Back off on an overflow (after ``hysteresis`` in a row), grow after ``scale_window`` clean updates.

        ``found_inf`` is a one-element fp32 tensor (non-zero: overflow). A static scaler keeps its scale.
        """
        if not self.dynamic:
            return
        self._tensors_on(found_inf.device if self._scale is None else self._scale.device)
        torch.ops.apex_core.update_scale_hysteresis(
            self._scale,
            self._growth_tracker,
            self._hysteresis_tracker,
            found_inf.to(self._scale.device).reshape(1),
            self.scale_factor,
            1.0 / self.scale_factor,
            self.scale_window,
            self.hysteresis,
        )
        self._scale.clamp_(min=self.min_loss_scale, max=self.max_loss_scale)

    # --- host views ----------------------------------------------------------------------

    def loss_scale(self) -> float:
        """The current scale as a Python float (reads the device)."""
        return self._host[0] if self._scale is None else float(self._scale.item())

    @property
    def unskipped(self) -> int:
        """Overflow-free updates since the last growth or overflow."""
        return self._host[1] if self._growth_tracker is None else int(self._growth_tracker.item())

    @property
    def hysteresis_left(self) -> int:
        return self._host[2] if self._hysteresis_tracker is None else int(self._hysteresis_tracker.item())

    def state_dict(self) -> dict:
        return {"loss_scale": self.loss_scale(), "unskipped": self.unskipped, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        host = (
            float(state["loss_scale"]),
            int(state.get("unskipped", 0)),
            int(state.get("hysteresis_left", self.hysteresis)),
        )
        if self._scale is None:
            self._host = host
        else:
            self._scale.fill_(host[0])
            self._growth_tracker.fill_(host[1])
            self._hysteresis_tracker.fill_(host[2])
            self._host = host
