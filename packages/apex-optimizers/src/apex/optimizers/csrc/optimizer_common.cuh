// Shared by the fused optimizer kernels of apex-optimizers: the argument checks of
// apex/optimizers/_ops.py (_check_common) in C++, with the same wording, the per-block
// reads of the device scalars (lr_tensor, step_tensor, grad_scale, found_inf), and the element
// loop and launch that the element-wise optimizers have in common.
//
// Conventions of every fused optimizer (see _ops.py): lists params, grads, states (fp32) and
// optionally fp32 master_params; with master_params the update is computed on the master
// copy and written to both. Device scalars are read by every block from device memory, so a
// step never waits for the host and can be captured in a CUDA graph.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <vector>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/multi_tensor_apply.cuh>
#include <apex/vectorized.cuh>

namespace apex_optimizers {

using apex::accesses_in_flight;

struct NamedList {
  const char* name;
  at::TensorList tensors;
};

struct NamedScalar {
  const char* name;
  const std::optional<at::Tensor>& tensor;
};

// _check_common of _ops.py: the tensor lists (params first, then grads, the fp32 state lists
// and the optional fp32 master_params), then the optional fp32 one-element tensors. The
// caller has checked that params, grads and states have one length. Returns the device of
// params, or nullopt when there are none. params and grads of `param_dtypes` (Adam and Adagrad
// also take float64).
inline constexpr std::array<c10::ScalarType, 4> kWithDouble = {c10::ScalarType::Float, c10::ScalarType::Half,
                                                               c10::ScalarType::BFloat16, c10::ScalarType::Double};

inline std::optional<c10::Device> check_common(const char* op, at::TensorList params, at::TensorList grads,
                                               std::initializer_list<NamedList> states,
                                               at::TensorList master_params,
                                               std::initializer_list<NamedScalar> scalars,
                                               c10::ArrayRef<c10::ScalarType> param_dtypes = apex::checks::kFloatDtypes) {
  namespace checks = apex::checks;
  std::optional<c10::Device> device;
  if (!params.empty()) device = params[0].device();
  const c10::Device list_device = device.value_or(c10::Device(c10::kCPU));
  checks::tensor_list(op, "params", params, list_device, param_dtypes);
  checks::tensor_list(op, "grads", grads, list_device, param_dtypes);
  for (const auto& state : states) {
    checks::tensor_list(op, state.name, state.tensors, list_device, {at::kFloat});
  }
  if (!master_params.empty()) {
    checks::same_lengths(op, {{"params", params.size()}, {"master_params", master_params.size()}});
    checks::tensor_list(op, "master_params", master_params, list_device, {at::kFloat});
  }
  checks::same_numel(op, "grads", grads, "params", params);
  for (const auto& state : states) checks::same_numel(op, state.name, state.tensors, "params", params);
  checks::same_numel(op, "master_params", master_params, "params", params);
  std::vector<checks::NamedTensorList> lists = {{"params", params}, {"grads", grads}};
  for (const auto& state : states) lists.emplace_back(state.name, state.tensors);
  lists.emplace_back("master_params", master_params);
  checks::same_layouts(op, lists);
  for (const auto& scalar : scalars) {
    if (scalar.tensor.has_value() && scalar.tensor->defined()) {
      checks::scalar_tensor(op, scalar.name, *scalar.tensor, {at::kFloat}, device);
    }
  }
  return device;
}

inline const float* optional_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr<float>() : nullptr;
}

// The device scalars every fused optimizer takes; null pointers where not given.
struct DeviceScalars {
  const float* lr_tensor;
  const float* grad_scale;
  const float* found_inf;

  // found_inf != 0 (NaN included, as in the reference): the step is skipped, nothing written.
  __device__ __forceinline__ bool skip() const { return found_inf != nullptr && *found_inf != 0.0f; }
  __device__ __forceinline__ float lr(float host_lr) const { return lr_tensor != nullptr ? *lr_tensor : host_lr; }
  // Gradients are divided by the loss scale; a correctly rounded reciprocal, then multiplies
  // (exact for the power-of-two scales of a loss scaler).
  __device__ __forceinline__ float inv_grad_scale() const {
    return grad_scale != nullptr ? __frcp_rn(*grad_scale) : 1.0f;
  }
};

inline DeviceScalars device_scalars(const std::optional<at::Tensor>& lr_tensor,
                                    const std::optional<at::Tensor>& grad_scale,
                                    const std::optional<at::Tensor>& found_inf) {
  return {optional_ptr(lr_tensor), optional_ptr(grad_scale), optional_ptr(found_inf)};
}

// apex::for_each_element over a functor's lists, with the written-only low-precision params
// last when kMaster (they are one more array that must share the alignment).
template <int Width, bool kMaster, typename Body, typename Param, typename... Ts>
__device__ __forceinline__ void for_each_element(int64_t n, Body& body, Param* params, const Ts*... ptrs) {
  constexpr int kCount = accesses_in_flight<Width>();
  if constexpr (kMaster) {
    apex::for_each_element<Width, kCount>(n, body, ptrs..., params);
  } else {
    apex::for_each_element<Width, kCount>(n, body, ptrs...);
  }
}

// The launch of an element-wise optimizer whose Functor<Param, Grad, kMaster> takes the lists
// of the convention above: the parameter it updates (master_params when given), grads, the
// state lists, and with master_params the params last (written only).
// float64 params (Adam, Adagrad: checked by check_common) take float64 grads, no master copy.
template <template <typename, typename, bool> class Functor, typename Args, typename... States>
void launch_elementwise(const char* op, int64_t chunk_size, at::TensorList params, at::TensorList grads,
                        at::TensorList master_params, const Args& args, States... states) {
  if (params[0].scalar_type() == at::kDouble || grads[0].scalar_type() == at::kDouble) {
    TORCH_CHECK_TYPE(params[0].scalar_type() == grads[0].scalar_type(), op, ": params have dtype torch.",
                     apex::checks::dtype_name(params[0].scalar_type()), " but grads have torch.",
                     apex::checks::dtype_name(grads[0].scalar_type()), "; float64 params need float64 grads");
    TORCH_CHECK_VALUE(master_params.empty(), op, ": float64 params take no master_params");
    constexpr int kDepth = 2 + sizeof...(States);
    apex::multi_tensor_apply<kDepth>(chunk_size, {params, grads, states...}, Functor<double, double, false>{args});
    return;
  }
  apex::dispatch_float_types2(params[0].scalar_type(), "params", grads[0].scalar_type(), "grads", op,
                              [&](auto param_tag, auto grad_tag) {
                                using Param = typename decltype(param_tag)::type;
                                using Grad = typename decltype(grad_tag)::type;
                                constexpr int kDepth = 2 + sizeof...(States);
                                if (master_params.empty()) {
                                  apex::multi_tensor_apply<kDepth>(chunk_size, {params, grads, states...},
                                                                   Functor<Param, Grad, false>{args});
                                } else {
                                  apex::multi_tensor_apply<kDepth + 1>(chunk_size,
                                                                       {master_params, grads, states..., params},
                                                                       Functor<Param, Grad, true>{args});
                                }
                              });
}

// 1 - beta^step from an fp32 step read on the device, rounded as the reference computes it
// from a step tensor (an fp32 power, then 1 - it in fp32). The power goes through double so
// that --use_fast_math's approximate powf cannot cost digits of 1 - beta^step (beta2 = 0.999
// at step 1 leaves 1e-3).
__device__ __forceinline__ float device_bias_correction(float beta, float step) {
  return 1.0f - static_cast<float>(pow(static_cast<double>(beta), static_cast<double>(step)));
}

}  // namespace apex_optimizers
