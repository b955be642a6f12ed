// float64 layer norm / RMS norm on CUDA (norm_float64.cpp): upstream's kernels take double, ours
// are built for float32, float16 and bfloat16, so float64 rows are computed with ATen's CUDA ops
// in double (the formulas of _reference.py). Called by norm_forward.cu and norm_backward.cu after
// their argument checks; statistics are float64, as upstream's for double input.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <optional>
#include <tuple>

namespace apex_normalization {

// (output, residual_out or undefined, mean (empty for RMS norm), rstd), mean and rstd of the
// input's leading shape.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_float64(
    const at::Tensor& input, const at::Tensor* residual, const at::Tensor* weight, const at::Tensor* bias,
    c10::IntArrayRef shape, double eps, bool rms, c10::ScalarType out_dtype);

// (grad_input, grad_weight, grad_bias); the weight gradients are empty float32 tensors where not
// computed, as norm_backward_cuda returns them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_float64(
    const at::Tensor& grad_output, const at::Tensor& saved, const at::Tensor* weight, const at::Tensor* bias,
    const at::Tensor& mean, const at::Tensor& rstd, c10::IntArrayRef shape, bool rms, bool memory_efficient,
    bool weight_grads, const at::Tensor* grad_residual_out);

}  // namespace apex_normalization
