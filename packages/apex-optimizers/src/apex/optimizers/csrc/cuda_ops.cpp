// The CUDA kernels of the ops declared in cuda_ops.h, registered for the CUDA dispatch key.
#include <torch/library.h>

#include "cuda_ops.h"

TORCH_LIBRARY_IMPL(apex_optimizers, CUDA, m) {
  m.impl("fused_adagrad", &apex_optimizers::fused_adagrad_cuda);
  m.impl("fused_adam", &apex_optimizers::fused_adam_cuda);
  m.impl("fused_lamb", &apex_optimizers::fused_lamb_cuda);
  m.impl("fused_novograd", &apex_optimizers::fused_novograd_cuda);
  m.impl("fused_sgd", &apex_optimizers::fused_sgd_cuda);
}
