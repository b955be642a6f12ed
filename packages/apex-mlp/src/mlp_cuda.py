"""Upstream Apex's ``mlp_cuda`` extension module, on apex-mlp's ops.

Code written against upstream (its ``apex.mlp.MlpFunction``, and projects calling the extension
directly) imports this module by that name. The functions keep upstream's names, argument orders and
returns, and call ``torch.ops.apex_mlp``, so they also run on the CPU (through the PyTorch references):

- ``forward(bias, activation, inputs) -> [output, reserved]``: ``inputs`` is ``[input, *weights,
  *biases]`` (the biases only when ``bias``), ``activation`` 0 (none), 1 (relu) or 2 (sigmoid);
  ``reserved`` is one flat tensor of the input's dtype holding every layer's output, row-major, layer
  after layer (the last, the output, included).
- ``backward(bias, activation, grad_o, fwd_outputs, inputs) -> [grad_input, *grad_weights,
  *grad_biases]``: one gradient per tensor of ``inputs``, ``fwd_outputs`` being ``forward``'s return.

Unlike upstream's module, non-contiguous tensors are made contiguous instead of read as if they were,
and bfloat16 is accepted. ``reserved`` is assembled by a copy (the ops keep each layer's output as its
own tensor): the public ``apex.mlp`` API does not pay it.
"""

from __future__ import annotations

from apex.mlp import _ops


def _layers(bias, inputs):
    tensors = [t.contiguous() for t in inputs]
    weights, biases = _ops._split(bool(bias), tensors[1:])
    return tensors[0], weights, biases


def forward(bias, activation, inputs):
    input, weights, biases = _layers(bias, inputs)
    outputs = _ops.mlp_forward(input, weights, biases, int(activation), False)  # no relu masks: unused
    reserved = outputs[0].new_empty((sum(y.numel() for y in outputs),))
    offset = 0
    for y in outputs:
        reserved[offset : offset + y.numel()].copy_(y.view(-1))
        offset += y.numel()
    return [outputs[-1], reserved]


def backward(bias, activation, grad_o, fwd_outputs, inputs):
    input, weights, _ = _layers(bias, inputs)
    reserved = fwd_outputs[1]
    outputs, offset = [], 0
    for w in weights:
        numel = input.shape[0] * w.shape[0]
        outputs.append(reserved[offset : offset + numel].view(input.shape[0], w.shape[0]))
        offset += numel
    return _ops.mlp_backward(grad_o.contiguous(), input, weights, outputs, [], bool(bias), int(activation), True)
