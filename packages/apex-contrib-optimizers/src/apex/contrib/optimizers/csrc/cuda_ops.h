// The CUDA entry points of this package's ops: defined in the .cu files, registered in cuda_ops.cpp
// (README, "An op": why registrations stay out of the .cu files).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace apex_contrib_optimizers {
// distributed_adam.cu
void distributed_adam_cuda(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList params,
                           at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList grads,
                           at::TensorList params_out, const at::Tensor& grad_scale, double lr, double beta1,
                           double beta2, double eps, int64_t step, int64_t adam_mode, bool bias_correction,
                           double weight_decay, const std::optional<at::Tensor>& lr_tensor,
                           const std::optional<at::Tensor>& step_tensor);
void distributed_adam_with_param_remainders_cuda(
    int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList params, at::TensorList param_remainders,
    at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList grads, at::TensorList params_out,
    const at::Tensor& grad_scale, double lr, double beta1, double beta2, double eps, int64_t step, int64_t adam_mode,
    bool bias_correction, double weight_decay, const std::optional<at::Tensor>& lr_tensor,
    const std::optional<at::Tensor>& step_tensor);

// distributed_lamb.cu
void lamb_compute_update_term_cuda(const at::Tensor& noop_flag, at::TensorList g, at::TensorList p, at::TensorList m,
                                   at::TensorList v, at::TensorList u, const at::Tensor& beta1,
                                   const at::Tensor& beta2, const at::Tensor& beta3,
                                   const at::Tensor& bias_correction, const at::Tensor& step,
                                   const at::Tensor& epsilon, int64_t moment_mode, const at::Tensor& decay,
                                   const at::Tensor& global_scale, const at::Tensor& global_grad_norm,
                                   double max_grad_norm);
void lamb_update_weights_cuda(const at::Tensor& noop_flag, at::TensorList u, at::TensorList p, at::TensorList p_copy,
                              const at::Tensor& param_norm, const at::Tensor& update_norm,
                              const at::Tensor& update_norm_offset, const at::Tensor& learning_rate,
                              const at::Tensor& decay, const at::Tensor& global_grad_norm, bool use_nvlamb);

// legacy_adam.cu
void adam_cuda(at::TensorList p, at::TensorList p_copy, at::TensorList m, at::TensorList v, at::TensorList g,
               double lr, double beta1, double beta2, double eps, double grad_scale, int64_t step, int64_t eps_mode,
               bool bias_correction, double decay, bool reversible);
void adam_undo_cuda(const at::Tensor& overflow_flag, at::TensorList p, at::TensorList m, at::TensorList v,
                    at::TensorList g, double lr, double beta1, double beta2, double eps, double grad_scale,
                    int64_t step, int64_t eps_mode, bool bias_correction, double decay);
void maybe_cast_cuda(const at::Tensor& overflow_flag, at::TensorList p_in, at::TensorList p_out);
void strided_check_finite_cuda(const at::Tensor& overflow_flag, const at::Tensor& p_copy, int64_t stride,
                               bool clear_overflow_first);
}  // namespace apex_contrib_optimizers
