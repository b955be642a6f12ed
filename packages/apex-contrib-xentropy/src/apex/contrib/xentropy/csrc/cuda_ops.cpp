// The CUDA kernels of the ops declared in cuda_ops.h, registered for the CUDA dispatch key.
#include <torch/library.h>

#include "cuda_ops.h"

TORCH_LIBRARY_IMPL(apex_contrib_xentropy, CUDA, m) {
  m.impl("softmax_cross_entropy_forward", &apex_contrib_xentropy::forward_cuda);
  m.impl("softmax_cross_entropy_backward", &apex_contrib_xentropy::backward_cuda);
  m.impl("softmax_cross_entropy_backward_", &apex_contrib_xentropy::backward_inplace_cuda);
}
