"""Fixtures of the amp tests: a small network with batch norm and a buffer, amp state reset between tests."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from apex import amp

HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class SmallNet(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear, plus a floating buffer; records its activations' dtypes."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.bn = nn.BatchNorm1d(width)
        self.fc2 = nn.Linear(width, 4)
        self.register_buffer("offset", torch.zeros(4))
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x):
        self.seen["input"] = x.dtype
        h = self.fc1(x)
        self.seen["fc1"] = h.dtype
        h = torch.relu(self.bn(h))
        out = self.fc2(h)
        self.seen["fc2"] = out.dtype
        return out + self.offset.to(out.dtype)


@pytest.fixture
def make_net():
    def make(device="cpu", width: int = 16, seed: int = 0) -> SmallNet:
        torch.manual_seed(seed)
        return SmallNet(width).to(device)

    return make


@pytest.fixture(autouse=True)
def _amp_state_restored():
    state = amp._amp_state
    saved = (state.hard_override, state.allow_incoming_model_not_fp32, state.verbosity)
    yield
    state.hard_override, state.allow_incoming_model_not_fp32, state.verbosity = saved


# amp.init's patches of torch are undone after every test by the root conftest.py.


@pytest.fixture
def level_kwargs():
    """``level_kwargs(level, half)``: the keyword that picks ``half`` as the reduced dtype at ``level``."""

    def kwargs(level: str, half: torch.dtype) -> dict:
        if level == "O1":
            return {"autocast_dtype": half}
        if level in ("O2", "O3"):
            return {"cast_model_type": half}
        return {}

    return kwargs
