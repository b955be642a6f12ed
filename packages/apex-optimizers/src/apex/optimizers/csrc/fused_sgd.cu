// fused_sgd: one multi-tensor pass of SGD with optional momentum, dampening, Nesterov and
// weight decay (before or after the momentum update) over params, grads, momentum_buffers (and
// fp32 master_params). See _sgd_reference in apex/optimizers/_ops.py for the math.
//
// With momentum it reads parameter, gradient and buffer and writes parameter and buffer (20
// bytes per fp32 parameter); without, the buffers are not touched (12 bytes).
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

constexpr const char* kOp = "fused_sgd";

struct SgdArgs {
  apex_optimizers::DeviceScalars scalars;
  float lr;
  float weight_decay;
  float momentum;
  float one_minus_dampening;
  bool nesterov;
  bool first_run;
  bool wd_after_momentum;
  bool maximize;
};

// Lists: 0 the parameter the update is computed on (fp32 master copy when kMaster, else the
// params), 1 grads, then the momentum buffers when kMomentum, then the params when kMaster
// (written only).
template <typename Param, typename Grad, bool kMomentum, bool kMaster>
struct SgdFunctor {
  using Current = std::conditional_t<kMaster, float, Param>;
  static constexpr int kBufferList = 2;
  static constexpr int kParamsList = kMomentum ? 3 : 2;
  static constexpr int kDepth = 2 + kMomentum + kMaster;

  SgdArgs args;

  __device__ void operator()(const apex::Chunk<kDepth>& chunk) const {
    if (args.scalars.skip()) return;
    const float lr = args.scalars.lr(args.lr);
    // maximize: the gradient negated as it is read (the sign folded into the unscaling factor)
    const float inv_grad_scale = args.maximize ? -args.scalars.inv_grad_scale() : args.scalars.inv_grad_scale();
    const float decay_before = args.wd_after_momentum ? 0.0f : args.weight_decay;
    const float decay_after = args.wd_after_momentum ? args.weight_decay : 0.0f;
    const float momentum = args.momentum;
    const float one_minus_dampening = args.one_minus_dampening;
    const bool nesterov = args.nesterov;
    const bool first_run = args.first_run;

    Current* current = chunk.template data<Current>(0);
    const Grad* grad = chunk.template data<Grad>(1);
    float* buffer = kMomentum ? chunk.template data<float>(kBufferList) : nullptr;
    Param* params = kMaster ? chunk.template data<Param>(kParamsList) : nullptr;

    auto body = [&](auto group) {
      typename decltype(group)::Values p, g;
      [[maybe_unused]] typename decltype(group)::Values b;
      group.load(p, current);
      group.load(g, grad);
      // The first step overwrites the buffer with the gradient; it is not read.
      if constexpr (kMomentum) {
        if (!first_run) group.load(b, buffer);
      }
      group.for_each_value([&](int i, int j) {
        float gj = g[i][j] * inv_grad_scale;
        // Decay terms only when asked for: 0 * inf would turn an inf parameter's buffer NaN.
        if (decay_before != 0.0f) gj += decay_before * p[i][j];
        if constexpr (kMomentum) {
          const float bj = first_run ? gj : b[i][j] * momentum + gj * one_minus_dampening;
          b[i][j] = bj;
          gj = nesterov ? gj + momentum * bj : bj;
        }
        if (decay_after != 0.0f) gj += decay_after * p[i][j];
        p[i][j] -= lr * gj;
      });
      if constexpr (kMomentum) group.store(buffer, b);
      group.store(current, p);
      if constexpr (kMaster) group.store(params, p);
    };
    constexpr int kWidth = apex::vector_width<Param, Grad, float>();
    if constexpr (kMomentum) {
      apex_optimizers::for_each_element<kWidth, kMaster>(chunk.size, body, params, current, grad, buffer);
    } else {
      apex_optimizers::for_each_element<kWidth, kMaster>(chunk.size, body, params, current, grad);
    }
  }
};

}  // namespace

namespace apex_optimizers {

void fused_sgd_cuda(int64_t chunk_size, at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                    at::TensorList master_params, double lr, double weight_decay, double momentum, double dampening,
                    bool nesterov, bool first_run, bool wd_after_momentum, const std::optional<at::Tensor>& lr_tensor,
                    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                    bool maximize) {
  namespace checks = apex::checks;
  checks::positive_chunk_size(kOp, chunk_size);
  const bool has_momentum = momentum != 0.0;
  TORCH_CHECK_VALUE(has_momentum || momentum_buffers.empty(), kOp,
                    ": momentum_buffers must be empty when momentum is 0");
  std::optional<c10::Device> device;
  const std::initializer_list<apex_optimizers::NamedScalar> scalars = {
      {"lr_tensor", lr_tensor}, {"grad_scale", grad_scale}, {"found_inf", found_inf}};
  if (has_momentum) {
    checks::same_lengths(
        kOp, {{"params", params.size()}, {"grads", grads.size()}, {"momentum_buffers", momentum_buffers.size()}});
    device = apex_optimizers::check_common(kOp, params, grads, {{"momentum_buffers", momentum_buffers}},
                                           master_params, scalars);
  } else {
    checks::same_lengths(kOp, {{"params", params.size()}, {"grads", grads.size()}});
    device = apex_optimizers::check_common(kOp, params, grads, {}, master_params, scalars);
  }
  TORCH_CHECK_VALUE(!nesterov || (momentum > 0.0 && dampening == 0.0), kOp,
                    ": nesterov needs momentum > 0 and dampening 0");
  if (!device) return;

  SgdArgs args{};
  args.scalars = apex_optimizers::device_scalars(lr_tensor, grad_scale, found_inf);
  args.lr = static_cast<float>(lr);
  args.weight_decay = static_cast<float>(weight_decay);
  args.momentum = static_cast<float>(momentum);
  args.one_minus_dampening = static_cast<float>(1.0 - dampening);
  args.nesterov = nesterov;
  args.first_run = first_run;
  args.wd_after_momentum = wd_after_momentum;
  args.maximize = maximize;

  const c10::cuda::CUDAGuard device_guard(*device);
  apex::dispatch_float_types2(
      params[0].scalar_type(), "params", grads[0].scalar_type(), "grads", kOp, [&](auto param_tag, auto grad_tag) {
        using Param = typename decltype(param_tag)::type;
        using Grad = typename decltype(grad_tag)::type;
        const bool has_master = !master_params.empty();
        if (has_momentum && has_master) {
          apex::multi_tensor_apply<4>(chunk_size, {master_params, grads, momentum_buffers, params},
                                      SgdFunctor<Param, Grad, true, true>{args});
        } else if (has_momentum) {
          apex::multi_tensor_apply<3>(chunk_size, {params, grads, momentum_buffers},
                                      SgdFunctor<Param, Grad, true, false>{args});
        } else if (has_master) {
          apex::multi_tensor_apply<3>(chunk_size, {master_params, grads, params},
                                      SgdFunctor<Param, Grad, false, true>{args});
        } else {
          apex::multi_tensor_apply<2>(chunk_size, {params, grads}, SgdFunctor<Param, Grad, false, false>{args});
        }
      });
}

}  // namespace apex_optimizers

