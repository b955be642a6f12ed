// The CUDA kernels of the ops declared in cuda_ops.h, registered for the CUDA dispatch key.
#include <torch/library.h>

#include "cuda_ops.h"

TORCH_LIBRARY_IMPL(apex_contrib_index_mul_2d, CUDA, m) {
  m.impl("index_mul_2d", &apex_contrib_index_mul_2d::index_mul_2d_cuda);
  m.impl("index_mul_2d_backward", &apex_contrib_index_mul_2d::index_mul_2d_backward_cuda);
  m.impl("index_mul_2d_backward_backward", &apex_contrib_index_mul_2d::index_mul_2d_backward_backward_cuda);
}
