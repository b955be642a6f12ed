// The CUDA entry points of this package's ops: defined in the .cu files, registered in cuda_ops.cpp
// (README, "An op": why registrations stay out of the .cu files).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace apex_normalization {
// norm_backward.cu
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& saved, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd,
    c10::SymIntArrayRef sym_shape, bool rms, bool memory_efficient, c10::ScalarType input_dtype, bool weight_grads,
    const std::optional<at::Tensor>& grad_residual_out);

// norm_forward.cu
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_forward_cuda(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    c10::SymIntArrayRef normalized_shape, double eps, bool rms, bool /*memory_efficient: autograd's*/,
    std::optional<c10::ScalarType> output_dtype);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_norm_forward_cuda(
    const at::Tensor& input, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, c10::SymIntArrayRef normalized_shape, double eps, bool rms,
    bool /*memory_efficient: autograd's*/, std::optional<c10::ScalarType> output_dtype);
}  // namespace apex_normalization
