// The CUDA kernels of the ops declared in cuda_ops.h, registered for the CUDA dispatch key.
#include <torch/library.h>

#include "cuda_ops.h"

TORCH_LIBRARY_IMPL(apex_contrib_optimizers, CUDA, m) {
  m.impl("distributed_adam", &apex_contrib_optimizers::distributed_adam_cuda);
  m.impl("distributed_adam_with_param_remainders", &apex_contrib_optimizers::distributed_adam_with_param_remainders_cuda);
  m.impl("lamb_compute_update_term", &apex_contrib_optimizers::lamb_compute_update_term_cuda);
  m.impl("lamb_update_weights", &apex_contrib_optimizers::lamb_update_weights_cuda);
  m.impl("adam", &apex_contrib_optimizers::adam_cuda);
  m.impl("adam_undo", &apex_contrib_optimizers::adam_undo_cuda);
  m.impl("maybe_cast", &apex_contrib_optimizers::maybe_cast_cuda);
  m.impl("strided_check_finite", &apex_contrib_optimizers::strided_check_finite_cuda);
}
