// fused_adam: one multi-tensor pass of Adam / AdamW over params, grads, exp_avgs, exp_avg_sqs
// (and fp32 master_params). See _adam_reference in apex/optimizers/_ops.py for the math.
//
// Per element it reads the current parameter (the master copy if given), the gradient and
// both moments, and writes the moments and the parameter (and its low-precision copy): 28
// bytes per fp32 parameter, the least Adam can move. With grad_scale it also writes the
// unscaled gradient back (as torch's GradScaler leaves gradients): one more store of the
// gradient's size (4 bytes per fp32 gradient, 2 per fp16/bf16). maximize negates the gradient
// as it is read (no extra traffic). The step-dependent scalars (step size,
// bias corrections, decay) are worked out once per block.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <optional>
#include <type_traits>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/multi_tensor_apply.cuh>
#include <apex/vectorized.cuh>

#include "optimizer_common.cuh"
#include "cuda_ops.h"

namespace {

constexpr const char* kOp = "fused_adam";

struct AdamArgs {
  apex_optimizers::DeviceScalars scalars;
  const float* step_tensor;  // may be null
  float lr;
  float bias_correction1;       // 1 - beta1^step from the host (1 without bias correction)
  float sqrt_bias_correction2;  // sqrt(1 - beta2^step) from the host
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  bool adam_w_mode;
  bool bias_correction;
  bool maximize;
};

// Lists: 0 the parameter the update is computed on (fp32 master copy when kMaster, else the
// params), 1 grads, 2 exp_avgs, 3 exp_avg_sqs, and with kMaster 4 the params (written only).
template <typename Param, typename Grad, bool kMaster>
struct AdamFunctor {
  using Current = std::conditional_t<kMaster, float, Param>;
  static constexpr int kDepth = kMaster ? 5 : 4;

  AdamArgs args;

  __device__ void operator()(const apex::Chunk<kDepth>& chunk) const {
    if (args.scalars.skip()) return;
    const float lr = args.scalars.lr(args.lr);
    float bias_correction1 = args.bias_correction1;
    float sqrt_bias_correction2 = args.sqrt_bias_correction2;
    if (args.step_tensor != nullptr && args.bias_correction) {
      const float step = *args.step_tensor;
      bias_correction1 = apex_optimizers::device_bias_correction(args.beta1, step);
      sqrt_bias_correction2 = __fsqrt_rn(apex_optimizers::device_bias_correction(args.beta2, step));
    }
    const float step_size = __fdiv_rn(lr, bias_correction1);
    const float inv_sqrt_bias_correction2 = __frcp_rn(sqrt_bias_correction2);
    const float inv_grad_scale = args.scalars.inv_grad_scale();
    const bool write_grads = args.scalars.grad_scale != nullptr;
    const bool maximize = args.maximize;
    const float decoupled_decay = args.adam_w_mode ? lr * args.weight_decay : 0.0f;
    const float l2_decay = args.adam_w_mode ? 0.0f : args.weight_decay;
    const float beta1 = args.beta1;
    const float beta2 = args.beta2;
    const float one_minus_beta1 = 1.0f - beta1;
    const float one_minus_beta2 = 1.0f - beta2;
    const float eps = args.eps;

    Current* current = chunk.template data<Current>(0);
    Grad* grad = chunk.template data<Grad>(1);
    float* exp_avg = chunk.template data<float>(2);
    float* exp_avg_sq = chunk.template data<float>(3);
    Param* params = kMaster ? chunk.template data<Param>(4) : nullptr;

    auto body = [&](auto group) {
      typename decltype(group)::Values p, g, m, v;
      group.load(p, current);
      group.load(g, grad);
      group.load(m, exp_avg);
      group.load(v, exp_avg_sq);
      group.for_each_value([&](int i, int j) {
        float pj = p[i][j];
        const float unscaled = g[i][j] * inv_grad_scale;
        g[i][j] = unscaled;
        float gj = maximize ? -unscaled : unscaled;
        // Decay terms only when asked for: 0 * inf would turn an inf parameter's state NaN.
        // p - (lr * wd) * p rather than p * (1 - lr * wd): no rounding of a factor near 1,
        // whose error would repeat every step.
        if (decoupled_decay != 0.0f) pj -= decoupled_decay * pj;
        if (l2_decay != 0.0f) gj += l2_decay * pj;
        const float mj = m[i][j] * beta1 + gj * one_minus_beta1;
        const float vj = v[i][j] * beta2 + gj * gj * one_minus_beta2;
        const float denom = __fsqrt_rn(vj) * inv_sqrt_bias_correction2 + eps;
        // The reference's order; under --use_fast_math this one division per element is
        // the approximate one (2 ulp), far below the size of the update.
        pj -= step_size * mj / denom;
        p[i][j] = pj;
        m[i][j] = mj;
        v[i][j] = vj;
      });
      group.store(exp_avg, m);
      group.store(exp_avg_sq, v);
      group.store(current, p);
      if constexpr (kMaster) group.store(params, p);
      if (write_grads) group.store(grad, g);
    };
    apex_optimizers::for_each_element<apex::vector_width<Param, Grad, float>(), kMaster>(
        chunk.size, body, params, current, grad, exp_avg, exp_avg_sq);
  }
};

}  // namespace

namespace apex_optimizers {

void fused_adam_cuda(int64_t chunk_size, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList master_params, double lr, int64_t step, double beta1,
                     double beta2, double eps, double weight_decay, bool adam_w_mode, bool bias_correction,
                     const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& step_tensor,
                     const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                     bool maximize) {
  namespace checks = apex::checks;
  checks::positive_chunk_size(kOp, chunk_size);
  checks::same_lengths(kOp, {{"params", params.size()},
                             {"grads", grads.size()},
                             {"exp_avgs", exp_avgs.size()},
                             {"exp_avg_sqs", exp_avg_sqs.size()}});
  const auto device = apex_optimizers::check_common(
      kOp, params, grads, {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}}, master_params,
      {{"lr_tensor", lr_tensor}, {"step_tensor", step_tensor}, {"grad_scale", grad_scale}, {"found_inf", found_inf}},
      apex_optimizers::kWithDouble);
  const bool has_step_tensor = step_tensor.has_value() && step_tensor->defined();
  TORCH_CHECK_VALUE(has_step_tensor || step >= 1 || !bias_correction, kOp,
                    ": step must be >= 1 with bias_correction, got ", step);
  if (!device) return;

  // Host step: the bias corrections in double, as the reference computes them.
  double bias_correction1 = 1.0, bias_correction2 = 1.0;
  if (bias_correction && !has_step_tensor) {
    bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  }
  AdamArgs args{};
  args.scalars = apex_optimizers::device_scalars(lr_tensor, grad_scale, found_inf);
  args.step_tensor = has_step_tensor ? step_tensor->data_ptr<float>() : nullptr;
  args.lr = static_cast<float>(lr);
  args.bias_correction1 = static_cast<float>(bias_correction1);
  args.sqrt_bias_correction2 = static_cast<float>(std::sqrt(bias_correction2));
  args.beta1 = static_cast<float>(beta1);
  args.beta2 = static_cast<float>(beta2);
  args.eps = static_cast<float>(eps);
  args.weight_decay = static_cast<float>(weight_decay);
  args.adam_w_mode = adam_w_mode;
  args.bias_correction = bias_correction;
  args.maximize = maximize;

  const c10::cuda::CUDAGuard device_guard(*device);
  apex_optimizers::launch_elementwise<AdamFunctor>(kOp, chunk_size, params, grads, master_params, args, exp_avgs,
                                                   exp_avg_sqs);
}

}  // namespace apex_optimizers

