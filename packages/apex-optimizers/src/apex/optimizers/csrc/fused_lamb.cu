// fused_lamb: LAMB over params, grads, exp_avgs, exp_avg_sqs (and fp32 master_params). See
// _lamb_reference in apex/optimizers/_ops.py for the math.
//
// Three launches (more only past multi_tensor_apply's table sizes), no host sync, no atomics:
//   1. per element: the gradient clipped by the global norm (a device tensor) and unscaled,
//      both moments, the Adam-style update u into a temporary fp32 buffer; per chunk, the sums
//      of p^2 and u^2 into partials[chunk] (only when a trust ratio is needed);
//   2. per tensor: its chunks' partials summed in a fixed order -> ||p||, ||u|| -> trust ratio;
//   3. per element: p -= lr * ratio[tensor] * u.
// Traffic per fp32 parameter: 28 bytes in 1 (read p, g, m, v; write m, v, u), 12 in 3 (read p,
// u; write p): 40 in all.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/multi_tensor_apply.cuh>
#include <apex/reductions.cuh>
#include <apex/vectorized.cuh>

#include "optimizer_common.cuh"
#include "cuda_ops.h"

namespace {

constexpr const char* kOp = "fused_lamb";
constexpr int kRatioBlockSize = 128;
// The update buffer of each tensor starts on a 32-byte boundary plus the element misalignment of
// the tensor's parameter, so that both share their misalignment within 8-element vectors and
// take the vectorized path together.
constexpr int64_t kUpdateAlignment = 8;

struct LambArgs {
  apex_optimizers::DeviceScalars scalars;
  const float* step_tensor;       // may be null
  const float* global_grad_norm;
  float* partials;                // [2 * n_chunks]: sum p^2 per chunk, then sum u^2; null: no trust ratio
  int64_t n_chunks;
  float bias_correction1;  // from the host (1 without bias correction)
  float bias_correction2;
  float beta1;
  float beta2;
  float beta3;  // weight of the gradient in the first moment: 1 - beta1 with grad averaging, else 1
  float eps;
  float weight_decay;
  float max_grad_norm;
  bool adam_w_mode;
  bool bias_correction;
};

// Stage 1. Lists: 0 the parameter (fp32 master copy if any, else the params; read only),
// 1 grads, 2 exp_avgs, 3 exp_avg_sqs, 4 the update buffer (written).
template <typename Current, typename Grad>
struct LambUpdateFunctor {
  LambArgs args;

  __device__ void operator()(const apex::Chunk<5>& chunk) const {
    __shared__ float shared[apex::kWarpSize];
    if (args.scalars.skip()) return;
    float bias_correction1 = args.bias_correction1;
    float bias_correction2 = args.bias_correction2;
    if (args.step_tensor != nullptr && args.bias_correction) {
      const float step = *args.step_tensor;
      bias_correction1 = apex_optimizers::device_bias_correction(args.beta1, step);
      bias_correction2 = apex_optimizers::device_bias_correction(args.beta2, step);
    }
    const float inv_bias_correction1 = __frcp_rn(bias_correction1);
    const float inv_bias_correction2 = __frcp_rn(bias_correction2);
    // Clipping divides the gradient by ||g|| / max_grad_norm when that exceeds 1.
    const float norm = *args.global_grad_norm;
    const float clip = args.max_grad_norm > 0.0f && norm > args.max_grad_norm ? __fdiv_rn(norm, args.max_grad_norm)
                                                                              : 1.0f;
    const float grad_factor = __fdiv_rn(args.scalars.inv_grad_scale(), clip);
    const float l2_decay = args.adam_w_mode ? 0.0f : args.weight_decay;
    const float decoupled_decay = args.adam_w_mode ? args.weight_decay : 0.0f;
    const float beta1 = args.beta1;
    const float beta2 = args.beta2;
    const float beta3 = args.beta3;
    const float one_minus_beta2 = 1.0f - beta2;
    const float eps = args.eps;
    const bool norms = args.partials != nullptr;

    const Current* current = chunk.template data<Current>(0);
    const Grad* grad = chunk.template data<Grad>(1);
    float* exp_avg = chunk.template data<float>(2);
    float* exp_avg_sq = chunk.template data<float>(3);
    float* update = chunk.template data<float>(4);

    float param_sq = 0.0f;
    float update_sq = 0.0f;
    auto body = [&](auto group) {
      typename decltype(group)::Values p, g, m, v;
      group.load(p, current);
      group.load(g, grad);
      group.load(m, exp_avg);
      group.load(v, exp_avg_sq);
      group.for_each_value([&](int i, int j) {
        const float pj = p[i][j];
        float gj = g[i][j] * grad_factor;
        // Decay terms only when asked for: 0 * inf would turn an inf parameter's state NaN.
        if (l2_decay != 0.0f) gj += l2_decay * pj;
        const float mj = m[i][j] * beta1 + gj * beta3;
        const float vj = v[i][j] * beta2 + gj * gj * one_minus_beta2;
        float uj = mj * inv_bias_correction1 / (__fsqrt_rn(vj * inv_bias_correction2) + eps);
        if (decoupled_decay != 0.0f) uj += decoupled_decay * pj;
        m[i][j] = mj;
        v[i][j] = vj;
        g[i][j] = uj;
        if (norms) {
          param_sq += pj * pj;
          update_sq += uj * uj;
        }
      });
      group.store(exp_avg, m);
      group.store(exp_avg_sq, v);
      group.store(update, g);
    };
    constexpr int kWidth = apex::vector_width<Current, Grad, float>();
    constexpr int kCount = apex_optimizers::accesses_in_flight<kWidth>();
    apex::for_each_element<kWidth, kCount>(chunk.size, body, current, grad, exp_avg, exp_avg_sq, update);
    if (norms) {
      param_sq = apex::block_sum(param_sq, shared);
      update_sq = apex::block_sum(update_sq, shared);
      if (threadIdx.x == 0) {
        args.partials[chunk.block_index] = param_sq;
        args.partials[args.n_chunks + chunk.block_index] = update_sq;
      }
    }
  }
};

// Stage 2: tensor first_tensor + i owns the chunks [bounds[i], bounds[i + 1]) of stage 1.
// Passed by value, like multi_tensor_apply's tables.
struct TensorChunks {
  static constexpr int kMaxTensors = (apex::kMaxKernelParamBytes - 64) / 8 - 2;
  int64_t first_tensor;
  int64_t bounds[kMaxTensors + 1];
};
static_assert(sizeof(TensorChunks) + 3 * sizeof(void*) + 8 <= apex::kMaxKernelParamBytes);

__global__ void __launch_bounds__(kRatioBlockSize)
    trust_ratio_kernel(const __grid_constant__ TensorChunks tensors, const float* partials, int64_t n_chunks,
                       float* ratios) {
  __shared__ float shared[apex::kWarpSize];
  const int64_t begin = tensors.bounds[blockIdx.x];
  const int64_t end = tensors.bounds[blockIdx.x + 1];
  float param_sq = 0.0f;
  float update_sq = 0.0f;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    param_sq += partials[i];
    update_sq += partials[n_chunks + i];
  }
  param_sq = apex::block_sum(param_sq, shared);
  update_sq = apex::block_sum(update_sq, shared);
  if (threadIdx.x == 0) {
    const float param_norm = __fsqrt_rn(param_sq);
    const float update_norm = __fsqrt_rn(update_sq);
    ratios[tensors.first_tensor + blockIdx.x] =
        param_norm > 0.0f && update_norm > 0.0f ? __fdiv_rn(param_norm, update_norm) : 1.0f;
  }
}

// Stage 3. Lists: 0 the parameter (fp32 master copy if kMaster, else the params), 1 the update
// buffer, and with kMaster 2 the params (written only).
template <typename Param, bool kMaster>
struct LambApplyFunctor {
  using Current = std::conditional_t<kMaster, float, Param>;
  static constexpr int kDepth = kMaster ? 3 : 2;

  apex_optimizers::DeviceScalars scalars;
  float lr;
  const float* ratios;  // per tensor; null: no trust ratio

  __device__ void operator()(const apex::Chunk<kDepth>& chunk) const {
    if (scalars.skip()) return;
    const float ratio = ratios != nullptr ? ratios[chunk.tensor_index] : 1.0f;
    const float step = scalars.lr(lr) * ratio;

    Current* current = chunk.template data<Current>(0);
    const float* update = chunk.template data<float>(1);
    Param* params = kMaster ? chunk.template data<Param>(2) : nullptr;

    auto body = [&](auto group) {
      typename decltype(group)::Values p, u;
      group.load(p, current);
      group.load(u, update);
      group.for_each_value([&](int i, int j) { p[i][j] -= step * u[i][j]; });
      group.store(current, p);
      if constexpr (kMaster) group.store(params, p);
    };
    apex_optimizers::for_each_element<apex::vector_width<Param, float>(), kMaster>(chunk.size, body, params, current,
                                                                                  update);
  }
};

}  // namespace

namespace apex_optimizers {

void fused_lamb_cuda(int64_t chunk_size, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList master_params, const at::Tensor& global_grad_norm,
                     double lr, int64_t step, double beta1, double beta2, double eps, double weight_decay,
                     bool adam_w_mode, bool bias_correction, bool grad_averaging, double max_grad_norm,
                     bool use_nvlamb, const std::optional<at::Tensor>& lr_tensor,
                     const std::optional<at::Tensor>& step_tensor, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf) {
  namespace checks = apex::checks;
  checks::positive_chunk_size(kOp, chunk_size);
  checks::same_lengths(kOp, {{"params", params.size()},
                             {"grads", grads.size()},
                             {"exp_avgs", exp_avgs.size()},
                             {"exp_avg_sqs", exp_avg_sqs.size()}});
  const auto device = apex_optimizers::check_common(
      kOp, params, grads, {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}}, master_params,
      {{"lr_tensor", lr_tensor}, {"step_tensor", step_tensor}, {"grad_scale", grad_scale}, {"found_inf", found_inf}});
  if (!device) return;
  checks::scalar_tensor(kOp, "global_grad_norm", global_grad_norm, {at::kFloat}, *device);

  const bool has_step_tensor = step_tensor.has_value() && step_tensor->defined();
  const bool has_master = !master_params.empty();
  const bool trust_ratio = use_nvlamb || weight_decay != 0.0;
  const at::TensorList current = has_master ? master_params : params;
  const size_t n_tensors = params.size();

  // Stage-1 chunks of each tensor (multi_tensor_apply numbers them in list order) and the
  // update buffer's layout.
  std::vector<int64_t> bounds(n_tensors + 1, 0);
  std::vector<int64_t> offsets(n_tensors, 0);
  int64_t update_elements = 0;
  for (size_t i = 0; i < n_tensors; ++i) {
    const at::Tensor& p = current[i];
    bounds[i + 1] = bounds[i] + apex::num_chunks(p.numel(), chunk_size);
    const auto address = reinterpret_cast<uintptr_t>(p.data_ptr());
    const int64_t misalignment = static_cast<int64_t>((address / p.element_size()) % kUpdateAlignment);
    offsets[i] = (update_elements + kUpdateAlignment - 1) / kUpdateAlignment * kUpdateAlignment + misalignment;
    update_elements = offsets[i] + p.numel();
  }
  const int64_t n_chunks = bounds[n_tensors];
  const int64_t scratch_elements = update_elements + (trust_ratio ? 2 * n_chunks + static_cast<int64_t>(n_tensors) : 0);

  const c10::cuda::CUDAGuard device_guard(*device);
  const at::Tensor scratch = at::empty({scratch_elements}, at::TensorOptions().dtype(at::kFloat).device(*device));
  std::vector<at::Tensor> updates;
  updates.reserve(n_tensors);
  for (size_t i = 0; i < n_tensors; ++i) updates.push_back(scratch.narrow(0, offsets[i], current[i].numel()));
  float* partials = trust_ratio ? scratch.data_ptr<float>() + update_elements : nullptr;
  float* ratios = trust_ratio ? partials + 2 * n_chunks : nullptr;

  double bias_correction1 = 1.0, bias_correction2 = 1.0;
  if (bias_correction && !has_step_tensor) {
    bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  }
  LambArgs args{};
  args.scalars = apex_optimizers::device_scalars(lr_tensor, grad_scale, found_inf);
  args.step_tensor = has_step_tensor ? step_tensor->data_ptr<float>() : nullptr;
  args.global_grad_norm = global_grad_norm.data_ptr<float>();
  args.partials = partials;
  args.n_chunks = n_chunks;
  args.bias_correction1 = static_cast<float>(bias_correction1);
  args.bias_correction2 = static_cast<float>(bias_correction2);
  args.beta1 = static_cast<float>(beta1);
  args.beta2 = static_cast<float>(beta2);
  args.beta3 = static_cast<float>(grad_averaging ? 1.0 - beta1 : 1.0);
  args.eps = static_cast<float>(eps);
  args.weight_decay = static_cast<float>(weight_decay);
  args.max_grad_norm = static_cast<float>(max_grad_norm);
  args.adam_w_mode = adam_w_mode;
  args.bias_correction = bias_correction;

  const char* current_name = has_master ? "master_params" : "params";
  apex::dispatch_float_types2(
      current[0].scalar_type(), current_name, grads[0].scalar_type(), "grads", kOp,
      [&](auto current_tag, auto grad_tag) {
        using Current = typename decltype(current_tag)::type;
        using Grad = typename decltype(grad_tag)::type;
        apex::multi_tensor_apply<5>(chunk_size, {current, grads, exp_avgs, exp_avg_sqs, updates},
                                    LambUpdateFunctor<Current, Grad>{args});
      });

  if (trust_ratio && n_chunks > 0) {
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    for (size_t first = 0; first < n_tensors; first += TensorChunks::kMaxTensors) {
      const size_t count = std::min<size_t>(TensorChunks::kMaxTensors, n_tensors - first);
      TensorChunks tensors{};
      tensors.first_tensor = static_cast<int64_t>(first);
      std::copy(bounds.begin() + first, bounds.begin() + first + count + 1, tensors.bounds);
      trust_ratio_kernel<<<static_cast<unsigned>(count), kRatioBlockSize, 0, stream>>>(tensors, partials, n_chunks,
                                                                                       ratios);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }

  const float lr_value = static_cast<float>(lr);
  APEX_DISPATCH_FLOAT_TYPES(params[0].scalar_type(), kOp, "params", Param, {
    if (has_master) {
      apex::multi_tensor_apply<3>(chunk_size, {master_params, updates, params},
                                  LambApplyFunctor<Param, true>{args.scalars, lr_value, ratios});
    } else {
      apex::multi_tensor_apply<2>(chunk_size, {params, updates},
                                  LambApplyFunctor<Param, false>{args.scalars, lr_value, ratios});
    }
  });
}

}  // namespace apex_optimizers

