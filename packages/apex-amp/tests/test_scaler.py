"""The dynamic loss scaler over long synthetic runs: growth, backoff, clamps, hysteresis, state."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from apex.amp.scaler import LossScaler


class ReferenceScaler:
    """The rules as documented, in plain Python: back off after ``hysteresis`` overflows in a row
    (each further one in the row backs off again), grow after ``window`` clean updates; an overflow
    restarts the clean count; clamps at min and max."""

    def __init__(self, init=2.0**16, factor=2.0, window=2000, lo=None, hi=2.0**24, hysteresis=1):
        self.scale = min(init, hi)
        self.factor, self.window, self.lo, self.hi, self.hysteresis = factor, window, lo, hi, hysteresis
        self.clean = 0
        self.left = hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            self.clean = 0
            self.left -= 1
            if self.left <= 0:
                self.scale /= self.factor
                if self.lo is not None:
                    self.scale = max(self.scale, self.lo)
        else:
            self.left = self.hysteresis
            self.clean += 1
            if self.clean == self.window:
                self.scale = min(self.scale * self.factor, self.hi)
                self.clean = 0


def overflow_pattern(steps: int, seed: int, rate: float, burst: int = 1) -> list[bool]:
    rng = random.Random(seed)
    pattern = [False] * steps
    i = 0
    while i < steps:
        if rng.random() < rate:
            length = rng.randint(1, burst)
            for j in range(i, min(steps, i + length)):
                pattern[j] = True
            i += length
        i += 1
    return pattern


def run(scaler: LossScaler, reference: ReferenceScaler, pattern: list[bool], device) -> list[float]:
    """The scale after each update, checked against the reference at every step."""
    scaler.scale_tensor(torch.device(device))
    flags = {True: torch.ones(1, device=device), False: torch.zeros(1, device=device)}
    history = []
    for step, overflow in enumerate(pattern):
        scaler.update_scale(flags[overflow])
        reference.update(overflow)
        history.append(scaler.loss_scale())
        assert history[-1] == reference.scale, f"step {step}: scale {history[-1]}, expected {reference.scale}"
    assert scaler.unskipped == reference.clean
    return history


def changes(history: list[float]) -> tuple[int, int]:
    pairs = list(itertools.pairwise(history))
    return sum(b > a for a, b in pairs), sum(b < a for a, b in pairs)


def test_defaults_grow_every_2000_clean_steps_and_halve_on_overflow(device):
    # 6000 updates with rare overflows: growths after 2000 clean steps, and backoffs.
    pattern = overflow_pattern(6000, seed=1, rate=1 / 1500)
    pattern[:2300] = [False] * 2300  # a growth at update 2000
    pattern[2300] = pattern[2310] = pattern[5000] = True
    scaler = LossScaler("dynamic")
    history = run(scaler, ReferenceScaler(), pattern, device)
    assert history[1998] == 2.0**16 and history[1999] == 2.0**17 and history[2300] == 2.0**16
    growths, backoffs = changes(history)
    assert growths >= 1 and backoffs >= 3
    assert scaler._scale.device.type == torch.device(device).type


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_hysteresis_and_clamps(hysteresis, device):
    pattern = overflow_pattern(2500, seed=hysteresis, rate=1 / 40, burst=5)
    pattern[:400] = [True] * 40 + [False] * 360  # down to the min clamp, then up to the max clamp
    kwargs = dict(init_scale=2.0**12, scale_window=37, min_loss_scale=2.0**5, max_loss_scale=2.0**14)
    scaler = LossScaler("dynamic", hysteresis=hysteresis, **kwargs)
    reference = ReferenceScaler(2.0**12, 2.0, 37, 2.0**5, 2.0**14, hysteresis)
    history = run(scaler, reference, pattern, device)
    growths, backoffs = changes(history)
    assert growths > 10 and backoffs > 10
    assert min(history) == 2.0**5 and max(history) == 2.0**14  # both clamps were reached and held


def test_growth_stops_at_max_and_never_overflows_fp32(device):
    scaler = LossScaler("dynamic", init_scale=2.0**100, scale_window=1, max_loss_scale=float("inf"))
    clean = torch.zeros(1, device=device)
    for _ in range(40):
        scaler.update_scale(clean)
    assert scaler.loss_scale() == 2.0**127  # the next doubling would be inf, so it is not taken


def test_update_stays_on_the_device(device, monkeypatch):
    scaler = LossScaler("dynamic", scale_window=3)
    scaler.scale_tensor(torch.device(device))

    def no_host_read(self):
        raise AssertionError("host read in the scaler update")

    monkeypatch.setattr(torch.Tensor, "item", no_host_read)
    for overflow in (0.0, 1.0, 0.0, 0.0, 0.0):
        scaler.update_scale(torch.full((1,), overflow, device=device))
    monkeypatch.undo()
    assert scaler.loss_scale() == 2.0**16


def test_static_scaler_ignores_overflows(device):
    scaler = LossScaler(128.0)
    scaler.scale_tensor(torch.device(device))
    for _ in range(5):
        scaler.update_scale(torch.ones(1, device=device))
    assert scaler.loss_scale() == 128.0 and not scaler.dynamic
    assert LossScaler(1.0).is_static_one() and not LossScaler("dynamic").is_static_one()


def test_state_round_trip(device):
    a = LossScaler("dynamic", scale_window=5, hysteresis=3)
    a.scale_tensor(torch.device(device))
    for overflow in (0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0):
        a.update_scale(torch.full((1,), overflow, device=device))
    state = a.state_dict()
    assert state == {"loss_scale": 2.0**15, "unskipped": 2, "hysteresis_left": 3}
    b = LossScaler("dynamic", scale_window=5, hysteresis=3)
    b.load_state_dict(state)  # before first use: kept on the host
    c = LossScaler("dynamic", scale_window=5, hysteresis=3)
    c.scale_tensor(torch.device(device))
    c.load_state_dict(state)  # after: written into the device tensors
    for other in (b, c):
        assert other.state_dict() == state
    for overflow in (0.0, 0.0, 0.0, 1.0, 1.0):
        for s in (a, b, c):
            s.update_scale(torch.full((1,), overflow, device=device))
    assert a.state_dict() == b.state_dict() == c.state_dict()


def test_bad_arguments():
    with pytest.raises(ValueError, match="scale_factor"):
        LossScaler("dynamic", scale_factor=1.0)
    with pytest.raises(ValueError, match="scale_window"):
        LossScaler("dynamic", scale_window=0)
    with pytest.raises(ValueError, match="hysteresis"):
        LossScaler("dynamic", hysteresis=0)
    with pytest.raises(ValueError, match="positive"):
        LossScaler(0.0)
