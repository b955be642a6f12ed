"""``clip_grad_norm_`` on apex-core's multi-tensor kernels (upstream's ``apex.contrib.clip_grad.clip_grad``)."""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Iterable

import torch

from apex.core import _ops as core_ops
from apex.core import checks

# Elements per CUDA block of the multi-tensor kernels (upstream's multi_tensor_applier default).
CHUNK_SIZE = 2048 * 32

# Off CUDA the L2 path takes torch's foreach norm (float32 sums whatever the storage) and foreach
# multiply (float32 math, one rounding) in place of apex-core's multi-tensor ops, whose references
# there check their kernels (multi_tensor_scale also finds the non-finite elements for its flag,
# which clipping ignores). 4x1M + 2x4M + 30x1024 fp32 gradients on 1 CPU thread: 37.6 ms through
# the ops, 3.7 through torch's (torch.nn.utils.clip_grad_norm_ 3.5). The tests set this False to
# run the ops' path on the CPU.
_TORCH_OFF_CUDA = True

_NONFINITE = (
    "The total norm of order {} for gradients from `parameters` is non-finite, so it cannot be clipped. "
    "To disable this error and scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
)


def _multi_tensor(g: torch.Tensor) -> bool:
    """Whether apex-core's multi-tensor ops take ``g``: float32/16-bit, dense (contiguous or a
    permutation of it, e.g. channels-last)."""
    return g.dtype in checks.FLOAT_DTYPES and g.layout == torch.strided and checks.is_dense(g)


def _group(grads) -> tuple[dict, list]:
    """(multi-tensor groups by (device, dtype), the other gradients)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    others = []
    for g in grads:
        if _multi_tensor(g):
            groups.setdefault((g.device, g.dtype), []).append(g)
        else:
            others.append(g)
    return groups, others


def _flags(groups) -> dict:
    """One int32 overflow flag per device (the ops' noop_flag; clipping ignores it)."""
    return {device: torch.zeros(1, dtype=torch.int32, device=device) for device, _ in groups}


def _torch_path(device: torch.device) -> bool:
    return _TORCH_OFF_CUDA and device.type != "cuda"


def _group_norm(group) -> torch.Tensor:
    """The L2 norm of a group's gradients, (1,) float32, as multi_tensor_l2norm's: float32 sums."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(group, 2.0, dtype=torch.float32))).reshape(1)


def _torch_total_norm(tensors, norm_type: float, foreach) -> torch.Tensor:
    """PyTorch's total norm of ``tensors`` (``torch.nn.utils.get_total_norm``): each tensor's norm,
    then the norm of those on the first tensor's device. Composed here where that function is
    missing (torch < 2.6) or under torch.compile, where Dynamo before torch 2.10 cannot trace its
    grouping of the tensors by device and dtype."""
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None and not torch.compiler.is_compiling():
        return get_total_norm(tensors, norm_type, False, foreach)
    if not tensors:
        return torch.tensor(0.0)
    first = tensors[0].device
    norms = [torch.linalg.vector_norm(t, norm_type).to(first) for t in tensors]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def _total_norm(grads, groups, others, flags, norm_type: float, foreach) -> tuple[torch.Tensor, torch.Tensor]:
    """(the norm to return, in torch's dtype; the norm to clip with, as accurate as computed).

    L2: one apex-core l2norm per (device, dtype) group of float32/16-bit gradients (sums of
    squares in float32 whatever the storage), PyTorch's norm for the others (float64, sparse,
    strided views with gaps), combined on the first gradient's device. Other orders: PyTorch's.
    The returned norm has the dtype PyTorch's would have: that of its per-tensor norms promoted
    together (a bfloat16 norm for bfloat16 gradients), while the clip coefficient comes from the
    float32 (float64 with float64 gradients) value.
    """
    if norm_type != 2.0:
        total = _torch_total_norm(grads, norm_type, foreach)
        return total, total
    norms = [
        _group_norm(group)
        if _torch_path(device)
        else core_ops.multi_tensor_l2norm(CHUNK_SIZE, flags[device], group, False)[0]
        for (device, _), group in groups.items()
    ]
    dtypes = [dtype for _, dtype in groups]
    if others:
        rest = _torch_total_norm(others, norm_type, foreach)
        norms.append(rest.reshape(1))
        dtypes.append(rest.dtype)
    result_dtype = functools.reduce(torch.promote_types, dtypes)
    compute_dtype = torch.float64 if result_dtype == torch.float64 else torch.float32
    first_device = grads[0].device
    if len(norms) == 1:
        exact = norms[0].reshape(()).to(first_device, compute_dtype)
    else:
        exact = torch.linalg.vector_norm(torch.cat([n.to(first_device, compute_dtype) for n in norms]))
    return exact.to(result_dtype), exact


def _scale(groups, others, flags, max_norm: float, total_norm: torch.Tensor) -> None:
    """``g *= min(max_norm / (total_norm + 1e-6), 1)`` for every gradient, without a host sync:
    one apex-core scale per (device, dtype) group, the factor read from device memory."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for (device, _), group in groups.items():
        factor = coef.to(device, torch.float32).reshape(1)
        if _torch_path(device):  # float32 math, one rounding into 16-bit gradients, as the op
            torch._foreach_mul_(group, factor.reshape(()))
        else:
            core_ops.multi_tensor_scale(CHUNK_SIZE, flags[device], group, group, 1.0, factor)
    for g in others:
        g.mul_(coef.to(g.device))


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    r"""Clip the gradient norm of an iterable of parameters, in place; return the total norm.

    .. math::
        n = \Big\| \big(\|g_1\|_p, \dots, \|g_k\|_p\big) \Big\|_p, \qquad
        g_i \leftarrow g_i \cdot \min\Big(\frac{\text{max\_norm}}{n + 10^{-6}}, 1\Big)

    over the parameters' gradients ``g_i`` (parameters without one are skipped), as
    ``torch.nn.utils.clip_grad_norm_``. For ``p = 2`` the norm and the scaling run on apex-core's
    multi-tensor kernels (``torch.ops.apex_core.multi_tensor_l2norm`` / ``multi_tensor_scale``,
    CUDA kernels on CUDA, PyTorch references elsewhere): one launch per (device, dtype) group of
    float32, float16 or bfloat16 gradients, squares summed in float32, and no host
    synchronization. Other gradients (float64, sparse, views with gaps) and other orders take
    PyTorch's norm; the scaling of float32/16-bit gradients is always the multi-tensor kernel's.

    Args:
        parameters (Iterable[Tensor] or Tensor): the parameters whose ``.grad`` is clipped.
        max_norm (float): the largest total norm left after clipping.
        norm_type (float): the order ``p``; ``inf`` for the largest absolute value. Default: 2.0.
        error_if_nonfinite (bool): raise RuntimeError (PyTorch's) when the total norm is NaN or
            infinite, instead of scaling by it. Checking costs a host synchronization.
            Default: False.
        foreach (bool, optional): PyTorch's argument, for the gradients that PyTorch's code
            handles (see above): ``True`` raises where the foreach API is missing, ``False``
            loops per tensor. It does not change the multi-tensor path. Default: None.

    Returns:
        The total norm, a 0-d tensor on the first gradient's device, in the dtype PyTorch's
        would have (the gradients' dtypes promoted together; ``tensor(0.)`` on the CPU without
        gradients). For 16-bit gradients it is rounded once from the float32 norm, which
        PyTorch's rounds per tensor first; the clip factor uses the float32 norm.

    Differences from upstream Apex: bfloat16 gradients take the fused path too (upstream's
    fused float32 and float16 only), every device does (upstream's CUDA only), and ``foreach``
    is accepted as in PyTorch.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        parameters = list(parameters)
        if is_generator and not parameters:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3)
    grads = [p.grad for p in parameters if p.grad is not None]
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    groups, others = _group(grads)
    flags = _flags(groups)
    total_norm, exact = _total_norm(grads, groups, others, flags, norm_type, foreach)
    if error_if_nonfinite and torch.logical_or(total_norm.isnan(), total_norm.isinf()):
        raise RuntimeError(_NONFINITE.format(norm_type))
    _scale(groups, others, flags, max_norm, exact)
    return total_norm
