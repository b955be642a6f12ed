from __future__ import annotations

import torch

from apex.optimizers.fused_lamb import FusedLAMB


class FusedMixedPrecisionLamb(FusedLAMB):
    r"""LAMB for reduced-precision (fp16/bf16) parameters with fp32 master weights.

    The math is :class:`FusedLAMB`'s. Learning rate and step count live on the device as
    tensors (``lr`` becomes a one-element fp32 tensor per group, steps are device tensors), so
    the step needs no host sync and can be captured in a CUDA graph; a ``torch.amp.GradScaler``
    hands over its scale and found-inf flag and an overflow skips the step on the device.

    Args:
        params: parameters or parameter groups (fp32 and ``reduced_precision_dtype`` parameters).
        lr: learning rate (float or tensor).
        step: the step count to start from (e.g. when resuming without optimizer state).
        bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode, grad_averaging,
        max_grad_norm, use_nvlamb: as :class:`FusedLAMB`.
        reduced_precision_dtype: if given, every non-fp32 parameter must have this dtype.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        step=0,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.01,
        amsgrad=False,
        adam_w_mode=True,
        grad_averaging=True,
        max_grad_norm=1.0,
        use_nvlamb=False,
        reduced_precision_dtype=None,
    ):
        if reduced_precision_dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(
                f"FusedMixedPrecisionLamb: invalid reduced_precision_dtype={reduced_precision_dtype}; "
                "expected None, torch.float16 or torch.bfloat16"
            )
        self.initial_step = int(step)
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adam_w_mode=adam_w_mode,
            grad_averaging=grad_averaging,
            set_grad_none=True,
            max_grad_norm=max_grad_norm,
            use_nvlamb=use_nvlamb,
            capturable=True,
            master_weights=True,
        )
        self.reduced_precision_dtype = reduced_precision_dtype
        for group in self.param_groups:
            self._prepare_group(group)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "reduced_precision_dtype"):  # not while the base class adds the first groups
            self._prepare_group(self.param_groups[-1])

    def _prepare_group(self, group: dict) -> None:
        """A device tensor lr, and parameters of fp32 or the reduced-precision dtype only."""
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor([float(group["lr"])], dtype=torch.float32, device=device)
        for p in group["params"]:
            if self.reduced_precision_dtype is not None and p.dtype not in (
                torch.float32,
                self.reduced_precision_dtype,
            ):
                raise TypeError(
                    f"FusedMixedPrecisionLamb: parameter of dtype {p.dtype}; expected float32 or "
                    f"reduced_precision_dtype={self.reduced_precision_dtype}"
                )
