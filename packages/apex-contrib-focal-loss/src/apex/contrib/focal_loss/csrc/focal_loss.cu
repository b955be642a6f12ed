// Sigmoid focal loss: the forward (loss and un-normalised gradient in one pass) and the backward
// (the gradient scaled by grad_output / num_positives_sum), out of place and in place. The math,
// the references and the wording of the checks are in apex.contrib.focal_loss's _ops.py.
//
// The forward walks the logits as one flat array of rows * classes elements, 16 bytes at a time
// when the logits are 16-byte aligned (a scalar tail takes what does not fill a vector), so any
// class count works: an element's row and class come from one division per vector, then a
// counter. Each block sums its elements' losses (fixed order: warp shuffles), a second kernel
// sums the blocks' partial sums in a fixed order and divides by num_positives_sum[0] on the
// device: no atomics, no host sync, the same bits on every run on one device.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/launch.cuh>
#include <apex/reductions.cuh>
#include <apex/vectorized.cuh>

#include "cuda_ops.h"

namespace {

constexpr int kThreads = 256;
constexpr int kFinalThreads = 1024;
constexpr int64_t kIgnore = -2;

// float32 math for the 16-bit types, float64 for float64.
template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename A>
struct Params {
  int64_t numel;
  int64_t classes;
  int64_t num_real_classes;
  A alpha;
  A gamma;
  A half_smoothing;  // label_smoothing / 2: the target of a negative; 1 - it of a positive
};

C10_DEVICE C10_ALWAYS_INLINE float exp_(float v) { return __expf(v); }
C10_DEVICE C10_ALWAYS_INLINE double exp_(double v) { return exp(v); }
C10_DEVICE C10_ALWAYS_INLINE float log1p_(float v) { return log1pf(v); }
C10_DEVICE C10_ALWAYS_INLINE double log1p_(double v) { return log1p(v); }

// The loss of one element and its gradient (un-normalised), see _ops.py's focal_terms.
template <typename A>
C10_DEVICE C10_ALWAYS_INLINE A focal_element(A x, bool positive, const Params<A>& p, A& grad) {
  const A e = exp_(-fabs(x));
  const A l = log1p_(e);
  const A neg_log_p = (x < A(0) ? -x : A(0)) + l;       // -log(sigmoid(x))
  const A neg_log_1mp = (x > A(0) ? x : A(0)) + l;      // -log(1 - sigmoid(x))
  const A prob = (x >= A(0) ? A(1) : e) / (A(1) + e);   // sigmoid(x)
  const A target = positive ? A(1) - p.half_smoothing : p.half_smoothing;
  const A bce = target * neg_log_p + (A(1) - target) * neg_log_1mp;
  const A factor = (positive ? p.alpha : A(1) - p.alpha) * exp_(-p.gamma * (positive ? neg_log_1mp : neg_log_p));
  const A slope = positive ? -p.gamma * prob : p.gamma * (A(1) - prob);
  grad = factor * (slope * bce + prob - target);
  return factor * bce;
}

// Where an element sits: its row's target and its class, advanced one element at a time.
struct Cursor {
  int64_t row;
  int64_t column;
  int64_t target;

  C10_DEVICE C10_ALWAYS_INLINE Cursor(int64_t element, int64_t classes, const int64_t* targets) {
    row = element / classes;
    column = element - row * classes;
    target = targets[row];
  }

  C10_DEVICE C10_ALWAYS_INLINE void next(int64_t classes, const int64_t* targets) {
    if (++column == classes) {
      column = 0;
      target = targets[++row];
    }
  }
};

// Elements [first, first + W) (all of them exist): partial gradients stored, losses added to sum.
template <int W, typename T, typename A>
C10_DEVICE C10_ALWAYS_INLINE void forward_elements(int64_t first, const T* x, const int64_t* targets,
                                                   T* partial_grad, const Params<A>& p, A& sum) {
  A v[W];
  if constexpr (W == 1) {
    v[0] = static_cast<A>(x[first]);
  } else {
    const auto loaded = apex::load_vector<T, W>(x + first);
#pragma unroll
    for (int j = 0; j < W; ++j) v[j] = static_cast<A>(loaded.val[j]);
  }
  Cursor at(first, p.classes, targets);
  apex::AlignedVector<T, W> out;
#pragma unroll
  for (int j = 0; j < W; ++j) {
    if (j > 0) at.next(p.classes, targets);
    A grad = A(0);
    if (at.column < p.num_real_classes && at.target != kIgnore) {
      sum += focal_element(v[j], at.target == at.column, p, grad);
    }
    out.val[j] = static_cast<T>(grad);
  }
  if constexpr (W == 1) {
    partial_grad[first] = out.val[0];
  } else {
    apex::store_vector_plain(partial_grad + first, out);
  }
}

// W == 1, or x and partial_grad 16-byte aligned. Block b writes its loss sum to block_sums[b].
template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const T* __restrict__ x, const int64_t* __restrict__ targets, T* __restrict__ partial_grad,
                   Acc<T>* __restrict__ block_sums, Params<Acc<T>> p) {
  using A = Acc<T>;
  __shared__ A shared[apex::kWarpSize];
  A sum = A(0);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t vectors = p.numel / W;
  for (int64_t v = thread; v < vectors; v += stride) {
    forward_elements<W>(v * W, x, targets, partial_grad, p, sum);
  }
  if constexpr (W > 1) {  // the tail: fewer than W elements
    for (int64_t i = vectors * W + thread; i < p.numel; i += stride) {
      forward_elements<1>(i, x, targets, partial_grad, p, sum);
    }
  }
  sum = apex::block_sum(sum, shared);
  if (threadIdx.x == 0) block_sums[blockIdx.x] = sum;
}

// loss = (sum of block_sums) / num_positives_sum[0], in a fixed order.
template <typename A>
__global__ void __launch_bounds__(kFinalThreads)
    finish_kernel(A* __restrict__ loss, const A* __restrict__ block_sums, int blocks,
                  const float* __restrict__ num_positives_sum) {
  __shared__ A shared[apex::kWarpSize];
  A sum = A(0);
  for (int b = threadIdx.x; b < blocks; b += kFinalThreads) sum += block_sums[b];
  sum = apex::block_sum(sum, shared);
  if (threadIdx.x == 0) *loss = sum / static_cast<A>(*num_positives_sum);
}

// out = partial_grad * (grad_output[0] / num_positives_sum[0]); out may be partial_grad.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(T* out, const T* partial_grad, const Acc<T>* __restrict__ grad_output,
                    const float* __restrict__ num_positives_sum, int64_t numel) {
  using A = Acc<T>;
  const A scale = *grad_output / static_cast<A>(*num_positives_sum);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t vectors = numel / W;
  for (int64_t v = thread; v < vectors; v += stride) {
    if constexpr (W == 1) {
      out[v] = static_cast<T>(static_cast<A>(partial_grad[v]) * scale);
    } else {
      auto values = apex::load_vector<T, W>(partial_grad + v * W);
#pragma unroll
      for (int j = 0; j < W; ++j) values.val[j] = static_cast<T>(static_cast<A>(values.val[j]) * scale);
      apex::store_vector_plain(out + v * W, values);
    }
  }
  if constexpr (W > 1) {
    for (int64_t i = vectors * W + thread; i < numel; i += stride) {
      out[i] = static_cast<T>(static_cast<A>(partial_grad[i]) * scale);
    }
  }
}

// checks, worded as _ops.py's ------------------------------------------------------------------

constexpr const char* kDtypeNames = "float32, float16, bfloat16, float64";

bool supported_dtype(c10::ScalarType dtype) {
  return apex::checks::contains(apex::checks::kFloatDtypes, dtype) || dtype == c10::ScalarType::Double;
}

c10::ScalarType loss_dtype(c10::ScalarType dtype) {
  return dtype == c10::ScalarType::Double ? c10::ScalarType::Double : c10::ScalarType::Float;
}

void check_num_positives_sum(const char* op, const at::Tensor& t, c10::Device device) {
  const c10::ScalarType float32[] = {c10::ScalarType::Float};
  apex::checks::scalar_tensor(op, "num_positives_sum", t, float32, device);
}

void check_forward(const char* op, const at::Tensor& x, const at::Tensor& targets, const at::Tensor& num_positives_sum,
                   int64_t num_real_classes, double alpha, double gamma, double label_smoothing) {
  namespace checks = apex::checks;
  TORCH_CHECK_TYPE(supported_dtype(x.scalar_type()), op, ": cls_output has dtype ", checks::torch_dtype(x.scalar_type()),
                   "; expected one of ", kDtypeNames);
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": cls_output must have a class dimension (at least 1-D), got shape ",
                    checks::shape_string(x.sizes()));
  checks::dense(op, "cls_output", x, x.device());
  TORCH_CHECK_TYPE(targets.scalar_type() == c10::ScalarType::Long, op, ": cls_targets_at_level has dtype ",
                   checks::torch_dtype(targets.scalar_type()), "; expected int64");
  const auto rows_shape = x.sizes().slice(0, x.dim() - 1);
  TORCH_CHECK_VALUE(targets.sizes() == rows_shape, op,
                    ": cls_targets_at_level must have cls_output's shape without the class dimension, ",
                    checks::shape_string(rows_shape), ", got ", checks::shape_string(targets.sizes()));
  checks::dense(op, "cls_targets_at_level", targets, x.device());
  check_num_positives_sum(op, num_positives_sum, x.device());
  const int64_t classes = x.size(-1);
  TORCH_CHECK_VALUE(num_real_classes >= 0 && num_real_classes <= classes, op, ": num_real_classes must be in [0, ",
                    classes, "] (cls_output's last dimension), got ", num_real_classes);
  TORCH_CHECK_VALUE(std::isfinite(alpha), op, ": alpha must be finite, got ", alpha);
  TORCH_CHECK_VALUE(std::isfinite(gamma), op, ": gamma must be finite, got ", gamma);
  TORCH_CHECK_VALUE(std::isfinite(label_smoothing), op, ": label_smoothing must be finite, got ", label_smoothing);
}

void check_backward(const char* op, const at::Tensor& grad_output, const at::Tensor& partial_grad,
                    const at::Tensor& num_positives_sum) {
  namespace checks = apex::checks;
  TORCH_CHECK_TYPE(supported_dtype(partial_grad.scalar_type()), op, ": partial_grad has dtype ",
                   checks::torch_dtype(partial_grad.scalar_type()), "; expected one of ", kDtypeNames);
  checks::dense(op, "partial_grad", partial_grad, partial_grad.device());
  const c10::ScalarType grad_dtype[] = {loss_dtype(partial_grad.scalar_type())};
  checks::scalar_tensor(op, "grad_output", grad_output, grad_dtype, partial_grad.device());
  check_num_positives_sum(op, num_positives_sum, partial_grad.device());
}

// launch -----------------------------------------------------------------------------------------

// Calls f(TypeTag<T>{}) for float32, float16, bfloat16 and float64.
template <typename F>
void dispatch(c10::ScalarType dtype, const char* op, const char* arg, F&& f) {
  if (dtype == c10::ScalarType::Double) {
    f(apex::TypeTag<double>{});
  } else {
    apex::dispatch_float_types(dtype, op, arg, f);
  }
}

// Runs launch(std::integral_constant<int, W>) with 16-byte vectors when every pointer allows.
template <typename T, typename Launch>
void with_width(std::initializer_list<const void*> pointers, Launch&& launch) {
  bool aligned = true;
  for (const void* p : pointers) aligned = aligned && apex::aligned16(p);
  constexpr int kWide = static_cast<int>(16 / sizeof(T));
  if (aligned) {
    launch(std::integral_constant<int, kWide>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

// A grid that fills the device once (the kernels loop), no larger than the work.
unsigned int grid_for(const void* kernel, int64_t work_items) {
  const int64_t full = static_cast<int64_t>(apex::sm_count()) * apex::resident_blocks(kernel, kThreads, 0);
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min(full, apex::ceil_div(work_items, kThreads))));
}

}  // namespace

namespace apex_contrib_focal_loss {

std::tuple<at::Tensor, at::Tensor> focal_loss_forward_cuda(const at::Tensor& cls_output,
                                                           const at::Tensor& cls_targets_at_level,
                                                           const at::Tensor& num_positives_sum,
                                                           int64_t num_real_classes, double alpha, double gamma,
                                                           double label_smoothing) {
  constexpr const char* kOp = "focal_loss_forward";
  check_forward(kOp, cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
                label_smoothing);
  const c10::cuda::CUDAGuard device_guard(cls_output.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor partial_grad = at::empty_like(cls_output);
  at::Tensor loss = at::empty({}, cls_output.options().dtype(loss_dtype(cls_output.scalar_type())));
  dispatch(cls_output.scalar_type(), kOp, "cls_output", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = Acc<T>;
    const Params<A> p{cls_output.numel(),           cls_output.size(-1),     num_real_classes,
                      static_cast<A>(alpha),        static_cast<A>(gamma),   static_cast<A>(label_smoothing / 2)};
    at::Tensor block_sums;
    int blocks = 0;
    if (p.numel > 0) {
      with_width<T>({cls_output.const_data_ptr(), partial_grad.const_data_ptr()}, [&](auto w) {
        constexpr int W = decltype(w)::value;
        const auto kernel = forward_kernel<T, W>;
        blocks = static_cast<int>(grid_for(reinterpret_cast<const void*>(kernel), apex::ceil_div(p.numel, W)));
        block_sums = at::empty({blocks}, loss.options());
        kernel<<<blocks, kThreads, 0, stream>>>(cls_output.const_data_ptr<T>(),
                                                cls_targets_at_level.const_data_ptr<int64_t>(),
                                                partial_grad.mutable_data_ptr<T>(), block_sums.mutable_data_ptr<A>(), p);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
    finish_kernel<A><<<1, kFinalThreads, 0, stream>>>(loss.mutable_data_ptr<A>(),
                                                       blocks ? block_sums.const_data_ptr<A>() : nullptr, blocks,
                                                       num_positives_sum.const_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {loss, partial_grad};
}

}  // namespace apex_contrib_focal_loss

namespace {

void launch_backward(const char* op, const at::Tensor& out, const at::Tensor& grad_output,
                     const at::Tensor& partial_grad, const at::Tensor& num_positives_sum) {
  const int64_t numel = partial_grad.numel();
  if (numel == 0) return;
  dispatch(partial_grad.scalar_type(), op, "partial_grad", [&](auto tag) {
    using T = typename decltype(tag)::type;
    with_width<T>({partial_grad.const_data_ptr(), out.const_data_ptr()}, [&](auto w) {
      constexpr int W = decltype(w)::value;
      const auto kernel = backward_kernel<T, W>;
      const unsigned int blocks = grid_for(reinterpret_cast<const void*>(kernel), apex::ceil_div(numel, W));
      kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          static_cast<T*>(out.data_ptr()), partial_grad.const_data_ptr<T>(), grad_output.const_data_ptr<Acc<T>>(),
          num_positives_sum.const_data_ptr<float>(), numel);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace

namespace apex_contrib_focal_loss {

at::Tensor focal_loss_backward_cuda(const at::Tensor& grad_output, const at::Tensor& partial_grad,
                                    const at::Tensor& num_positives_sum) {
  constexpr const char* kOp = "focal_loss_backward";
  check_backward(kOp, grad_output, partial_grad, num_positives_sum);
  const c10::cuda::CUDAGuard device_guard(partial_grad.device());
  at::Tensor out = at::empty_like(partial_grad);
  launch_backward(kOp, out, grad_output, partial_grad, num_positives_sum);
  return out;
}

void focal_loss_backward_inplace_cuda(const at::Tensor& partial_grad, const at::Tensor& grad_output,
                                      const at::Tensor& num_positives_sum) {
  constexpr const char* kOp = "focal_loss_backward_";
  check_backward(kOp, grad_output, partial_grad, num_positives_sum);
  const c10::cuda::CUDAGuard device_guard(partial_grad.device());
  launch_backward(kOp, partial_grad, grad_output, partial_grad, num_positives_sum);
}

}  // namespace apex_contrib_focal_loss

