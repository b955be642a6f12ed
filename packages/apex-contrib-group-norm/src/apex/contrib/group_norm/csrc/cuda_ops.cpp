// The CUDA kernels of the ops declared in cuda_ops.h, registered for the CUDA dispatch key.
#include <torch/library.h>

#include "cuda_ops.h"

TORCH_LIBRARY_IMPL(apex_contrib_group_norm, CUDA, m) {
  m.impl("group_norm_backward", &apex_contrib_group_norm::group_norm_backward_cuda);
  m.impl("group_norm_forward", &apex_contrib_group_norm::group_norm_forward_cuda);
}
