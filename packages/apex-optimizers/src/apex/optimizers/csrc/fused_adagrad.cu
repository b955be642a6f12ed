// fused_adagrad: one multi-tensor pass of Adagrad (L2 or decoupled weight decay) over params,
// grads, state_sums (and fp32 master_params). See _adagrad_reference in
// apex/optimizers/_ops.py for the math. 20 bytes per fp32 parameter: read parameter, gradient
// and sum; write parameter and sum.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>
#include <type_traits>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/multi_tensor_apply.cuh>
#include <apex/vectorized.cuh>

#include "optimizer_common.cuh"
#include "cuda_ops.h"

namespace {

constexpr const char* kOp = "fused_adagrad";

struct AdagradArgs {
  apex_optimizers::DeviceScalars scalars;
  float lr;
  float eps;
  float weight_decay;
  bool adagrad_w_mode;
  bool maximize;
};

// Lists: 0 the parameter the update is computed on (fp32 master copy when kMaster, else the
// params), 1 grads, 2 state_sums, and with kMaster 3 the params (written only).
template <typename Param, typename Grad, bool kMaster>
struct AdagradFunctor {
  using Current = std::conditional_t<kMaster, float, Param>;
  static constexpr int kDepth = kMaster ? 4 : 3;

  AdagradArgs args;

  __device__ void operator()(const apex::Chunk<kDepth>& chunk) const {
    if (args.scalars.skip()) return;
    const float lr = args.scalars.lr(args.lr);
    // maximize: the gradient negated as it is read (the sign folded into the unscaling factor)
    const float inv_grad_scale = args.maximize ? -args.scalars.inv_grad_scale() : args.scalars.inv_grad_scale();
    const float l2_decay = args.adagrad_w_mode ? 0.0f : args.weight_decay;
    const float decoupled_decay = args.adagrad_w_mode ? args.weight_decay : 0.0f;
    const float eps = args.eps;

    Current* current = chunk.template data<Current>(0);
    const Grad* grad = chunk.template data<Grad>(1);
    float* state_sum = chunk.template data<float>(2);
    Param* params = kMaster ? chunk.template data<Param>(3) : nullptr;

    auto body = [&](auto group) {
      typename decltype(group)::Values p, g, h;
      group.load(p, current);
      group.load(g, grad);
      group.load(h, state_sum);
      group.for_each_value([&](int i, int j) {
        float gj = g[i][j] * inv_grad_scale;
        // Decay terms only when asked for: 0 * inf would turn an inf parameter's sum NaN.
        if (l2_decay != 0.0f) gj += l2_decay * p[i][j];
        const float hj = h[i][j] + gj * gj;
        float update = gj / (__fsqrt_rn(hj) + eps);
        if (decoupled_decay != 0.0f) update += decoupled_decay * p[i][j];
        h[i][j] = hj;
        p[i][j] -= lr * update;
      });
      group.store(state_sum, h);
      group.store(current, p);
      if constexpr (kMaster) group.store(params, p);
    };
    apex_optimizers::for_each_element<apex::vector_width<Param, Grad, float>(), kMaster>(chunk.size, body, params,
                                                                                        current, grad, state_sum);
  }
};

}  // namespace

namespace apex_optimizers {

void fused_adagrad_cuda(int64_t chunk_size, at::TensorList params, at::TensorList grads, at::TensorList state_sums,
                        at::TensorList master_params, double lr, double eps, double weight_decay, bool adagrad_w_mode,
                        const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                        const std::optional<at::Tensor>& found_inf, bool maximize) {
  namespace checks = apex::checks;
  checks::positive_chunk_size(kOp, chunk_size);
  checks::same_lengths(kOp, {{"params", params.size()}, {"grads", grads.size()}, {"state_sums", state_sums.size()}});
  const auto device = apex_optimizers::check_common(
      kOp, params, grads, {{"state_sums", state_sums}}, master_params,
      {{"lr_tensor", lr_tensor}, {"grad_scale", grad_scale}, {"found_inf", found_inf}}, apex_optimizers::kWithDouble);
  if (!device) return;

  AdagradArgs args{};
  args.scalars = apex_optimizers::device_scalars(lr_tensor, grad_scale, found_inf);
  args.lr = static_cast<float>(lr);
  args.eps = static_cast<float>(eps);
  args.weight_decay = static_cast<float>(weight_decay);
  args.adagrad_w_mode = adagrad_w_mode;
  args.maximize = maximize;

  const c10::cuda::CUDAGuard device_guard(*device);
  apex_optimizers::launch_elementwise<AdagradFunctor>(kOp, chunk_size, params, grads, master_params, args,
                                                      state_sums);
}

}  // namespace apex_optimizers

