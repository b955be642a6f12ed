"""apex-core's ``multi_tensor_scale`` over lists that mix devices, dtypes and layouts.

The op takes one device and one dtype per list and dense contiguous tensors; amp's gradient lists
can mix all three (fp16 weights with fp32 batchnorm, a model split over GPUs, a channels-last
weight). Tensors are grouped into one op call per (device, input dtype, output dtype); the rare
non-contiguous tensor, and the sparse COO gradient (unscaled in place, as torch.amp.GradScaler
does), go through plain PyTorch with the same semantics. Nothing here reads a value on the host.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

import apex.core  # noqa: F401  (registers torch.ops.apex_core.*)

CHUNK_SIZE = 65536


def scale_into(
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    scale_on: Callable[[torch.device], torch.Tensor | None],
    flag_on: Callable[[torch.device], torch.Tensor],
) -> None:
    """``outputs[i] = inputs[i] * scale`` in fp32 math; the device's flag is set to 1 on inf/NaN inputs.

    ``scale_on(device)`` gives the one-element fp32 scale on that device (None for 1.0),
    ``flag_on(device)`` the one-element int32 overflow flag there. Output and input may be the
    same tensor; a sparse COO input must be coalesced and its own output.
    """
    groups: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
    for x, out in zip(inputs, outputs):
        if x.is_sparse:
            _scale_sparse(x, out, scale_on(x.device), flag_on(x.device))
        elif x.is_contiguous() and out.is_contiguous():
            ins, outs = groups[(x.device, x.dtype, out.dtype)]
            ins.append(x)
            outs.append(out)
        else:
            _scale_one(x, out, scale_on(x.device), flag_on(x.device))
    for (device, _, _), (ins, outs) in groups.items():
        scale = scale_on(device)
        if scale is None:
            torch.ops.apex_core.multi_tensor_scale(CHUNK_SIZE, flag_on(device), ins, outs, 1.0)
        else:
            torch.ops.apex_core.multi_tensor_scale(CHUNK_SIZE, flag_on(device), ins, outs, 1.0, scale)


def _scale_one(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor | None, flag: torch.Tensor) -> None:
    upcast = x.float()
    flag.masked_fill_(~torch.isfinite(upcast).all().reshape(flag.shape), 1)
    out.copy_(upcast if scale is None else upcast * scale.reshape(()))


def _scale_sparse(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor | None, flag: torch.Tensor) -> None:
    if out is not x or not x.is_coalesced():
        raise ValueError("a sparse gradient is unscaled in place and must be coalesced")
    values = x.values()  # a view of a coalesced tensor's values
    upcast = values.float()
    flag.masked_fill_(~torch.isfinite(upcast).all().reshape(flag.shape), 1)
    if scale is not None:
        values.copy_(upcast * scale.reshape(()))


def copy_into(sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> None:
    """``targets[i] = sources[i]`` with the dtype conversion (rounding to nearest), grouped as above."""
    flags: dict[torch.device, torch.Tensor] = {}

    def flag_on(device: torch.device) -> torch.Tensor:
        if device not in flags:
            flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return flags[device]

    scale_into(sources, targets, lambda device: None, flag_on)
