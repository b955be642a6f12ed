// The CUDA kernels of the ops declared in cuda_ops.h, registered for the CUDA dispatch key.
#include <torch/library.h>

#include "cuda_ops.h"

TORCH_LIBRARY_IMPL(apex_fused_dense, CUDA, m) {
  m.impl("linear_forward", &apex_fused_dense::linear_forward_cuda);
  m.impl("linear_backward", &apex_fused_dense::linear_backward_cuda);
  m.impl("linear_gelu_linear_forward", &apex_fused_dense::linear_gelu_linear_forward_cuda);
  m.impl("linear_gelu_linear_backward", &apex_fused_dense::linear_gelu_linear_backward_cuda);
  m.impl("wgrad_gemm_accum_fp32", &apex_fused_dense::wgrad_gemm_accum_fp32_cuda);
  m.impl("wgrad_gemm_accum_fp16", &apex_fused_dense::wgrad_gemm_accum_fp16_cuda);
}
