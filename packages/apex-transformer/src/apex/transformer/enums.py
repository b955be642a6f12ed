"""Upstream Apex's ``apex.transformer.enums``: the names Megatron-style code imports."""

from __future__ import annotations

import enum


class LayerType(enum.Enum):
    encoder = 1
    decoder = 2


class AttnType(enum.Enum):
    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    """How attention scores are masked: ``padding`` by a mask tensor, ``causal`` by position."""

    padding = 1
    causal = 2


class ModelType(enum.Enum):
    encoder_or_decoder = 1
    encoder_and_decoder = 2


__all__ = ["AttnMaskType", "AttnType", "LayerType", "ModelType"]
