// The CUDA kernels of the ops declared in cuda_ops.h, registered for the CUDA dispatch key.
#include <torch/library.h>

#include "cuda_ops.h"

TORCH_LIBRARY_IMPL(apex_contrib_focal_loss, CUDA, m) {
  m.impl("focal_loss_forward", &apex_contrib_focal_loss::focal_loss_forward_cuda);
  m.impl("focal_loss_backward", &apex_contrib_focal_loss::focal_loss_backward_cuda);
  m.impl("focal_loss_backward_", &apex_contrib_focal_loss::focal_loss_backward_inplace_cuda);
}
