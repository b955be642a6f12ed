// The CUDA entry points of this package's ops: defined in the .cu files, registered in cuda_ops.cpp
// (README, "An op": why registrations stay out of the .cu files).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace apex_transformer {
// rope.cu
at::Tensor rope_cuda(const at::Tensor& input, const at::Tensor& freqs, bool transpose_output, bool backward);
at::Tensor rope_cached_cuda(const at::Tensor& input, const at::Tensor& cos, const at::Tensor& sin,
                            bool transpose_output, bool backward);
at::Tensor rope_thd_cuda(const at::Tensor& input, const at::Tensor& cu_seqlens, const at::Tensor& freqs,
                         bool backward);
at::Tensor rope_2d_cuda(const at::Tensor& input, const at::Tensor& cos_h, const at::Tensor& sin_h,
                        const at::Tensor& cos_w, const at::Tensor& sin_w, bool backward);
}  // namespace apex_transformer

namespace apex_transformer::softmax {
// softmax_backward.cu
at::Tensor scaled_softmax_backward_cuda(const at::Tensor& grad_output, const at::Tensor& output, double scale,
                                        bool causal);
void scaled_softmax_backward_inplace_cuda(const at::Tensor& grad_output, const at::Tensor& output, double scale,
                                          bool causal);

// softmax_forward.cu
at::Tensor scaled_softmax_forward_cuda(const at::Tensor& strided_input, const std::optional<at::Tensor>& mask,
                                       double scale, bool causal);
}  // namespace apex_transformer::softmax

namespace apex_transformer {
// swiglu.cu
at::Tensor swiglu_cuda(const at::Tensor& input);
at::Tensor swiglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input);
}  // namespace apex_transformer
