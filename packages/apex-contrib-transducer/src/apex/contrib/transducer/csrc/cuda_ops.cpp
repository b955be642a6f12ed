// The CUDA kernels of the ops declared in cuda_ops.h, registered for the CUDA dispatch key.
#include <torch/library.h>

#include "cuda_ops.h"

TORCH_LIBRARY_IMPL(apex_contrib_transducer, CUDA, m) {
  m.impl("joint_forward", &apex_contrib_transducer::joint_forward_cuda);
  m.impl("joint_backward", &apex_contrib_transducer::joint_backward_cuda);
  m.impl("loss_forward", &apex_contrib_transducer::loss_forward_cuda);
  m.impl("loss_backward", &apex_contrib_transducer::loss_backward_cuda);
}
