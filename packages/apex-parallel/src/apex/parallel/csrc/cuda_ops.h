// The CUDA entry points of this package's ops: defined in the .cu files, registered in cuda_ops.cpp
// (README, "An op": why registrations stay out of the .cu files).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace apex_parallel {
// batch_norm_backward.cu
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> reduce_bn_cuda(const at::Tensor& grad_output,
                                                                          const at::Tensor& input,
                                                                          const at::Tensor& mean,
                                                                          const at::Tensor& invstd,
                                                                          const std::optional<at::Tensor>& weight);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> reduce_bn_c_last_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const std::optional<at::Tensor>& weight);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> reduce_bn_relu_c_last_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const std::optional<at::Tensor>& z,
    const at::Tensor& mean, const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, bool masked);
at::Tensor batch_norm_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean,
                                    const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                                    const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu, const at::Tensor& count);
at::Tensor batch_norm_backward_c_last_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                           const at::Tensor& mean, const at::Tensor& invstd,
                                           const std::optional<at::Tensor>& weight, const at::Tensor& sum_dy,
                                           const at::Tensor& sum_dy_xmu, const at::Tensor& count);
std::tuple<at::Tensor, at::Tensor> batch_norm_backward_relu_c_last_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const std::optional<at::Tensor>& z,
    const at::Tensor& mean, const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu,
    const at::Tensor& count, bool grad_z);
at::Tensor relu_backward_c_last_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                     const std::optional<at::Tensor>& z, const at::Tensor& mean,
                                     const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                                     const std::optional<at::Tensor>& bias);

// batch_norm_forward.cu
at::Tensor batch_norm_forward_cuda(const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
                                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias);
at::Tensor batch_norm_forward_c_last_cuda(const at::Tensor& input, const std::optional<at::Tensor>& z,
                                          const at::Tensor& mean, const at::Tensor& invstd,
                                          const std::optional<at::Tensor>& weight,
                                          const std::optional<at::Tensor>& bias, bool fuse_relu);

// welford.cu
std::tuple<at::Tensor, at::Tensor> welford_mean_var_cuda(const at::Tensor& input);
std::tuple<at::Tensor, at::Tensor> welford_mean_var_c_last_cuda(const at::Tensor& input);
std::tuple<at::Tensor, at::Tensor> welford_parallel_cuda(const at::Tensor& mean, const at::Tensor& var_biased,
                                                         const at::Tensor& count, double eps,
                                                         const std::optional<at::Tensor>& running_mean,
                                                         const std::optional<at::Tensor>& running_var,
                                                         double momentum);
}  // namespace apex_parallel
