"""apex.contrib.clip_grad: ``clip_grad_norm_``, a drop-in for ``torch.nn.utils.clip_grad_norm_``
on apex-core's multi-tensor L2 norm and scale (``torch.ops.apex_core``)."""

from apex.contrib.clip_grad.clip_grad import clip_grad_norm_

__all__ = ["clip_grad_norm_"]
