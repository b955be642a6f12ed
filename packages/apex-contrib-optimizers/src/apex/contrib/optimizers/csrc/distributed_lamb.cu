// DistributedFusedLAMB's two stages (upstream's distributed_lamb_cuda): lamb_compute_update_term
// (the moments and the update u from the gradients, one pass) and lamb_update_weights (p -= r u
// with each tensor's trust ratio r, and the copy that is all-gathered, one pass). The math, the
// argument rules and the words of the errors are those of _ops.py's references.
//
// The hyperparameters are per tensor (1-D device tensors indexed by the tensor's place in the
// lists, so one launch serves fragments of several parameter groups); they, the step, the loss
// scale, the global gradient norm and the noop flag are read on the device, once per block.
// Bytes per element: the first stage reads g, p, m, v and writes m, v, u (26 for bf16 gradients
// and fp32 state), the second reads u, p and writes p and its copy (14 for an fp32 p and bf16 copy).
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/multi_tensor_apply.cuh>
#include <apex/vectorized.cuh>

#include "contrib_optimizers_common.cuh"
#include "cuda_ops.h"

namespace {

namespace co = apex_contrib_optimizers;
namespace checks = apex::checks;

constexpr int64_t kChunkSize = 65536;  // the ops take no chunk_size (upstream's callers pass 65536)
constexpr const char* kUpdateTerm = "lamb_compute_update_term";
constexpr const char* kUpdateWeights = "lamb_update_weights";
constexpr c10::ScalarType kFloat[] = {at::kFloat};
constexpr c10::ScalarType kParamDtypes[] = {at::kFloat, at::kHalf};
constexpr c10::ScalarType kCopyDtypes[] = {at::kFloat, at::kHalf, at::kBFloat16, at::kByte};

// ---------------------------------------------------------------------------------------------
// lamb_compute_update_term

struct UpdateTermArgs {
  const int32_t* noop_flag;
  const float* beta1;
  const float* beta2;
  const float* beta3;
  const int32_t* bias_correction;
  const int32_t* step;
  const float* epsilon;
  const float* decay;
  const float* global_scale;
  const float* global_grad_norm;
  float max_grad_norm;
  bool decoupled;  // moment_mode 1
};

// Lists: 0 g (Grad), 1 p (Param), 2 m, 3 v, 4 u (fp32).
template <typename Grad, typename Param>
struct UpdateTermFunctor {
  UpdateTermArgs args;

  __device__ void operator()(const apex::Chunk<5>& chunk) const {
    if (*args.noop_flag != 0) return;
    const int64_t t = chunk.tensor_index;
    // The gradients are divided by the loss scale and, with clipping, by max(1, norm / max_grad_norm)
    // (the norm is of the scaled gradients): one divisor, as the reference.
    const float scale = *args.global_scale;
    float divisor = scale;
    if (args.max_grad_norm > 0.0f) {
      const float clip = __fdiv_rn(args.max_grad_norm, __fdiv_rn(*args.global_grad_norm, scale) + 1e-6f);
      divisor = __fdiv_rn(scale, clip > 1.0f ? 1.0f : clip);  // NaN stays NaN, as clamp(max=1)
    }
    const float inv_divisor = __frcp_rn(divisor);
    const float beta1 = args.beta1[t], beta2 = args.beta2[t], beta3 = args.beta3[t];
    const float one_minus_beta2 = 1.0f - beta2;
    const float eps = args.epsilon[t], decay = args.decay[t];
    float inv_bc1 = 1.0f, inv_bc2 = 1.0f;
    if (args.bias_correction[t] == 1) {
      const float step = static_cast<float>(*args.step);
      inv_bc1 = __frcp_rn(co::bias_correction(beta1, step));
      inv_bc2 = __frcp_rn(co::bias_correction(beta2, step));
    }
    const bool decoupled = args.decoupled;

    const Grad* grad = chunk.template data<Grad>(0);
    const Param* param = chunk.template data<Param>(1);
    float* exp_avg = chunk.template data<float>(2);
    float* exp_avg_sq = chunk.template data<float>(3);
    float* update = chunk.template data<float>(4);
    auto body = [&](auto group) {
      typename decltype(group)::Values g, p, m, v;
      group.load(g, grad);
      group.load(p, param);
      group.load(m, exp_avg);
      group.load(v, exp_avg_sq);
      group.for_each_value([&](int i, int j) {
        float gj = g[i][j] * inv_divisor;
        if (!decoupled) gj += decay * p[i][j];
        const float mj = m[i][j] * beta1 + beta3 * gj;
        const float vj = v[i][j] * beta2 + one_minus_beta2 * gj * gj;
        float uj = __fdiv_rn(mj * inv_bc1, __fsqrt_rn(vj * inv_bc2) + eps);
        if (decoupled) uj += decay * p[i][j];
        m[i][j] = mj;
        v[i][j] = vj;
        g[i][j] = uj;  // u, in g's registers
      });
      group.store(exp_avg, m);
      group.store(exp_avg_sq, v);
      group.store(update, g);
    };
    constexpr int kWidth = apex::vector_width<Grad, Param, float>();
    apex::for_each_element<kWidth, co::accesses_in_flight<kWidth>()>(chunk.size, body, grad, param, exp_avg,
                                                                     exp_avg_sq, update);
  }
};

// A 1-D per-tensor argument of at least n elements (dtype, device), as _check_per_tensor.
void check_per_tensor(const char* op, const char* name, const at::Tensor& t, size_t n, c10::Device device,
                      c10::ScalarType dtype) {
  checks::placed(op, name, t, device);
  TORCH_CHECK_VALUE(t.scalar_type() == dtype && t.dim() == 1 && t.numel() >= static_cast<int64_t>(n), op, ": ",
                    name, " must be a 1-D ", checks::torch_dtype(dtype), " tensor of at least ", n,
                    " elements (one per tensor), got ", checks::torch_dtype(t.scalar_type()), " of shape ",
                    checks::shape_string(t.sizes()));
}

// The tensors of per-tensor arguments are read at [index] on the device: contiguous ones as they
// are, others through a contiguous copy (enqueued on the stream, so no host sync).
template <typename T>
const T* per_tensor_ptr(const at::Tensor& t, std::vector<at::Tensor>& keep) {
  keep.push_back(t.contiguous());
  return keep.back().const_data_ptr<T>();
}

void check_lists_numel(const char* op, at::TensorList p, std::initializer_list<checks::NamedTensorList> lists) {
  for (const auto& [name, tensors] : lists) checks::same_numel(op, name, tensors, "p", p);
  std::vector<checks::NamedTensorList> all = {{"p", p}};
  for (const auto& list : lists) all.push_back(list);
  // The kernels run over the storage: a non-contiguous tensor needs the layout of the others.
  checks::same_layouts(op, all);
}

}  // namespace

namespace apex_contrib_optimizers {

void lamb_compute_update_term_cuda(const at::Tensor& noop_flag, at::TensorList g, at::TensorList p, at::TensorList m,
                                   at::TensorList v, at::TensorList u, const at::Tensor& beta1,
                                   const at::Tensor& beta2, const at::Tensor& beta3,
                                   const at::Tensor& bias_correction, const at::Tensor& step,
                                   const at::Tensor& epsilon, int64_t moment_mode, const at::Tensor& decay,
                                   const at::Tensor& global_scale, const at::Tensor& global_grad_norm,
                                   double max_grad_norm) {
  static constexpr c10::ScalarType kInt[] = {at::kInt};
  const c10::Device device = checks::scalar_tensor(kUpdateTerm, "noop_flag", noop_flag, kInt);
  const size_t n = checks::same_lengths(
      kUpdateTerm, {{"g", g.size()}, {"p", p.size()}, {"m", m.size()}, {"v", v.size()}, {"u", u.size()}});
  if (n == 0) return;
  checks::tensor_list(kUpdateTerm, "g", g, device);
  checks::tensor_list(kUpdateTerm, "p", p, device, kParamDtypes);
  checks::tensor_list(kUpdateTerm, "m", m, device, kFloat);
  checks::tensor_list(kUpdateTerm, "v", v, device, kFloat);
  checks::tensor_list(kUpdateTerm, "u", u, device, kFloat);
  check_lists_numel(kUpdateTerm, p, {{"g", g}, {"m", m}, {"v", v}, {"u", u}});
  const std::pair<const char*, const at::Tensor*> per_tensor[] = {
      {"beta1", &beta1}, {"beta2", &beta2}, {"beta3", &beta3}, {"epsilon", &epsilon}, {"decay", &decay}};
  for (const auto& [name, t] : per_tensor) check_per_tensor(kUpdateTerm, name, *t, n, device, at::kFloat);
  check_per_tensor(kUpdateTerm, "bias_correction", bias_correction, n, device, at::kInt);
  checks::scalar_tensor(kUpdateTerm, "step", step, kInt, device);
  checks::scalar_tensor(kUpdateTerm, "global_scale", global_scale, kFloat, device);
  checks::scalar_tensor(kUpdateTerm, "global_grad_norm", global_grad_norm, kFloat, device);
  TORCH_CHECK_VALUE(moment_mode == 0 || moment_mode == 1, kUpdateTerm,
                    ": moment_mode must be 0 (L2 on the gradient) or 1 (decoupled decay), got ", moment_mode);

  std::vector<at::Tensor> keep;
  UpdateTermArgs args{};
  args.noop_flag = noop_flag.const_data_ptr<int32_t>();
  args.beta1 = per_tensor_ptr<float>(beta1, keep);
  args.beta2 = per_tensor_ptr<float>(beta2, keep);
  args.beta3 = per_tensor_ptr<float>(beta3, keep);
  args.bias_correction = per_tensor_ptr<int32_t>(bias_correction, keep);
  args.step = step.const_data_ptr<int32_t>();
  args.epsilon = per_tensor_ptr<float>(epsilon, keep);
  args.decay = per_tensor_ptr<float>(decay, keep);
  args.global_scale = global_scale.const_data_ptr<float>();
  args.global_grad_norm = global_grad_norm.const_data_ptr<float>();
  args.max_grad_norm = static_cast<float>(max_grad_norm);
  args.decoupled = moment_mode == 1;
  apex::dispatch_float_types(g[0].scalar_type(), kUpdateTerm, "g", [&](auto grad_tag) {
    using Grad = typename decltype(grad_tag)::type;
    if (p[0].scalar_type() == at::kHalf) {
      apex::multi_tensor_apply<5>(kChunkSize, {g, p, m, v, u}, UpdateTermFunctor<Grad, c10::Half>{args});
    } else {
      apex::multi_tensor_apply<5>(kChunkSize, {g, p, m, v, u}, UpdateTermFunctor<Grad, float>{args});
    }
  });
}

}  // namespace apex_contrib_optimizers

namespace {

// ---------------------------------------------------------------------------------------------
// lamb_update_weights

struct UpdateWeightsArgs {
  const int32_t* noop_flag;
  const float* param_norm;
  const float* update_norm;
  const int64_t* update_norm_offset;
  int64_t update_norms;  // elements of update_norm
  const float* learning_rate;
  const float* decay;
  bool use_nvlamb;
};

// Lists: 0 u (fp32), 1 p (Param), 2 p_copy (Copy; uint8 holds e5m2 codes).
template <typename Param, typename Copy>
struct UpdateWeightsFunctor {
  UpdateWeightsArgs args;

  __device__ void operator()(const apex::Chunk<3>& chunk) const {
    if (*args.noop_flag != 0) return;
    const int64_t t = chunk.tensor_index;
    const float lr = *args.learning_rate;
    const float param_norm = args.param_norm[t];
    const int64_t offset = args.update_norm_offset[t];
    // An offset outside update_norm cannot raise without a host sync: the tensor becomes NaN.
    const bool in_range = offset >= 0 && offset < args.update_norms;
    const float update_norm = in_range ? args.update_norm[offset] : std::numeric_limits<float>::quiet_NaN();
    bool trusted = param_norm != 0.0f && update_norm != 0.0f;
    if (!args.use_nvlamb) trusted = trusted && args.decay[t] != 0.0f;
    float ratio = trusted ? __fdiv_rn(lr * param_norm, update_norm) : lr;
    if (!in_range) ratio = update_norm;

    const float* update = chunk.template data<float>(0);
    Param* param = chunk.template data<Param>(1);
    Copy* copy = chunk.template data<Copy>(2);
    auto body = [&](auto group) {
      typename decltype(group)::Values u, p;
      group.load(u, update);
      group.load(p, param);
      group.for_each_value([&](int i, int j) { p[i][j] -= ratio * u[i][j]; });
      group.store(param, p);
      // the copy is of the fp32 value (not of p rounded to its dtype), as the reference
      if constexpr (std::is_same_v<Copy, uint8_t>) {
        group.for_each_value([&](int i, int j) { p[i][j] = co::e5m2_code(p[i][j]); });
      }
      group.store(copy, p);
    };
    // Two arrays read where Adam reads four: twice the elements in flight keep as many bytes in flight
    // (and, with fp32 p and copy, ptxas spilled a register at the default count, none at this one).
    constexpr int kWidth = apex::vector_width<float, Param, Copy>();
    apex::for_each_element<kWidth, 2 * co::accesses_in_flight<kWidth>()>(chunk.size, body, update, param, copy);
  }
};

}  // namespace

namespace apex_contrib_optimizers {

void lamb_update_weights_cuda(const at::Tensor& noop_flag, at::TensorList u, at::TensorList p, at::TensorList p_copy,
                              const at::Tensor& param_norm, const at::Tensor& update_norm,
                              const at::Tensor& update_norm_offset, const at::Tensor& learning_rate,
                              const at::Tensor& decay, const at::Tensor& global_grad_norm, bool use_nvlamb) {
  static constexpr c10::ScalarType kInt[] = {at::kInt};
  const c10::Device device = checks::scalar_tensor(kUpdateWeights, "noop_flag", noop_flag, kInt);
  const size_t n =
      checks::same_lengths(kUpdateWeights, {{"u", u.size()}, {"p", p.size()}, {"p_copy", p_copy.size()}});
  if (n == 0) return;
  checks::tensor_list(kUpdateWeights, "u", u, device, kFloat);
  checks::tensor_list(kUpdateWeights, "p", p, device, kParamDtypes);
  checks::tensor_list(kUpdateWeights, "p_copy", p_copy, device, kCopyDtypes);
  check_lists_numel(kUpdateWeights, p, {{"u", u}, {"p_copy", p_copy}});
  check_per_tensor(kUpdateWeights, "param_norm", param_norm, n, device, at::kFloat);
  check_per_tensor(kUpdateWeights, "decay", decay, n, device, at::kFloat);
  check_per_tensor(kUpdateWeights, "update_norm_offset", update_norm_offset, n, device, at::kLong);
  checks::placed(kUpdateWeights, "update_norm", update_norm, device);
  TORCH_CHECK_VALUE(update_norm.scalar_type() == at::kFloat && update_norm.dim() == 1, kUpdateWeights,
                    ": update_norm must be a 1-D float32 tensor, got ", checks::torch_dtype(update_norm.scalar_type()));
  checks::scalar_tensor(kUpdateWeights, "learning_rate", learning_rate, kFloat, device);
  checks::scalar_tensor(kUpdateWeights, "global_grad_norm", global_grad_norm, kFloat, device);

  std::vector<at::Tensor> keep;
  UpdateWeightsArgs args{};
  args.noop_flag = noop_flag.const_data_ptr<int32_t>();
  args.param_norm = per_tensor_ptr<float>(param_norm, keep);
  args.update_norm = per_tensor_ptr<float>(update_norm, keep);
  args.update_norm_offset = per_tensor_ptr<int64_t>(update_norm_offset, keep);
  args.update_norms = update_norm.numel();
  args.learning_rate = learning_rate.const_data_ptr<float>();
  args.decay = per_tensor_ptr<float>(decay, keep);
  args.use_nvlamb = use_nvlamb;
  auto launch = [&](auto param_tag, auto copy_tag) {
    using Param = typename decltype(param_tag)::type;
    using Copy = typename decltype(copy_tag)::type;
    apex::multi_tensor_apply<3>(kChunkSize, {u, p, p_copy}, UpdateWeightsFunctor<Param, Copy>{args});
  };
  auto with_param = [&](auto copy_tag) {
    if (p[0].scalar_type() == at::kHalf) {
      launch(apex::TypeTag<c10::Half>{}, copy_tag);
    } else {
      launch(apex::TypeTag<float>{}, copy_tag);
    }
  };
  if (p_copy[0].scalar_type() == at::kByte) {
    with_param(apex::TypeTag<uint8_t>{});
  } else {
    apex::dispatch_float_types(p_copy[0].scalar_type(), kUpdateWeights, "p_copy", with_param);
  }
}

}  // namespace apex_contrib_optimizers

