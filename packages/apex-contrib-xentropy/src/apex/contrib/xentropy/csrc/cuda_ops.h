// The CUDA entry points of this package's ops: defined in the .cu files, registered in cuda_ops.cpp
// (README, "An op": why registrations stay out of the .cu files).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace apex_contrib_xentropy {
// xentropy.cu
std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& logits, const at::Tensor& labels, double smoothing,
                                                std::optional<int64_t> padding_idx, bool half_to_float);
at::Tensor backward_cuda(const at::Tensor& grad_losses, const at::Tensor& logits, const at::Tensor& lse,
                         const at::Tensor& labels, double smoothing, std::optional<int64_t> padding_idx);
void backward_inplace_cuda(const at::Tensor& grad_losses, at::Tensor& logits, const at::Tensor& lse,
                           const at::Tensor& labels, double smoothing, std::optional<int64_t> padding_idx);
}  // namespace apex_contrib_xentropy
