"""Upstream Apex's ``fused_weight_gradient_mlp_cuda`` extension module, on apex-fused-dense's ops.

Megatron-Core's gradient-accumulation fusion imports it by this name. Both functions add a weight
gradient into a persistent accumulator in place (a GEMM with beta = 1, no temporary):

- ``wgrad_gemm_accum_fp32(input, d_output, main_grad)``: ``main_grad`` float32; ``input`` and
  ``d_output`` float32, float16 or bfloat16;
- ``wgrad_gemm_accum_fp16(input, d_output, main_grad)``: ``main_grad`` of ``input``'s dtype,
  float16 or bfloat16;

computing ``main_grad += d_output_2d.T @ input_2d``, where ``input`` is ``[..., in_features]``,
``d_output`` ``[..., out_features]`` (Megatron's ``[s, b, h]``: every leading dimension is a row
of the reduction, as upstream collapses them) and ``main_grad`` ``[out_features, in_features]``.
Return None. They also run on the CPU (through the PyTorch reference), and are the ops
``torch.ops.apex_fused_dense.wgrad_gemm_accum_fp32`` / ``_fp16``, which ``torch.compile`` traces.
"""

from __future__ import annotations

from apex.fused_dense import _ops


def wgrad_gemm_accum_fp32(input, d_output, main_grad):
    _ops.wgrad_gemm_accum_fp32(input, d_output, main_grad)


def wgrad_gemm_accum_fp16(input, d_output, main_grad):
    _ops.wgrad_gemm_accum_fp16(input, d_output, main_grad)
