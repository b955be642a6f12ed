// The CUDA entry points of this package's ops: defined in the .cu files, registered in cuda_ops.cpp
// (README, "An op": why registrations stay out of the .cu files).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace apex_contrib_focal_loss {
// focal_loss.cu
std::tuple<at::Tensor, at::Tensor> focal_loss_forward_cuda(const at::Tensor& cls_output,
                                                           const at::Tensor& cls_targets_at_level,
                                                           const at::Tensor& num_positives_sum,
                                                           int64_t num_real_classes, double alpha, double gamma,
                                                           double label_smoothing);
at::Tensor focal_loss_backward_cuda(const at::Tensor& grad_output, const at::Tensor& partial_grad,
                                    const at::Tensor& num_positives_sum);
void focal_loss_backward_inplace_cuda(const at::Tensor& partial_grad, const at::Tensor& grad_output,
                                      const at::Tensor& num_positives_sum);
}  // namespace apex_contrib_focal_loss
