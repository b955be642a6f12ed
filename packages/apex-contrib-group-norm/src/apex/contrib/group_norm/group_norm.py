"""GroupNorm for channels-last (NHWC) tensors with an optional fused SiLU/Swish, and upstream's functions.

Upstream's names and signatures (``apex.contrib.group_norm.group_norm``): :class:`GroupNorm`,
:func:`group_norm_nhwc_fprop`, :func:`group_norm_nhwc_bprop`, :func:`cuda_group_norm_nhwc_one_pass`,
:func:`cuda_group_norm_nhwc_two_pass`, :func:`cuda_group_norm_v2_nhwc`, :func:`torch_group_norm`.
They run on the ops ``torch.ops.apex_contrib_group_norm.group_norm_forward``/``_backward``: a CUDA
kernel for CUDA tensors, the PyTorch reference elsewhere (the CPU too).
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import init
from torch.nn.parameter import Parameter

from apex.contrib.group_norm import _ops
from apex.core import checks

__all__ = ["GroupNorm"]

_ACTS = (None, "", "silu", "swish")


def _normalize_act(act, where: str) -> str:
    """ "" or "silu"/"swish" from upstream's spellings (None, any case); a clear error otherwise."""
    if act is None:
        return ""
    if not isinstance(act, str) or act.lower() not in _ops.ACTIVATIONS:
        raise ValueError(f"{where}: act must be one of None, '', 'silu', 'swish' (any case), got {act!r}")
    return act.lower()


@functools.cache
def get_cc_and_sm_count(device_index: int):
    """((major, minor) compute capability, multiprocessor count) of a CUDA device, as upstream's."""
    props = torch.cuda.get_device_properties(device_index)
    return (props.major, props.minor), props.multi_processor_count


# Off CUDA the module takes torch's group norm (torch_group_norm): the op's reference there is Python,
# written to check the kernels. 4x320x32x32 channels-last forward + backward on 2 CPU cores: 15.8 ms
# (fp32) and 18.6 (bf16) through the reference, 5.5 and 3.6 through F.group_norm + SiLU (nn.GroupNorm +
# SiLU the same). The tests set this False to run the op's path on the CPU.
_TORCH_OFF_CUDA = True


def _channels_last_view(x: Tensor) -> Tensor:
    """``x`` ``(N, C, *spatial)`` as ``(N, *spatial, C)``: a view, contiguous when ``x`` is channels-last."""
    return x.movedim(1, -1)


def is_channels_last(x: Tensor) -> bool:
    """Whether ``x`` ``(N, C, *spatial)`` is laid out channels-last: its memory is ``(N, *spatial, C)`` in
    order (for 4-D input ``x.is_contiguous(memory_format=torch.channels_last)``, for 5-D
    ``torch.channels_last_3d``; a 2-D ``(N, C)`` contiguous tensor is too)."""
    if x.dim() == 4 and x.numel():  # the common case, without making a view (host time per call)
        return x.is_contiguous(memory_format=torch.channels_last)
    return x.dim() >= 2 and _channels_last_view(x).is_contiguous()


def _kernel_takes(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> bool:
    """Whether the op (kernel) serves this call; see :class:`GroupNorm` for the rule."""
    if x.dtype not in checks.FLOAT_DTYPES or not is_channels_last(x):
        return False
    allowed = (x.dtype, torch.float32)
    if weight is not None and weight.dtype not in allowed:
        return False
    if bias is not None and (bias.dtype not in allowed or (weight is not None and bias.dtype != weight.dtype)):
        return False
    return True


def _forward(x: Tensor, num_groups: int, weight, bias, eps: float, act: str):
    """(y channels-last like x, mean, rstd) through the differentiable forward op."""
    y, mean, rstd = _ops.group_norm_forward(_channels_last_view(x), weight, bias, num_groups, eps, act)
    return y.movedim(-1, 1), mean, rstd


def torch_group_norm(x: Tensor, g: int, w: Tensor | None, b: Tensor | None, eps: float, act: str = "") -> Tensor:
    """``F.group_norm`` (+ SiLU for ``act`` "silu"/"swish"), upstream's PyTorch path.

    As upstream, ``x`` is computed in the weight's dtype when the two differ and the result cast
    back to ``x``'s. Differs on purpose: ``w``/``b`` may be None, and an unknown ``act`` raises
    (upstream silently skipped the activation).
    """
    act = _normalize_act(act, "torch_group_norm")
    xdtype = x.dtype
    if w is not None and w.dtype != xdtype:
        x = x.to(dtype=w.dtype)
    y = F.group_norm(x, g, w, b, eps)
    if act:
        y = F.silu(y)
    return y.to(dtype=xdtype) if y.dtype != xdtype else y


def group_norm_nhwc_fprop(
    x: Tensor,
    G: int,
    weight: Tensor,
    bias: Tensor,
    eps: float,
    act: str | None = None,
    passes: int = 1,
    use_group_norm_v2: bool = False,
) -> tuple[Tensor, Tensor]:
    """Group norm (+ SiLU) of channels-last ``x`` ``(N, C, H, W)``: ``(y, sums)``, differentiable in
    ``x``, ``weight`` and ``bias``.

    ``y`` is channels-last like ``x``; ``sums`` float32 ``(2 * N * G,)``: ``(mean, rstd)`` pairs per
    (sample, group), which :func:`group_norm_nhwc_bprop` reads back (upstream's buffer has its own
    kernels' layout; only its own bprop reads it either way). ``passes`` (1 or 2) and
    ``use_group_norm_v2`` chose among upstream's kernels; they are checked and otherwise ignored:
    one kernel serves every shape here, its plan chosen by the shape. Any ``G`` dividing ``C``,
    any ``C``; weight/bias float32 or ``x``'s dtype.
    """
    act = _normalize_act(act, "group_norm_nhwc_fprop")
    _check_nhwc("group_norm_nhwc_fprop", "x", x)
    _check_passes("group_norm_nhwc_fprop", passes)
    y, mean, rstd = _forward(x, G, weight, bias, eps, act)
    return y, torch.stack((mean, rstd), dim=-1).reshape(-1)


def group_norm_nhwc_bprop(
    grad_output: Tensor,
    sums: Tensor,
    x: Tensor,
    G: int,
    weight: Tensor,
    bias: Tensor,
    eps: float,
    act: str | None = None,
    passes: int = 1,
    use_group_norm_v2: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)`` of :func:`group_norm_nhwc_fprop`, from its ``sums``; ``dx`` channels-last.

    ``grad_output`` in another layout is made channels-last first (a copy; upstream does the same,
    with a printed warning). ``eps``, ``passes`` and ``use_group_norm_v2`` are upstream's
    arguments; the statistics come from ``sums``.
    """
    act = _normalize_act(act, "group_norm_nhwc_bprop")
    _check_nhwc("group_norm_nhwc_bprop", "x", x)
    _check_passes("group_norm_nhwc_bprop", passes)
    if sums.dtype != torch.float32 or sums.numel() != 2 * x.shape[0] * G:
        raise ValueError(
            f"group_norm_nhwc_bprop: sums must be float32 with 2 * N * G = {2 * x.shape[0] * G} elements "
            f"(group_norm_nhwc_fprop's), got {sums.dtype} with {sums.numel()}"
        )
    stats = sums.reshape(x.shape[0], G, 2)
    mean, rstd = stats[..., 0].contiguous(), stats[..., 1].contiguous()
    dy = _channels_last_view(grad_output).contiguous()
    dx, dweight, dbias = _ops.group_norm_backward(dy, _channels_last_view(x), weight, bias, mean, rstd, G, act)
    return dx.movedim(-1, 1), dweight, dbias


def _check_nhwc(where: str, name: str, x: Tensor) -> None:
    if x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(
            f"{where}: {name} must be a 4-D channels-last tensor (x.is_contiguous(memory_format="
            f"torch.channels_last)), got shape {tuple(x.shape)} strides {x.stride()}"
        )


def _check_passes(where: str, passes: int) -> None:
    if passes not in (1, 2):
        raise ValueError(f"{where}: passes must be 1 or 2, got {passes}")


def cuda_group_norm_nhwc_one_pass(x, G, weight, bias, eps, act=None) -> Tensor:
    """:func:`group_norm_nhwc_fprop`'s output (upstream's one-pass kernel; one kernel here)."""
    return group_norm_nhwc_fprop(x, G, weight, bias, eps, act, passes=1)[0]


def cuda_group_norm_nhwc_two_pass(x, G, weight, bias, eps, act=None) -> Tensor:
    """:func:`group_norm_nhwc_fprop`'s output (upstream's two-pass kernel; one kernel here)."""
    return group_norm_nhwc_fprop(x, G, weight, bias, eps, act, passes=2)[0]


def cuda_group_norm_v2_nhwc(x, G, weight, bias, eps, act=None) -> Tensor:
    """:func:`group_norm_nhwc_fprop`'s output (upstream's Blackwell v2 kernel; one kernel here, every GPU)."""
    return group_norm_nhwc_fprop(x, G, weight, bias, eps, act, use_group_norm_v2=True)[0]


class GroupNorm(torch.nn.Module):
    r"""Group normalization over channels-last input, with an optional fused SiLU (Swish).

    .. math::
        y = \mathrm{act}\Big(\frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma + \beta\Big)

    mean and biased variance over each group of ``num_channels / num_groups`` channels and all
    spatial positions of one sample; ``act`` the identity or SiLU ``z * sigmoid(z)``.

    Args:
        num_groups: groups to split the channels into; must divide ``num_channels``.
        num_channels: ``C`` of the ``(N, C, *)`` input.
        eps: added to the variance. Default 1e-5.
        affine: learnable per-channel ``weight`` (ones) and ``bias`` (zeros). Default True.
        device, dtype: of the parameters.
        act: None or "" (none), "silu" or "swish" (the same), any case; anything else raises
            ValueError.

    Which path runs: on CUDA the fused op (``torch.ops.apex_contrib_group_norm.group_norm_forward``,
    its CUDA kernel; :meth:`_check_legality` says whether an input qualifies) when the input is float32, float16 or
    bfloat16, laid out channels-last (its memory in ``(N, *spatial, C)`` order: for 4-D input
    ``input.is_contiguous(memory_format=torch.channels_last)``, 5-D ``torch.channels_last_3d``),
    and the parameters (if affine) are float32 or the input's dtype. Any other input (NCHW
    contiguous, float64, float16 input with bfloat16 parameters, ...) goes to :func:`torch_group_norm`
    (``F.group_norm`` + SiLU), as upstream's unsupported cases do, and so does every input off CUDA
    (the op's PyTorch reference is there to check the kernel; torch's CPU group norm is several times
    faster). The output has the input's dtype and, on the fused path, its channels-last layout.

    Differs from upstream on purpose: the fused path takes any ``num_groups`` dividing ``C`` and
    any ``C`` (upstream: ``num_groups`` 16 or 32 and 24 listed channel counts), affine=False
    too; weights of another 16-bit dtype than the input's take the PyTorch path
    (upstream fused those). A bad ``act`` raises at construction (upstream fell back to PyTorch and
    skipped the activation). Construction needs no GPU. Like upstream's, this is a
    ``torch.nn.Module``, not a ``torch.nn.GroupNorm`` subclass (code that rewrites ``nn.GroupNorm``
    modules would drop the activation).
    """

    __constants__: ClassVar[list[str]] = ["num_groups", "num_channels", "eps", "affine", "act"]
    num_groups: int
    num_channels: int
    eps: float
    affine: bool
    act: str | None

    # Upstream's limits of its fused path, kept for code that reads them; ours has none of these.
    SUPPORTED_CHANNELS = frozenset(
        (
            128,
            256,
            320,
            384,
            448,
            512,
            640,
            768,
            896,
            960,
            1024,
            1280,
            1344,
            1536,
            1792,
            1920,
            2048,
            2240,
            2560,
            2688,
            3072,
            3136,
            3584,
            4096,
        )
    )
    SUPPORTED_GROUPS = frozenset([16, 32])
    # Where upstream's v2 (Blackwell) kernels applied; read by _check_v2_legality only.
    GN_V2_SUPPORTED_CHANNELS = frozenset(
        [
            (64, 1280),
            (64, 2560),
            (256, 640),
            (256, 1280),
            (256, 1920),
            (256, 2560),
            (1024, 320),
            (1024, 640),
            (1024, 960),
            (1024, 1280),
            (1024, 1920),
            (4096, 320),
            (4096, 640),
            (4096, 960),
        ]
    )
    GN_V2_SUPPORTED_DTYPES = frozenset([(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)])
    GN_V2_SUPPORTED_GROUPS_SWISH = frozenset([(16, True), (32, False)])
    GN_V2_SUPPORTED_LOWER_BOUND_SM_COUNT: ClassVar[dict] = {(10, 0): 148}
    # The (input, parameter) dtype pairs of our fused path.
    SUPPORTED_DTYPES = frozenset(
        [(dtype, dtype) for dtype in checks.FLOAT_DTYPES]
        + [(torch.float16, torch.float32), (torch.bfloat16, torch.float32)]
    )

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        device=None,
        dtype=None,
        act=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        if num_groups <= 0 or num_channels % num_groups != 0:
            raise ValueError(f"GroupNorm: num_channels ({num_channels}) must be divisible by num_groups ({num_groups})")
        _normalize_act(act, "GroupNorm")
        self.num_groups = num_groups
        self.num_channels = num_channels
        self.eps = eps
        self.affine = affine
        self.act = act.lower() if act else act
        if affine:
            self.weight = Parameter(torch.empty(num_channels, **factory_kwargs))
            self.bias = Parameter(torch.empty(num_channels, **factory_kwargs))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.affine:
            init.ones_(self.weight)
            init.zeros_(self.bias)

    def _check_legality(self, input: Tensor) -> bool:
        """Whether ``input`` takes the fused op (upstream's name; see the class docstring for the rule)."""
        return _kernel_takes(input, self.weight, self.bias)

    def _check_v2_legality(self, input: Tensor) -> bool:
        """Whether upstream would have picked its Blackwell (v2) kernel for ``input``: kept for code that
        asks; here one kernel serves every input that :meth:`_check_legality` accepts."""
        if input.dim() != 4 or not input.is_cuda or not self.affine:
            return False
        cc, sm_count = get_cc_and_sm_count(input.device.index)
        bound = self.GN_V2_SUPPORTED_LOWER_BOUND_SM_COUNT.get(cc)
        return (
            (input.shape[2] * input.shape[3], self.num_channels) in self.GN_V2_SUPPORTED_CHANNELS
            and (self.num_groups, self.act in ("silu", "swish")) in self.GN_V2_SUPPORTED_GROUPS_SWISH
            and (input.dtype, self.weight.dtype) in self.GN_V2_SUPPORTED_DTYPES
            and bound is not None
            and sm_count >= bound
        )

    def forward(self, input: Tensor) -> Tensor:
        act = _normalize_act(self.act, "GroupNorm")
        if input.dim() >= 2 and input.shape[1] != self.num_channels:
            raise ValueError(
                f"GroupNorm: input has {input.shape[1]} channels (dim 1 of shape {tuple(input.shape)}), "
                f"expected num_channels={self.num_channels}"
            )
        if _kernel_takes(input, self.weight, self.bias) and (input.is_cuda or not _TORCH_OFF_CUDA):
            return _forward(input, self.num_groups, self.weight, self.bias, self.eps, act)[0]
        return torch_group_norm(input, self.num_groups, self.weight, self.bias, self.eps, act)

    def extra_repr(self) -> str:
        text = f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"
        return text + (f", act={self.act}" if self.act else "")
