// The CUDA kernels of the ops declared in cuda_ops.h, registered for the CUDA dispatch key.
#include <torch/library.h>

#include "cuda_ops.h"

TORCH_LIBRARY_IMPL(apex_transformer, CUDA, m) {
  m.impl("rope", &apex_transformer::rope_cuda);
  m.impl("rope_cached", &apex_transformer::rope_cached_cuda);
  m.impl("rope_thd", &apex_transformer::rope_thd_cuda);
  m.impl("rope_2d", &apex_transformer::rope_2d_cuda);
  m.impl("scaled_softmax_backward", &apex_transformer::softmax::scaled_softmax_backward_cuda);
  m.impl("scaled_softmax_backward_", &apex_transformer::softmax::scaled_softmax_backward_inplace_cuda);
  m.impl("scaled_softmax_forward", &apex_transformer::softmax::scaled_softmax_forward_cuda);
  m.impl("swiglu", &apex_transformer::swiglu_cuda);
  m.impl("swiglu_backward", &apex_transformer::swiglu_backward_cuda);
}
