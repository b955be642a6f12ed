"""The loss scaler amp keeps per loss: static, or dynamic with growth, backoff, clamps and hysteresis.

The scale, its trackers and the overflow flags live on the device of the loss. A dynamic update
is apex-core's ``update_scale_hysteresis`` followed by a clamp to ``[min_loss_scale,
max_loss_scale]``, both on the device, so a training step never waits for the host. Reading
``loss_scale()`` (logging, checkpoints) is the only host read.

Upstream's attributes (``_loss_scale``, ``_unskipped``, ``_min_loss_scale``, ``_max_loss_scale``,
``_scale_seq_len``, ``_has_overflow``, ``_overflow_buf``, ``dynamic``) read and write this state;
those backed by a device tensor read it on the host and write into it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch

import apex.core  # noqa: F401  (registers torch.ops.apex_core.*)

# The floor of a dynamic scale when no min_loss_scale is given. Upstream had none: a run of
# overflows halved the scale to 0.0, after which the scaled gradients were all zero (no overflow
# seen) and their unscale (0 * 1/0) wrote NaN into the weights. 2**-24 is exact in fp32, its
# reciprocal is too, and a scale this small already means gradients of 2**24 times fp16's range.
DEFAULT_MIN_LOSS_SCALE = 2.0**-24
# The smallest min_loss_scale accepted: below fp32's smallest normal number the reciprocal is inf.
_SMALLEST_SCALE = torch.finfo(torch.float32).tiny


def _positive(name: str, value, *, allow_inf: bool = False) -> float:
    """``value`` as a float if it is a positive number (finite unless ``allow_inf``), else an error naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive number, got {value!r}")
    number = float(value)
    if not number > 0.0 or (math.isinf(number) and not allow_inf):
        raise ValueError(f"{name} must be a positive{'' if allow_inf else ' finite'} number, got {number}")
    return number


def _count(name: str, value, low: int) -> int:
    """``value`` as an int if it is an integer ``>= low``, else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or int(value) != value or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_limits(min_loss_scale, max_loss_scale, names=("min_loss_scale", "max_loss_scale")) -> tuple:
    """(min, max) as floats (min may be None), or an error naming the argument that is wrong."""
    max_name, min_name = names[1], names[0]
    high = _positive(max_name, max_loss_scale, allow_inf=True)
    if min_loss_scale is None:
        return None, high
    low = _positive(min_name, min_loss_scale)
    if low < _SMALLEST_SCALE:
        raise ValueError(
            f"{min_name}={min_loss_scale} is below fp32's smallest normal number ({_SMALLEST_SCALE}): "
            "the gradients could not be unscaled (1/scale is inf)"
        )
    if low > high:
        raise ValueError(f"{min_name}={min_loss_scale} is larger than {max_name}={max_loss_scale}")
    return low, high


class LossScaler:
    """Scale for one loss.

    Args:
        loss_scale: ``"dynamic"``, or a number for a static scale.
        init_scale: first dynamic scale (clamped to ``max_loss_scale``).
        scale_factor: growth factor; a backoff divides by it.
        scale_window: consecutive overflow-free updates after which the scale grows.
        min_loss_scale: lower clamp of a dynamic scale (None: :data:`DEFAULT_MIN_LOSS_SCALE`,
            2**-24, where upstream had no floor and could reach 0.0).
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
        self.min_loss_scale, self.max_loss_scale = check_limits(min_loss_scale, max_loss_scale)
        self.hysteresis = int(hysteresis)
        if self.dynamic:
            initial = min(self.max_loss_scale, _positive("init_scale", init_scale))
        else:
            initial = _positive("loss_scale", loss_scale)
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

    clear_overflow_state = begin_check  # upstream's name

    def check_inverse(self, inv_scale: torch.Tensor, device: torch.device) -> None:
        """Raise ``device``'s overflow flag if ``inv_scale`` is not finite (a 0 or denormal scale).

        Gradients scaled by such a scale are finite (zero), so the check of the inputs alone would
        pass them and the unscale would write inf/NaN.
        """
        flag = self.flag_on(device)
        flag.masked_fill_(~torch.isfinite(inv_scale).reshape(flag.shape), 1)

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

    def update_scale(self, found_inf: torch.Tensor | None = None) -> bool | None:
        """Back off on an overflow (after ``hysteresis`` in a row), grow after ``scale_window`` clean updates.

        ``found_inf`` is a one-element fp32 tensor (non-zero: overflow); the update stays on the
        device and returns None. Without it (upstream's form) the overflow flags raised since
        ``clear_overflow_state()`` are used and, as upstream, whether to skip the step is returned
        (one host read). A static scaler keeps its scale.
        """
        upstream_form = found_inf is None
        if upstream_form:
            found_inf = self.found_inf()
        if not self.dynamic:
            return False if upstream_form else None
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
        self._scale.clamp_(min=self.floor, max=self.max_loss_scale)
        if upstream_form:
            return bool(found_inf.item())
        return None

    @property
    def floor(self) -> float:
        """The lowest dynamic scale: ``min_loss_scale``, or :data:`DEFAULT_MIN_LOSS_SCALE` without one."""
        if self.min_loss_scale is None:
            return min(DEFAULT_MIN_LOSS_SCALE, self.max_loss_scale)
        return self.min_loss_scale

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

    def _write(self, scale: float | None = None, unskipped: int | None = None, hysteresis_left: int | None = None):
        """Set parts of the state: into the device tensors once placed, else the host copies."""
        host = list(self._host)
        for i, (value, tensor) in enumerate(
            ((scale, self._scale), (unskipped, self._growth_tracker), (hysteresis_left, self._hysteresis_tracker))
        ):
            if value is None:
                continue
            host[i] = value
            if tensor is not None:
                tensor.fill_(value)
        self._host = tuple(host)

    def state_dict(self) -> dict:
        return {"loss_scale": self.loss_scale(), "unskipped": self.unskipped, "hysteresis_left": self.hysteresis_left}

    @staticmethod
    def checked_state(state, where: str = "state") -> tuple[float, int, int | None]:
        """(loss_scale, unskipped, hysteresis_left) from a :meth:`state_dict`, or an error naming the bad field."""
        if not isinstance(state, Mapping):
            raise RuntimeError(
                f"{where} must be a dict with the keys 'loss_scale' and 'unskipped' (as amp.state_dict() "
                f"writes), got {type(state).__name__}"
            )
        if "loss_scale" not in state:
            raise RuntimeError(
                f'{where} has no "loss_scale" (keys found: {sorted(state)}); expected the keys "loss_scale" '
                'and "unskipped" that amp.state_dict() writes'
            )
        scale = _positive(f'{where}["loss_scale"]', state["loss_scale"])
        unskipped = _count(f'{where}["unskipped"]', state.get("unskipped", 0), 0)
        hysteresis_left = state.get("hysteresis_left")
        if hysteresis_left is not None:
            hysteresis_left = _count(f'{where}["hysteresis_left"]', hysteresis_left, 0)
        return scale, unskipped, hysteresis_left

    def load_state_dict(self, state: dict) -> None:
        scale, unskipped, hysteresis_left = self.checked_state(state)
        self._write(scale, unskipped, self.hysteresis if hysteresis_left is None else hysteresis_left)

    # --- upstream's attributes -----------------------------------------------------------

    @property
    def _loss_scale(self) -> float:
        return self.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value) -> None:
        self._write(scale=_positive("_loss_scale", value))

    @property
    def _unskipped(self) -> int:
        return self.unskipped

    @_unskipped.setter
    def _unskipped(self, value) -> None:
        self._write(unskipped=_count("_unskipped", value, 0))

    @property
    def _min_loss_scale(self) -> float | None:
        return self.min_loss_scale

    @_min_loss_scale.setter
    def _min_loss_scale(self, value) -> None:
        self.min_loss_scale, _ = check_limits(value, self.max_loss_scale, ("_min_loss_scale", "_max_loss_scale"))

    @property
    def _max_loss_scale(self) -> float:
        return self.max_loss_scale

    @_max_loss_scale.setter
    def _max_loss_scale(self, value) -> None:
        _, self.max_loss_scale = check_limits(self.min_loss_scale, value, ("_min_loss_scale", "_max_loss_scale"))

    @property
    def _scale_seq_len(self) -> int:
        return self.scale_window

    @_scale_seq_len.setter
    def _scale_seq_len(self, value) -> None:
        self.scale_window = _count("_scale_seq_len", value, 1)

    @property
    def _overflow_buf(self) -> torch.Tensor:
        """The int32 overflow flag on the scaler's device (upstream's one buffer)."""
        return self.flag_on(self.scale_tensor().device)

    @property
    def _has_overflow(self) -> bool:
        """Whether an overflow was flagged since the last ``clear_overflow_state()`` (reads the device)."""
        return bool(self._flags) and bool(self.found_inf().item())

    @_has_overflow.setter
    def _has_overflow(self, value: bool) -> None:
        self.begin_check()
        if value:
            self._overflow_buf.fill_(1)
