// The CUDA kernels of the ops declared in cuda_ops.h, registered for the CUDA dispatch key.
#include <torch/library.h>

#include "cuda_ops.h"

TORCH_LIBRARY_IMPL(apex_normalization, CUDA, m) {
  m.impl("norm_backward", &apex_normalization::norm_backward_cuda);
  m.impl("norm_forward", &apex_normalization::norm_forward_cuda);
  m.impl("add_norm_forward", &apex_normalization::add_norm_forward_cuda);
}
