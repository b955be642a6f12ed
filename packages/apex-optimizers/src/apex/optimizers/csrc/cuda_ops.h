// The CUDA entry points of this package's ops: defined in the .cu files, registered in cuda_ops.cpp
// (README, "An op": why registrations stay out of the .cu files).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace apex_optimizers {
// fused_adagrad.cu
void fused_adagrad_cuda(int64_t chunk_size, at::TensorList params, at::TensorList grads, at::TensorList state_sums,
                        at::TensorList master_params, double lr, double eps, double weight_decay, bool adagrad_w_mode,
                        const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                        const std::optional<at::Tensor>& found_inf, bool maximize);

// fused_adam.cu
void fused_adam_cuda(int64_t chunk_size, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList master_params, double lr, int64_t step, double beta1,
                     double beta2, double eps, double weight_decay, bool adam_w_mode, bool bias_correction,
                     const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& step_tensor,
                     const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                     bool maximize);

// fused_lamb.cu
void fused_lamb_cuda(int64_t chunk_size, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList master_params, const at::Tensor& global_grad_norm,
                     double lr, int64_t step, double beta1, double beta2, double eps, double weight_decay,
                     bool adam_w_mode, bool bias_correction, bool grad_averaging, double max_grad_norm,
                     bool use_nvlamb, const std::optional<at::Tensor>& lr_tensor,
                     const std::optional<at::Tensor>& step_tensor, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf);

// fused_novograd.cu
void fused_novograd_cuda(int64_t chunk_size, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         const at::Tensor& exp_avg_sq_norms, const at::Tensor& grad_norms,
                         at::TensorList master_params, double lr, int64_t step, double beta1, double beta2, double eps,
                         double weight_decay, bool bias_correction, bool grad_averaging, bool reg_inside_moment,
                         bool init_zero, const std::optional<at::Tensor>& lr_tensor,
                         const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);

// fused_sgd.cu
void fused_sgd_cuda(int64_t chunk_size, at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                    at::TensorList master_params, double lr, double weight_decay, double momentum, double dampening,
                    bool nesterov, bool first_run, bool wd_after_momentum, const std::optional<at::Tensor>& lr_tensor,
                    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                    bool maximize);
}  // namespace apex_optimizers
