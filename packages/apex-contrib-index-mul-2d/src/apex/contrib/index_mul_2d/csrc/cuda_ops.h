// The CUDA entry points of this package's ops: defined in the .cu files, registered in cuda_ops.cpp
// (README, "An op": why registrations stay out of the .cu files).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace apex_contrib_index_mul_2d {
// index_mul_2d.cu
at::Tensor index_mul_2d_cuda(const at::Tensor& in1, const at::Tensor& in2, const at::Tensor& idx1);
std::tuple<at::Tensor, at::Tensor> index_mul_2d_backward_cuda(const at::Tensor& grad_out, const at::Tensor& in1,
                                                              const at::Tensor& in2, const at::Tensor& idx1);
std::tuple<at::Tensor, at::Tensor, at::Tensor> index_mul_2d_backward_backward_cuda(
    const at::Tensor& grad_grad_in1, const at::Tensor& grad_grad_in2, const at::Tensor& grad_out,
    const at::Tensor& in1, const at::Tensor& in2, const at::Tensor& idx1);
}  // namespace apex_contrib_index_mul_2d
