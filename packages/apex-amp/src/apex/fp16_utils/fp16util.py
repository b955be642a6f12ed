"""Manual mixed-precision helpers: casting networks, and fp32 master copies of half parameters."""

from __future__ import annotations

import torch
from torch import nn

from apex.core.tensor_lists import flatten, unflatten

_PUBLIC_BATCHNORMS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
)


def is_batchnorm(module: nn.Module) -> bool:
    """Any batch-norm layer: torch's, or a class derived from torch's batch-norm base."""
    if isinstance(module, _PUBLIC_BATCHNORMS):
        return True
    return any(cls.__name__ == "_BatchNorm" and cls.__module__.startswith("torch.nn") for cls in type(module).__mro__)


class tofp16(nn.Module):
    """Casts its input to float16 (the first layer of :func:`network_to_half`'s network)."""

    def forward(self, input):
        return input.half()


def BN_convert_float(module: nn.Module) -> nn.Module:
    """Turn every batch-norm layer in ``module`` (recursively) back to float32, in place; returns ``module``.

    Batch-norm statistics in half precision lose accuracy, and cuDNN's batch norm takes float32
    weights with half inputs.
    """
    if is_batchnorm(module):
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module) -> nn.Module:
    """``network`` in float16 behind a layer that casts the input to float16; returns a new Sequential.

    Every floating parameter and buffer is cast (``network.half()``), then every batch-norm layer,
    affine or not, goes back to float32 (:func:`BN_convert_float`), as upstream.
    """
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s own floating-point parameters, their gradients and its buffers to ``dtype`` (not children)."""
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            if param.is_floating_point():
                param.data = param.data.to(dtype=dtype)
                if param.grad is not None and param.grad.is_floating_point():
                    param.grad = param.grad.to(dtype=dtype)
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point():
                setattr(module, name, buf.to(dtype=dtype))


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast ``network``'s floating parameters and buffers to ``dtype`` in place; returns it.

    As upstream, affine batch-norm layers keep their dtype (weights, bias and running statistics);
    a batch norm without ``affine`` has no weights and is cast like any layer, running statistics
    included. Integer buffers (``num_batches_tracked``) are never cast.
    """
    for module in network.modules():
        if is_batchnorm(module) and module.affine:
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """``network`` converted to float16 by :func:`convert_network` (affine batch norm kept float32),
    its floating-point inputs cast to float16 (other inputs, such as indices, pass unchanged)."""

    def __init__(self, network: nn.Module):
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs):
        inputs = tuple(t.half() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs)
        return self.network(*inputs)


def prep_param_lists(model: nn.Module, flat_master: bool = False):
    """(model_params, master_params): the model's trainable parameters and float32 copies of them.

    With ``flat_master`` the masters are one flat float32 parameter (the model's parameters must
    then share a dtype), with its gradient allocated.
    """
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        try:
            flat = flatten([p.detach() for p in model_params]).float()
        except TypeError as exc:
            raise TypeError(
                "prep_param_lists: the model mixes parameter dtypes; use flat_master=False, or FP16_Optimizer"
            ) from exc
        master = nn.Parameter(flat)
        master.grad = torch.empty_like(flat)
        return model_params, [master]
    master_params = [p.detach().clone().float() for p in model_params]
    for p in master_params:
        p.requires_grad_(True)
    return model_params, master_params


def model_grads_to_master_grads(model_params, master_params, flat_master: bool = False) -> None:
    """Copy the model's gradients into the masters' (a master whose model parameter has none gets None)."""
    if flat_master:
        master_params[0].grad.copy_(flatten([p.grad for p in model_params]))
        return
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        master.grad.copy_(model.grad)


def master_params_to_model_params(model_params, master_params, flat_master: bool = False) -> None:
    """Copy the masters' values into the model's parameters (rounding to their dtype)."""
    with torch.no_grad():
        if flat_master:
            for model, master in zip(model_params, unflatten(master_params[0].detach(), model_params)):
                model.copy_(master)
            return
        for model, master in zip(model_params, master_params):
            model.copy_(master)


# Upstream's name for torch's in-place gradient clipping (``clip_grad_norm`` on torch 0.4 and older).
clip_grad_norm = torch.nn.utils.clip_grad_norm_


def to_python_float(t) -> float:
    """A one-element tensor (or a number, or a sequence of one) as a Python number."""
    if hasattr(t, "item"):
        return t.item()
    return t[0]
