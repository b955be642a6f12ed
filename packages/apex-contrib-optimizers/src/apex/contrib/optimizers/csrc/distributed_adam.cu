// DistributedFusedAdam's shard step: distributed_adam (state in fp32, fp16 or bf16) and
// distributed_adam_with_param_remainders (fp32 masters kept as bf16 params plus the int16 low
// halves). The math, the argument rules and the words of every error are those of
// _distributed_adam_ops.py, whose PyTorch references these kernels are tested against.
//
// One multi-tensor pass: per element it reads the parameter (and remainder), both moments and the
// gradient and writes the moments, the parameter (or remainder) and the output copy. For bf16
// state, bf16 gradients and a bf16 output that is 12 bytes an element; with remainders (fp32
// moments, bf16 gradients) 20. The per-step scalars (learning rate, bias corrections, the noop
// flag, the gradient scale) are read once per block from device memory, so the step never waits
// for the host and can be captured in a CUDA graph.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/multi_tensor_apply.cuh>
#include <apex/vectorized.cuh>

#include "contrib_optimizers_common.cuh"
#include "cuda_ops.h"

namespace {

namespace co = apex_contrib_optimizers;

// What the host knows of a step; the device resolves the rest (lr_tensor, step_tensor) per block.
struct AdamArgs {
  const int32_t* noop_flag;
  const float* grad_scale;
  const float* lr_tensor;    // null: lr
  const float* step_tensor;  // null: the host's bias corrections
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  float inv_bias_correction1;  // 1 / (1 - beta1^step) from the host (1 without bias correction)
  float inv_bias_correction2;
  bool decoupled;  // adam_mode 1
  bool bias_correction;
};

// The step's constants in fp32, worked out once per block.
struct AdamStep {
  float lr;
  float grad_scale;
  float inv_bias_correction1;
  float inv_bias_correction2;
  co::Lerp moment1;
  co::Lerp moment2;
  float eps;
  float weight_decay;
  bool decoupled;

  __device__ __forceinline__ explicit AdamStep(const AdamArgs& a)
      : lr(a.lr_tensor != nullptr ? *a.lr_tensor : a.lr),
        grad_scale(*a.grad_scale),
        inv_bias_correction1(a.inv_bias_correction1),
        inv_bias_correction2(a.inv_bias_correction2),
        moment1(a.beta1),
        moment2(a.beta2),
        eps(a.eps),
        weight_decay(a.weight_decay),
        decoupled(a.decoupled) {
    if (a.step_tensor != nullptr && a.bias_correction) {
      const float step = *a.step_tensor;
      inv_bias_correction1 = __frcp_rn(co::bias_correction(a.beta1, step));
      inv_bias_correction2 = __frcp_rn(co::bias_correction(a.beta2, step));
    }
  }

  // The reference's adam_update: g scaled (multiplied), L2 decay into g (mode 0), the moments as
  // torch.lerp, the bias-corrected update, decoupled decay into the update (mode 1). IEEE square
  // root and division (the build uses --use_fast_math).
  __device__ __forceinline__ void operator()(float& p, float& m, float& v, float g) const {
    g *= grad_scale;
    if (!decoupled) g += weight_decay * p;
    m = moment1(g, m);
    v = moment2(g * g, v);
    float update = __fdiv_rn(m * inv_bias_correction1, __fsqrt_rn(v * inv_bias_correction2) + eps);
    if (decoupled) update += weight_decay * p;
    p -= lr * update;
  }
};

template <typename T>
__device__ __forceinline__ float round_to(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return static_cast<float>(static_cast<T>(x));
  }
}

// Lists: 0 params (State, updated), 1 exp_avgs, 2 exp_avg_sqs (State), 3 grads (Grad), 4 params_out (Out).
template <typename State, typename Grad, typename Out>
struct AdamFunctor {
  AdamArgs args;

  __device__ void operator()(const apex::Chunk<5>& chunk) const {
    if (*args.noop_flag != 0) return;
    const AdamStep step(args);
    State* param = chunk.template data<State>(0);
    State* exp_avg = chunk.template data<State>(1);
    State* exp_avg_sq = chunk.template data<State>(2);
    const Grad* grad = chunk.template data<Grad>(3);
    Out* out = chunk.template data<Out>(4);
    auto body = [&](auto group) {
      typename decltype(group)::Values p, m, v, g;
      group.load(p, param);
      group.load(m, exp_avg);
      group.load(v, exp_avg_sq);
      group.load(g, grad);
      group.for_each_value([&](int i, int j) {
        float pj = p[i][j], mj = m[i][j], vj = v[i][j];
        step(pj, mj, vj, g[i][j]);
        p[i][j] = round_to<State>(pj);  // the output is the new value in the state dtype, converted
        m[i][j] = mj;
        v[i][j] = vj;
      });
      group.store(exp_avg, m);
      group.store(exp_avg_sq, v);
      group.store(param, p);
      group.store(out, p);
    };
    constexpr int kWidth = apex::vector_width<State, Grad, Out>();
    apex::for_each_element<kWidth, co::accesses_in_flight<kWidth>()>(chunk.size, body, param, exp_avg, exp_avg_sq,
                                                                     grad, out);
  }
};

// Lists: 0 params (bf16, read as their int16 bits), 1 param_remainders (int16), 2 exp_avgs,
// 3 exp_avg_sqs (fp32), 4 grads (Grad), 5 params_out (bf16, written as int16 bits). Loads turn
// int16 into float and stores float into int16 exactly, so the bits go through the generic
// element loop untouched.
template <typename Grad>
struct RemainderFunctor {
  AdamArgs args;

  __device__ void operator()(const apex::Chunk<6>& chunk) const {
    if (*args.noop_flag != 0) return;
    const AdamStep step(args);
    const int16_t* param = chunk.template data<int16_t>(0);
    int16_t* remainder = chunk.template data<int16_t>(1);
    float* exp_avg = chunk.template data<float>(2);
    float* exp_avg_sq = chunk.template data<float>(3);
    const Grad* grad = chunk.template data<Grad>(4);
    int16_t* out = chunk.template data<int16_t>(5);
    auto body = [&](auto group) {
      typename decltype(group)::Values p, r, m, v, g;
      group.load(p, param);
      group.load(r, remainder);
      group.load(m, exp_avg);
      group.load(v, exp_avg_sq);
      group.load(g, grad);
      group.for_each_value([&](int i, int j) {
        float master = co::join_bf16_and_remainder(static_cast<int32_t>(p[i][j]), static_cast<int32_t>(r[i][j]));
        float mj = m[i][j], vj = v[i][j];
        step(master, mj, vj, g[i][j]);
        int32_t high, low;
        co::split_bf16_and_remainder(master, high, low);
        p[i][j] = static_cast<float>(high);
        r[i][j] = static_cast<float>(low);
        m[i][j] = mj;
        v[i][j] = vj;
      });
      group.store(exp_avg, m);
      group.store(exp_avg_sq, v);
      group.store(remainder, r);
      group.store(out, p);
    };
    constexpr int kWidth = apex::vector_width<int16_t, Grad, float>();
    apex::for_each_element<kWidth, co::accesses_in_flight<kWidth>()>(chunk.size, body, param, remainder, exp_avg,
                                                                     exp_avg_sq, grad, out);
  }
};

AdamArgs make_args(const at::Tensor& noop_flag, const at::Tensor& grad_scale, double lr, double beta1, double beta2,
                   double eps, int64_t step, int64_t adam_mode, bool bias_correction, double weight_decay,
                   const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& step_tensor) {
  AdamArgs a{};
  a.noop_flag = noop_flag.const_data_ptr<int32_t>();
  a.grad_scale = grad_scale.const_data_ptr<float>();
  a.lr_tensor = apex::optional_ptr<float>(lr_tensor);
  a.step_tensor = apex::optional_ptr<float>(step_tensor);
  a.lr = static_cast<float>(lr);
  a.beta1 = static_cast<float>(beta1);
  a.beta2 = static_cast<float>(beta2);
  a.eps = static_cast<float>(eps);
  a.weight_decay = static_cast<float>(weight_decay);
  a.decoupled = adam_mode == 1;
  a.bias_correction = bias_correction;
  // Host step: the corrections in double (as Python computes them), rounded once.
  const bool host_step = bias_correction && a.step_tensor == nullptr;
  const double bc1 = host_step ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = host_step ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  a.inv_bias_correction1 = static_cast<float>(1.0 / static_cast<double>(static_cast<float>(bc1)));
  a.inv_bias_correction2 = static_cast<float>(1.0 / static_cast<double>(static_cast<float>(bc2)));
  return a;
}

constexpr const char* kAdam = "distributed_adam";
constexpr const char* kRemainders = "distributed_adam_with_param_remainders";

}  // namespace

namespace apex_contrib_optimizers {

void distributed_adam_cuda(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList params,
                           at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList grads,
                           at::TensorList params_out, const at::Tensor& grad_scale, double lr, double beta1,
                           double beta2, double eps, int64_t step, int64_t adam_mode, bool bias_correction,
                           double weight_decay, const std::optional<at::Tensor>& lr_tensor,
                           const std::optional<at::Tensor>& step_tensor) {
  namespace checks = apex::checks;
  const std::initializer_list<co::ShardList> lists = {{"params", params, checks::kFloatDtypes},
                                                      {"exp_avgs", exp_avgs, checks::kFloatDtypes},
                                                      {"exp_avg_sqs", exp_avg_sqs, checks::kFloatDtypes},
                                                      {"grads", grads, checks::kFloatDtypes},
                                                      {"params_out", params_out, checks::kFloatDtypes}};
  const auto device = co::check_shards(kAdam, chunk_size, lists);
  for (size_t i = 0; i < params.size(); ++i) {
    const auto p = params[i].scalar_type(), m = exp_avgs[i].scalar_type(), v = exp_avg_sqs[i].scalar_type();
    TORCH_CHECK_TYPE(p == m && m == v, kAdam, ": params[", i, "], exp_avgs[", i, "] and exp_avg_sqs[", i,
                     "] must share the state dtype, got torch.", checks::dtype_name(p), ", torch.",
                     checks::dtype_name(m), ", torch.", checks::dtype_name(v));
  }
  co::check_step_scalars(kAdam, device, adam_mode, noop_flag, grad_scale, lr_tensor, step_tensor, step,
                         bias_correction);
  if (params.empty()) return;

  const AdamArgs args = make_args(noop_flag, grad_scale, lr, beta1, beta2, eps, step, adam_mode, bias_correction,
                                  weight_decay, lr_tensor, step_tensor);
  apex::dispatch_float_types(params[0].scalar_type(), kAdam, "params", [&](auto state_tag) {
    using State = typename decltype(state_tag)::type;
    apex::dispatch_float_types2(
        grads[0].scalar_type(), "grads", params_out[0].scalar_type(), "params_out", kAdam,
        [&](auto grad_tag, auto out_tag) {
          using Grad = typename decltype(grad_tag)::type;
          using Out = typename decltype(out_tag)::type;
          apex::multi_tensor_apply<5>(chunk_size, {params, exp_avgs, exp_avg_sqs, grads, params_out},
                                      AdamFunctor<State, Grad, Out>{args});
        });
  });
}

void distributed_adam_with_param_remainders_cuda(
    int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList params, at::TensorList param_remainders,
    at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList grads, at::TensorList params_out,
    const at::Tensor& grad_scale, double lr, double beta1, double beta2, double eps, int64_t step, int64_t adam_mode,
    bool bias_correction, double weight_decay, const std::optional<at::Tensor>& lr_tensor,
    const std::optional<at::Tensor>& step_tensor) {
  namespace checks = apex::checks;
  static constexpr c10::ScalarType kBFloat16[] = {at::kBFloat16};
  static constexpr c10::ScalarType kInt16[] = {at::kShort};
  static constexpr c10::ScalarType kFloat[] = {at::kFloat};
  const std::initializer_list<co::ShardList> lists = {{"params", params, kBFloat16},
                                                      {"param_remainders", param_remainders, kInt16},
                                                      {"exp_avgs", exp_avgs, kFloat},
                                                      {"exp_avg_sqs", exp_avg_sqs, kFloat},
                                                      {"grads", grads, checks::kFloatDtypes},
                                                      {"params_out", params_out, kBFloat16}};
  const auto device = co::check_shards(kRemainders, chunk_size, lists);
  co::check_step_scalars(kRemainders, device, adam_mode, noop_flag, grad_scale, lr_tensor, step_tensor, step,
                         bias_correction);
  if (params.empty()) return;

  const AdamArgs args = make_args(noop_flag, grad_scale, lr, beta1, beta2, eps, step, adam_mode, bias_correction,
                                  weight_decay, lr_tensor, step_tensor);
  apex::dispatch_float_types(grads[0].scalar_type(), kRemainders, "grads", [&](auto grad_tag) {
    using Grad = typename decltype(grad_tag)::type;
    apex::multi_tensor_apply<6>(chunk_size, {params, param_remainders, exp_avgs, exp_avg_sqs, grads, params_out},
                                RemainderFunctor<Grad>{args});
  });
}

}  // namespace apex_contrib_optimizers

