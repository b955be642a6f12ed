// The CUDA kernels of the ops declared in cuda_ops.h, registered for the CUDA dispatch key.
#include <torch/library.h>

#include "cuda_ops.h"

TORCH_LIBRARY_IMPL(apex_parallel, CUDA, m) {
  m.impl("reduce_bn", &apex_parallel::reduce_bn_cuda);
  m.impl("reduce_bn_c_last", &apex_parallel::reduce_bn_c_last_cuda);
  m.impl("reduce_bn_relu_c_last", &apex_parallel::reduce_bn_relu_c_last_cuda);
  m.impl("batch_norm_backward", &apex_parallel::batch_norm_backward_cuda);
  m.impl("batch_norm_backward_c_last", &apex_parallel::batch_norm_backward_c_last_cuda);
  m.impl("batch_norm_backward_relu_c_last", &apex_parallel::batch_norm_backward_relu_c_last_cuda);
  m.impl("relu_backward_c_last", &apex_parallel::relu_backward_c_last_cuda);
  m.impl("batch_norm_forward", &apex_parallel::batch_norm_forward_cuda);
  m.impl("batch_norm_forward_c_last", &apex_parallel::batch_norm_forward_c_last_cuda);
  m.impl("welford_mean_var", &apex_parallel::welford_mean_var_cuda);
  m.impl("welford_mean_var_c_last", &apex_parallel::welford_mean_var_c_last_cuda);
  m.impl("welford_parallel", &apex_parallel::welford_parallel_cuda);
}
