// The CUDA entry points of this package's ops: defined in the .cu files, registered in cuda_ops.cpp
// (README, "An op": why registrations stay out of the .cu files).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace apex_fused_dense {
// fused_dense.cu
at::Tensor linear_forward_cuda(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward_cuda(const at::Tensor& input,
                                                                    const at::Tensor& weight,
                                                                    const at::Tensor& grad_output, bool bias_grad);
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_gelu_linear_forward_cuda(const at::Tensor& input,
                                                                               const at::Tensor& weight1,
                                                                               const at::Tensor& bias1,
                                                                               const at::Tensor& weight2,
                                                                               const at::Tensor& bias2);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_gelu_linear_backward_cuda(
    const at::Tensor& input, const at::Tensor& gelu_in, const at::Tensor& output1, const at::Tensor& weight1,
    const at::Tensor& weight2, const at::Tensor& grad_output);
void wgrad_gemm_accum_fp32_cuda(const at::Tensor& input, const at::Tensor& d_output, const at::Tensor& main_grad);
void wgrad_gemm_accum_fp16_cuda(const at::Tensor& input, const at::Tensor& d_output, const at::Tensor& main_grad);
}  // namespace apex_fused_dense
