// The deprecated FusedAdam's ops (upstream's fused_adam_cuda): adam (optionally reversible, with an
// output copy that may be e5m2 bytes), adam_undo, maybe_cast and strided_check_finite. The math,
// the argument rules and the words of the errors are those of _ops.py's references.
//
// adam and adam_undo are one multi-tensor pass each; fp32 arithmetic for fp32/fp16/bf16 parameters
// through the vectorized element loop, fp64 arithmetic for fp64 parameters through a plain loop
// (the vectorized loop holds values as float). The reversible step's per-tensor signal (an infinity
// in p_copy[i][0] when any gradient element of tensor i is not finite) needs all of a tensor's
// blocks: they set a per-tensor flag and a second, one-block-per-tensor launch writes the infinity.
// Flags (overflow_flag) stay on the device: nothing here waits for the host.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
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

constexpr int64_t kChunkSize = 65536;  // the ops take no chunk_size
constexpr const char* kAdam = "adam";
constexpr const char* kUndo = "adam_undo";
constexpr const char* kMaybeCast = "maybe_cast";
constexpr const char* kCheckFinite = "strided_check_finite";
constexpr c10::ScalarType kParamDtypes[] = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16};
constexpr c10::ScalarType kOutputDtypes[] = {at::kFloat, at::kHalf, at::kBFloat16, at::kByte};
constexpr c10::ScalarType kCastDtypes[] = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kByte};
constexpr c10::ScalarType kInt[] = {at::kInt};

struct NoCopy {};  // adam without p_copy

// IEEE division and square root in the arithmetic type (the build uses --use_fast_math).
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return a / b; }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double sqrt_rn(double a) { return sqrt(a); }

// The value stored to a copy of type Copy (uint8: the e5m2 code) and read from an input of type In.
template <typename Copy, typename T>
__device__ __forceinline__ T to_copy(T x) {
  if constexpr (std::is_same_v<Copy, uint8_t>) {
    return static_cast<T>(co::e5m2_code(static_cast<float>(x)));
  } else {
    return x;
  }
}

template <typename In, typename T>
__device__ __forceinline__ T from_input(T x) {
  if constexpr (std::is_same_v<In, uint8_t>) {
    return static_cast<T>(co::e5m2_value(static_cast<float>(x)));
  } else {
    return x;
  }
}

// A plain element loop (for fp64 data): body(i) for i in [0, n) over the block's threads.
template <typename Body>
__device__ __forceinline__ void for_each_index(int64_t n, Body&& body) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) body(i);
}

// ---------------------------------------------------------------------------------------------
// adam and adam_undo

struct AdamArgs {
  double step_size;  // lr, times sqrt(1 - beta2^t) / (1 - beta1^t) with bias correction
  double beta1;
  double beta2;
  double eps;
  double grad_scale;
  double decay;
  bool eps_inside_sqrt;  // eps_mode 0
  bool reversible;
  int32_t* bad_tensors;          // reversible with p_copy: set at [tensor] when a gradient is not finite
  const int32_t* overflow_flag;  // adam_undo: undo only when set
};

// The hyperparameters in the arithmetic type T (fp32, or fp64 for fp64 parameters).
template <typename T>
struct AdamMath {
  T step_size, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, grad_scale, decay;
  bool eps_inside_sqrt;

  __device__ __forceinline__ explicit AdamMath(const AdamArgs& a)
      : step_size(static_cast<T>(a.step_size)),
        beta1(static_cast<T>(a.beta1)),
        beta2(static_cast<T>(a.beta2)),
        one_minus_beta1(static_cast<T>(1.0 - a.beta1)),
        one_minus_beta2(static_cast<T>(1.0 - a.beta2)),
        eps(static_cast<T>(a.eps)),
        grad_scale(static_cast<T>(a.grad_scale)),
        decay(static_cast<T>(a.decay)),
        eps_inside_sqrt(a.eps_inside_sqrt) {}

  __device__ __forceinline__ T denominator(T v) const {
    return eps_inside_sqrt ? sqrt_rn(v + eps) : sqrt_rn(v) + eps;
  }

  __device__ __forceinline__ T unscale(T g) const { return div_rn(g, grad_scale); }

  // One Adam step of the reference; with `reversible` a non-finite (unscaled) gradient leaves
  // p, m, v as they were. Returns whether the gradient was finite.
  __device__ __forceinline__ bool step(T& p, T& m, T& v, T g, bool reversible) const {
    g = unscale(g);
    const T next_m = m * beta1 + one_minus_beta1 * g;
    const T next_v = v * beta2 + one_minus_beta2 * g * g;
    const T next_p = p - step_size * (div_rn(next_m, denominator(next_v)) + decay * p);
    const bool finite = isfinite(g);
    if (finite || !reversible) {
      p = next_p;
      m = next_m;
      v = next_v;
    }
    return finite;
  }

  // adam_undo's inverse of step, where the gradient is finite (the caller checks the flag).
  __device__ __forceinline__ void undo(T& p, T& m, T& v, T g) const {
    g = unscale(g);
    if (!isfinite(g)) return;
    const T old_p = div_rn(p + step_size * div_rn(m, denominator(v)), T(1) - step_size * decay);
    const T old_m = div_rn(m - one_minus_beta1 * g, beta1);
    T old_v = div_rn(v - one_minus_beta2 * g * g, beta2);
    old_v = old_v < T(0) ? T(0) : old_v;  // rounding can leave a tiny negative second moment; NaN stays
    p = old_p;
    m = old_m;
    v = old_v;
  }
};

// Lists: 0 p (Param), 1 m, 2 v (State: fp32, fp64 for fp64 p), 3 g (Grad), and unless Copy is
// NoCopy 4 p_copy (Copy; uint8 holds e5m2 codes).
template <typename Param, typename Grad, typename Copy>
struct AdamFunctor {
  static constexpr bool kCopy = !std::is_same_v<Copy, NoCopy>;
  static constexpr int kDepth = kCopy ? 5 : 4;
  using State = std::conditional_t<std::is_same_v<Param, double>, double, float>;
  AdamArgs args;

  __device__ void operator()(const apex::Chunk<kDepth>& chunk) const {
    const AdamMath<State> math(args);
    const bool reversible = args.reversible;
    Param* param = chunk.template data<Param>(0);
    State* exp_avg = chunk.template data<State>(1);
    State* exp_avg_sq = chunk.template data<State>(2);
    const Grad* grad = chunk.template data<Grad>(3);
    bool all_finite = true;
    if constexpr (std::is_same_v<State, double>) {
      for_each_index(chunk.size, [&](int64_t i) {
        double p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
        all_finite &= math.step(p, m, v, static_cast<double>(grad[i]), reversible);
        param[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        if constexpr (kCopy) chunk.template data<Copy>(4)[i] = static_cast<Copy>(to_copy<Copy>(static_cast<float>(p)));
      });
    } else {
      auto body = [&](auto group) {
        typename decltype(group)::Values p, m, v, g;
        group.load(p, param);
        group.load(m, exp_avg);
        group.load(v, exp_avg_sq);
        group.load(g, grad);
        group.for_each_value([&](int i, int j) {
          all_finite &= math.step(p[i][j], m[i][j], v[i][j], g[i][j], reversible);
          g[i][j] = to_copy<Copy>(p[i][j]);  // the copy is of the fp32 value, not of p rounded
        });
        group.store(exp_avg, m);
        group.store(exp_avg_sq, v);
        group.store(param, p);
        if constexpr (kCopy) group.store(chunk.template data<Copy>(4), g);
      };
      if constexpr (kCopy) {
        // All fp32 (four-byte copies too): 16 elements in flight of five arrays spilled (128 registers);
        // 12 do not.
        constexpr int kWidth = apex::vector_width<Param, Grad, Copy, float>();
        constexpr int kCount = kWidth == 4 && sizeof(Copy) == 4 ? 3 : co::accesses_in_flight<kWidth>();
        apex::for_each_element<kWidth, kCount>(chunk.size, body, param, exp_avg, exp_avg_sq, grad,
                                               chunk.template data<Copy>(4));
      } else {
        constexpr int kWidth = apex::vector_width<Param, Grad, float>();
        apex::for_each_element<kWidth, co::accesses_in_flight<kWidth>()>(chunk.size, body, param, exp_avg, exp_avg_sq,
                                                                         grad);
      }
    }
    if (kCopy && reversible && !all_finite) atomicOr(args.bad_tensors + chunk.tensor_index, 1);
  }
};

// The reversible step's signal: p_copy[i][0] = infinity (its e5m2 code for uint8) where tensor i
// had a non-finite gradient. One block per tensor (chunk_size covers any tensor).
template <typename Copy>
struct MarkBadTensors {
  const int32_t* bad_tensors;

  __device__ void operator()(const apex::Chunk<1>& chunk) const {
    if (threadIdx.x != 0 || chunk.start != 0 || bad_tensors[chunk.tensor_index] == 0) return;
    const float inf = std::numeric_limits<float>::infinity();
    chunk.template data<Copy>(0)[0] = static_cast<Copy>(to_copy<Copy>(inf));
  }
};
constexpr int64_t kOneChunkPerTensor = int64_t{1} << 62;

// Lists: 0 p, 1 m, 2 v, 3 g.
template <typename Param, typename Grad>
struct UndoFunctor {
  using State = std::conditional_t<std::is_same_v<Param, double>, double, float>;
  AdamArgs args;

  __device__ void operator()(const apex::Chunk<4>& chunk) const {
    if (*args.overflow_flag == 0) return;
    const AdamMath<State> math(args);
    Param* param = chunk.template data<Param>(0);
    State* exp_avg = chunk.template data<State>(1);
    State* exp_avg_sq = chunk.template data<State>(2);
    const Grad* grad = chunk.template data<Grad>(3);
    if constexpr (std::is_same_v<State, double>) {
      for_each_index(chunk.size, [&](int64_t i) {
        double p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
        math.undo(p, m, v, static_cast<double>(grad[i]));
        param[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
      });
    } else {
      auto body = [&](auto group) {
        typename decltype(group)::Values p, m, v, g;
        group.load(p, param);
        group.load(m, exp_avg);
        group.load(v, exp_avg_sq);
        group.load(g, grad);
        group.for_each_value([&](int i, int j) { math.undo(p[i][j], m[i][j], v[i][j], g[i][j]); });
        group.store(exp_avg, m);
        group.store(exp_avg_sq, v);
        group.store(param, p);
      };
      constexpr int kWidth = apex::vector_width<Param, Grad, float>();
      apex::for_each_element<kWidth, co::accesses_in_flight<kWidth>()>(chunk.size, body, param, exp_avg, exp_avg_sq,
                                                                       grad);
    }
  }
};

// _check_adam_lists: returns the device of p, nullopt when there are none.
std::optional<c10::Device> check_adam_lists(const char* op, at::TensorList p, at::TensorList m, at::TensorList v,
                                            at::TensorList g, at::TensorList p_copy, int64_t eps_mode, int64_t step,
                                            bool bias_correction, double grad_scale) {
  checks::same_lengths(op, {{"p", p.size()}, {"m", m.size()}, {"v", v.size()}, {"g", g.size()}});
  if (p.empty()) return std::nullopt;
  const c10::Device device = p[0].device();
  checks::tensor_list(op, "p", p, device, kParamDtypes);
  const auto param = p[0].scalar_type();
  const c10::ScalarType state[] = {param == at::kDouble ? at::kDouble : at::kFloat};
  checks::tensor_list(op, "m", m, device, state);
  checks::tensor_list(op, "v", v, device, state);
  if (param == at::kFloat) {
    const c10::ScalarType grads[] = {at::kFloat, at::kHalf, at::kBFloat16};
    checks::tensor_list(op, "g", g, device, grads);
  } else {
    const c10::ScalarType grads[] = {param};
    checks::tensor_list(op, "g", g, device, grads);
  }
  std::vector<checks::NamedTensorList> lists = {{"p", p}, {"m", m}, {"v", v}, {"g", g}};
  if (!p_copy.empty()) {
    checks::same_lengths(op, {{"p", p.size()}, {"p_copy", p_copy.size()}});
    checks::tensor_list(op, "p_copy", p_copy, device, kOutputDtypes);
    lists.emplace_back("p_copy", p_copy);
  }
  for (size_t k = 1; k < lists.size(); ++k) checks::same_numel(op, lists[k].first, lists[k].second, "p", p);
  checks::same_layouts(op, lists);
  TORCH_CHECK_VALUE(eps_mode == 0 || eps_mode == 1, op,
                    ": eps_mode must be 0 (eps inside the square root) or 1 (outside), got ", eps_mode);
  TORCH_CHECK_VALUE(!bias_correction || step >= 1, op, ": step must be >= 1 with bias_correction, got ", step);
  TORCH_CHECK_VALUE(grad_scale > 0, op, ": grad_scale must be positive, got ", grad_scale);
  return device;
}

AdamArgs adam_args(double lr, double beta1, double beta2, double eps, double grad_scale, int64_t step,
                   int64_t eps_mode, bool bias_correction, double decay) {
  AdamArgs a{};
  // adam_step_size of _ops.py, in double on the host
  a.step_size = bias_correction ? lr * std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))) /
                                      (1.0 - std::pow(beta1, static_cast<double>(step)))
                                : lr;
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.eps = eps;
  a.grad_scale = grad_scale;
  a.decay = decay;
  a.eps_inside_sqrt = eps_mode == 0;
  return a;
}

// Calls f(TypeTag<Param>, TypeTag<Grad>) for the (checked) dtypes of p and g.
template <typename F>
void dispatch_param_grad(const char* op, c10::ScalarType param, c10::ScalarType grad, F&& f) {
  if (param == at::kDouble) {
    f(apex::TypeTag<double>{}, apex::TypeTag<double>{});
  } else if (param == at::kFloat) {
    apex::dispatch_float_types(grad, op, "g", [&](auto grad_tag) { f(apex::TypeTag<float>{}, grad_tag); });
  } else {
    apex::dispatch_float_types(param, op, "p", [&](auto param_tag) { f(param_tag, param_tag); });
  }
}

// Calls f(TypeTag<T>) for a float dtype or uint8 (e5m2 codes), and for float64 when allowed.
template <typename F>
void dispatch_cast_type(c10::ScalarType dtype, const char* op, const char* arg, F&& f) {
  if (dtype == at::kByte) {
    f(apex::TypeTag<uint8_t>{});
  } else if (dtype == at::kDouble) {
    f(apex::TypeTag<double>{});
  } else {
    apex::dispatch_float_types(dtype, op, arg, f);
  }
}

}  // namespace

namespace apex_contrib_optimizers {

void adam_cuda(at::TensorList p, at::TensorList p_copy, at::TensorList m, at::TensorList v, at::TensorList g,
               double lr, double beta1, double beta2, double eps, double grad_scale, int64_t step, int64_t eps_mode,
               bool bias_correction, double decay, bool reversible) {
  const auto device = check_adam_lists(kAdam, p, m, v, g, p_copy, eps_mode, step, bias_correction, grad_scale);
  TORCH_CHECK_TYPE(p_copy.empty() || p_copy[0].scalar_type() != at::kByte || reversible, kAdam,
                   ": p_copy has dtype torch.uint8 (e5m2); only the reversible step writes e5m2");
  if (!device) return;
  AdamArgs args = adam_args(lr, beta1, beta2, eps, grad_scale, step, eps_mode, bias_correction, decay);
  args.reversible = reversible;
  at::Tensor bad;
  if (reversible && !p_copy.empty()) {
    bad = at::zeros({static_cast<int64_t>(p.size())}, p[0].options().dtype(at::kInt));
    args.bad_tensors = bad.mutable_data_ptr<int32_t>();
  }
  dispatch_param_grad(kAdam, p[0].scalar_type(), g[0].scalar_type(), [&](auto param_tag, auto grad_tag) {
    using Param = typename decltype(param_tag)::type;
    using Grad = typename decltype(grad_tag)::type;
    if (p_copy.empty()) {
      apex::multi_tensor_apply<4>(kChunkSize, {p, m, v, g}, AdamFunctor<Param, Grad, NoCopy>{args});
      return;
    }
    dispatch_cast_type(p_copy[0].scalar_type(), kAdam, "p_copy", [&](auto copy_tag) {
      using Copy = typename decltype(copy_tag)::type;
      if constexpr (!std::is_same_v<Copy, double>) {  // checked: p_copy is never fp64
        apex::multi_tensor_apply<5>(kChunkSize, {p, m, v, g, p_copy}, AdamFunctor<Param, Grad, Copy>{args});
        if (reversible) apex::multi_tensor_apply<1>(kOneChunkPerTensor, {p_copy}, MarkBadTensors<Copy>{args.bad_tensors});
      }
    });
  });
}

void adam_undo_cuda(const at::Tensor& overflow_flag, at::TensorList p, at::TensorList m, at::TensorList v,
                    at::TensorList g, double lr, double beta1, double beta2, double eps, double grad_scale,
                    int64_t step, int64_t eps_mode, bool bias_correction, double decay) {
  const c10::Device flag_device = checks::scalar_tensor(kUndo, "overflow_flag", overflow_flag, kInt);
  const auto device = check_adam_lists(kUndo, p, m, v, g, {}, eps_mode, step, bias_correction, grad_scale);
  if (!device) return;
  TORCH_CHECK_VALUE(*device == flag_device, kUndo, ": overflow_flag is on ", flag_device, ", expected ", *device);
  AdamArgs args = adam_args(lr, beta1, beta2, eps, grad_scale, step, eps_mode, bias_correction, decay);
  args.overflow_flag = overflow_flag.const_data_ptr<int32_t>();
  dispatch_param_grad(kUndo, p[0].scalar_type(), g[0].scalar_type(), [&](auto param_tag, auto grad_tag) {
    using Param = typename decltype(param_tag)::type;
    using Grad = typename decltype(grad_tag)::type;
    apex::multi_tensor_apply<4>(kChunkSize, {p, m, v, g}, UndoFunctor<Param, Grad>{args});
  });
}

}  // namespace apex_contrib_optimizers

namespace {

// ---------------------------------------------------------------------------------------------
// maybe_cast and strided_check_finite

// Lists: 0 p_in (In), 1 p_out (Out); uint8 is e5m2 codes either way.
template <typename In, typename Out>
struct CastFunctor {
  const int32_t* overflow_flag;

  __device__ void operator()(const apex::Chunk<2>& chunk) const {
    if (*overflow_flag != 0) return;
    const In* in = chunk.template data<In>(0);
    Out* out = chunk.template data<Out>(1);
    if constexpr (std::is_same_v<In, double> || std::is_same_v<Out, double>) {
      for_each_index(chunk.size, [&](int64_t i) {
        double x = static_cast<double>(in[i]);
        if constexpr (std::is_same_v<In, uint8_t>) x = co::e5m2_value(static_cast<float>(in[i]));
        if constexpr (std::is_same_v<Out, uint8_t>) {
          out[i] = static_cast<uint8_t>(co::e5m2_code(static_cast<float>(x)));
        } else {
          out[i] = static_cast<Out>(x);
        }
      });
    } else {
      auto body = [&](auto group) {
        typename decltype(group)::Values x;
        group.load(x, in);
        group.for_each_value([&](int i, int j) { x[i][j] = to_copy<Out>(from_input<In>(x[i][j])); });
        group.store(out, x);
      };
      constexpr int kWidth = apex::vector_width<In, Out>();
      apex::for_each_element<kWidth, co::accesses_in_flight<kWidth>()>(chunk.size, body, in, out);
    }
  }
};

}  // namespace

namespace apex_contrib_optimizers {

void maybe_cast_cuda(const at::Tensor& overflow_flag, at::TensorList p_in, at::TensorList p_out) {
  const c10::Device device = checks::scalar_tensor(kMaybeCast, "overflow_flag", overflow_flag, kInt);
  checks::same_lengths(kMaybeCast, {{"p_in", p_in.size()}, {"p_out", p_out.size()}});
  checks::tensor_list(kMaybeCast, "p_in", p_in, device, kCastDtypes);
  checks::tensor_list(kMaybeCast, "p_out", p_out, device, kCastDtypes);
  checks::same_numel(kMaybeCast, "p_out", p_out, "p_in", p_in);
  checks::same_layouts(kMaybeCast, {{"p_in", p_in}, {"p_out", p_out}});
  if (p_in.empty()) return;
  dispatch_cast_type(p_in[0].scalar_type(), kMaybeCast, "p_in", [&](auto in_tag) {
    dispatch_cast_type(p_out[0].scalar_type(), kMaybeCast, "p_out", [&](auto out_tag) {
      using In = typename decltype(in_tag)::type;
      using Out = typename decltype(out_tag)::type;
      apex::multi_tensor_apply<2>(kChunkSize, {p_in, p_out},
                                  CastFunctor<In, Out>{overflow_flag.const_data_ptr<int32_t>()});
    });
  });
}

}  // namespace apex_contrib_optimizers

namespace {

// Elements 0, stride, 2 stride, ... of a flat tensor; sets *flag to 1 if any is not finite. One
// thread per sampled element over a grid-stride loop; racing writes all write 1.
template <typename T>
__global__ void check_finite_kernel(const T* data, int64_t samples, int64_t stride, int32_t* flag) {
  bool bad = false;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < samples;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<T, uint8_t>) {
      bad |= (data[k * stride] & 0x7C) == 0x7C;  // e5m2: exponent bits all set, inf or NaN
    } else {
      bad |= !isfinite(static_cast<double>(data[k * stride]));
    }
  }
  if (bad) *flag = 1;
}

}  // namespace

namespace apex_contrib_optimizers {

void strided_check_finite_cuda(const at::Tensor& overflow_flag, const at::Tensor& p_copy, int64_t stride,
                               bool clear_overflow_first) {
  const c10::Device device = checks::scalar_tensor(kCheckFinite, "overflow_flag", overflow_flag, kInt);
  checks::tensor_list(kCheckFinite, "p_copy", {p_copy}, device, kCastDtypes);
  TORCH_CHECK_VALUE(stride >= 1, kCheckFinite, ": stride must be >= 1, got ", stride);
  const c10::cuda::CUDAGuard device_guard(device);
  at::Tensor flag = overflow_flag;
  if (clear_overflow_first) flag.zero_();
  const at::Tensor flat = p_copy.contiguous();  // every stride-th element in the logical order
  const int64_t samples = (flat.numel() + stride - 1) / stride;
  if (samples == 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((samples + kThreads - 1) / kThreads, 4096);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_cast_type(flat.scalar_type(), kCheckFinite, "p_copy", [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_finite_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        flat.const_data_ptr<T>(), samples, stride, flag.mutable_data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace apex_contrib_optimizers

