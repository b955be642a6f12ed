// The CUDA entry points of this package's ops: defined in the .cu files, registered in cuda_ops.cpp
// (README, "An op": why registrations stay out of the .cu files).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace apex_core {
// multi_tensor_axpby.cu
void multi_tensor_axpby_cuda(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList x, at::TensorList y,
                             at::TensorList out, double a, double b, int64_t arg_to_check);

// multi_tensor_l2norm.cu
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_cuda(int64_t chunk_size, const at::Tensor& noop_flag,
                                                            at::TensorList inputs, bool per_tensor);
std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm_cuda(int64_t chunk_size, const at::Tensor& noop_flag,
                                                                    at::TensorList inputs, at::TensorList outputs,
                                                                    const at::Tensor& inv_scale, bool per_tensor);

// multi_tensor_scale.cu
void multi_tensor_scale_cuda(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList inputs,
                             at::TensorList outputs, double scale, const std::optional<at::Tensor>& scale_tensor);

// update_scale_hysteresis.cu
void update_scale_hysteresis_cuda(const at::Tensor& current_scale, const at::Tensor& growth_tracker,
                                  const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                                  double growth_factor, double backoff_factor, int64_t growth_interval,
                                  int64_t hysteresis);
}  // namespace apex_core
