// The CUDA kernels of the ops declared in cuda_ops.h, registered for the CUDA dispatch key.
#include <torch/library.h>

#include "cuda_ops.h"

TORCH_LIBRARY_IMPL(apex_core, CUDA, m) {
  m.impl("multi_tensor_axpby", &apex_core::multi_tensor_axpby_cuda);
  m.impl("multi_tensor_l2norm", &apex_core::multi_tensor_l2norm_cuda);
  m.impl("multi_tensor_unscale_l2norm", &apex_core::multi_tensor_unscale_l2norm_cuda);
  m.impl("multi_tensor_scale", &apex_core::multi_tensor_scale_cuda);
  m.impl("update_scale_hysteresis", &apex_core::update_scale_hysteresis_cuda);
}
