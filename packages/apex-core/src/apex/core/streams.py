"""The side stream, from Python: apex/side_stream.h's stream and switch for autograd code.

``side_stream(device)`` is one ``torch.cuda.Stream`` per device for the process's lifetime (a fresh
stream per call would leave cached blocks on every stream it used); ``side_stream_mode()`` reads
``APEX_SIDE_STREAM`` at each call, as the C++ header does: ``"0"`` runs everything on the caller's
stream, ``"layers"`` lets a dense layer's weight gradient run as its own autograd node on the side
stream (overlapping the next layers' backward, apex-fused-dense), anything else (the default ``"1"``)
keeps the side work inside each op's backward, joined before the op returns.
"""

from __future__ import annotations

import os

import torch

__all__ = ["side_stream", "side_stream_mode"]

_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream_mode() -> str:
    """``"0"``, ``"layers"`` or ``"1"``: ``APEX_SIDE_STREAM`` now (unset: ``"1"``)."""
    text = os.environ.get("APEX_SIDE_STREAM", "1")
    return text if text in ("0", "layers") else "1"


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of CUDA ``device`` (its index, or the current device's)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index)
    return stream
