// The CUDA entry points of this package's ops: defined in the .cu files, registered in cuda_ops.cpp
// (README, "An op": why registrations stay out of the .cu files).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace apex_contrib_transducer {
// transducer_joint.cu
std::tuple<at::Tensor, at::Tensor> joint_forward_cuda(const at::Tensor& f, const at::Tensor& g, const at::Tensor& f_len,
                                                      const at::Tensor& g_len,
                                                      const std::optional<at::Tensor>& batch_offset,
                                                      int64_t packed_batch, bool relu, double dropout_prob,
                                                      const std::optional<at::Tensor>& seed);
std::tuple<at::Tensor, at::Tensor> joint_backward_cuda(const at::Tensor& grad, const std::optional<at::Tensor>& mask,
                                                       const at::Tensor& f_len, const at::Tensor& g_len,
                                                       const std::optional<at::Tensor>& batch_offset, int64_t max_f_len,
                                                       int64_t max_g_len, double scale);

// transducer_loss.cu
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> loss_forward_cuda(
    const at::Tensor& x, const at::Tensor& label, const at::Tensor& f_len, const at::Tensor& y_len,
    const std::optional<at::Tensor>& batch_offset, int64_t max_f_len, int64_t blank_idx, bool normalize);
at::Tensor loss_backward_cuda(const at::Tensor& x, const at::Tensor& loss_grad, const at::Tensor& alpha,
                              const at::Tensor& beta, const std::optional<at::Tensor>& lse, const at::Tensor& label,
                              const at::Tensor& f_len, const at::Tensor& y_len,
                              const std::optional<at::Tensor>& batch_offset, int64_t blank_idx, bool fuse_softmax);
}  // namespace apex_contrib_transducer
