// The CUDA entry points of this package's ops: defined in the .cu files, registered in cuda_ops.cpp
// (README, "An op": why registrations stay out of the .cu files).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace apex_contrib_group_norm {
// group_norm_backward.cu
std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_backward_cuda(
    const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd, int64_t num_groups,
    c10::string_view act);

// group_norm_forward.cu
std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_forward_cuda(const at::Tensor& x,
                                                                        const std::optional<at::Tensor>& weight,
                                                                        const std::optional<at::Tensor>& bias,
                                                                        int64_t num_groups, double eps,
                                                                        c10::string_view act);
}  // namespace apex_contrib_group_norm
