// The CUDA entry points of this package's ops: defined in the .cu files, registered in cuda_ops.cpp
// (README, "An op": why registrations stay out of the .cu files).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace apex_mlp {
// mlp.cu
std::vector<at::Tensor> mlp_forward_cuda(const at::Tensor& input, at::TensorList weights, at::TensorList biases,
                                         int64_t activation, bool relu_masks);
std::vector<at::Tensor> mlp_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                          at::TensorList weights, at::TensorList outputs, at::TensorList masks,
                                          bool bias, int64_t activation, bool input_grad);
}  // namespace apex_mlp
