// The CUDA kernels of the ops declared in cuda_ops.h, registered for the CUDA dispatch key.
#include <torch/library.h>

#include "cuda_ops.h"

TORCH_LIBRARY_IMPL(apex_mlp, CUDA, m) {
  m.impl("mlp_forward", &apex_mlp::mlp_forward_cuda);
  m.impl("mlp_backward", &apex_mlp::mlp_backward_cuda);
}
