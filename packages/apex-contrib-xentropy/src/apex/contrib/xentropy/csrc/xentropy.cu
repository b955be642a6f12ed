// Softmax cross entropy with label smoothing: the forward (per-row loss and logsumexp, one read of
// the logits) and the backward (the gradient rebuilt from the logits and the logsumexp, one read
// and one write). The contract and the PyTorch reference are in apex.contrib.xentropy's _ops.py;
// the checks below say the same words in the same order.
//
// Layout: a group of kGroup threads takes one row (kGroup = 32: several rows per block, for short
// rows; kGroup = kBlock: a block per row). The threads stream their row in 16-byte vectors,
// kUnroll of them in flight per thread, with a scalar head up to the first 16-byte boundary and a
// scalar tail (rows of any length and alignment). The forward keeps an online logsumexp per
// thread (a running max and a sum of exponentials rescaled when the max grows), so a row of any
// length is read once; the group then combines them. Float32 arithmetic throughout.
//
// Labels: a row whose label equals padding_idx gets loss 0, lse 0 and gradient 0 without its
// logits being read. Any other label outside [0, vocab) cannot raise here without a host sync:
// that row's loss and lse are NaN and its gradient row is NaN, and nothing is read out of bounds.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/launch.cuh>
#include <apex/reductions.cuh>
#include <apex/vectorized.cuh>

#include "cuda_ops.h"

namespace {

using apex::checks::shape_string;
using apex::checks::torch_dtype;

constexpr const char* kForward = "softmax_cross_entropy_forward";
constexpr const char* kBackward = "softmax_cross_entropy_backward";
constexpr const char* kBackwardInplace = "softmax_cross_entropy_backward_";

constexpr int kBlock = 256;
// 16-byte vectors in flight per thread in the main loop.
constexpr int kUnroll = 4;
// Rows up to this many columns take a warp each (several rows per block), longer ones a block.
constexpr int64_t kWarpRowMaxVocab = 2048;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Checks -----------------------------------------------------------------------------------------
// The same checks, in the same order and words, as _ops.py.

void check_logits(const char* op, const at::Tensor& logits) {
  TORCH_CHECK_TYPE(apex::checks::contains(apex::checks::kFloatDtypes, logits.scalar_type()), op, ": logits has dtype ",
                   torch_dtype(logits.scalar_type()), "; expected one of float32, float16, bfloat16");
  TORCH_CHECK_VALUE(logits.dim() == 2, op, ": logits must be 2-D [tokens, vocab], got shape ",
                    shape_string(logits.sizes()));
  TORCH_CHECK_VALUE(logits.size(1) > 0, op, ": logits must have at least one column (class), got shape ",
                    shape_string(logits.sizes()));
  apex::checks::rows(op, "logits", logits, logits.device());
}

void check_per_row(const char* op, const char* name, const at::Tensor& t, const at::Tensor& logits) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == logits.size(0), op, ": ", name, " has shape ",
                    shape_string(t.sizes()), "; expected (", logits.size(0), ",) for logits of shape ",
                    shape_string(logits.sizes()));
  apex::checks::dense(op, name, t, logits.device());
}

void check_labels(const char* op, const at::Tensor& labels, const at::Tensor& logits) {
  TORCH_CHECK_TYPE(labels.scalar_type() == at::kLong, op, ": labels has dtype ", torch_dtype(labels.scalar_type()),
                   "; expected torch.int64");
  check_per_row(op, "labels", labels, logits);
}

void check_smoothing(const char* op, double smoothing) {
  TORCH_CHECK_VALUE(smoothing >= 0.0 && smoothing <= 1.0, op, ": smoothing must be in [0, 1], got ", smoothing);
}

void check_backward(const char* op, const at::Tensor& grad_losses, const at::Tensor& logits, const at::Tensor& lse,
                    const at::Tensor& labels, double smoothing) {
  check_logits(op, logits);
  check_labels(op, labels, logits);
  const auto grad_dtype = grad_losses.scalar_type();
  if (logits.scalar_type() == at::kFloat) {
    TORCH_CHECK_TYPE(grad_dtype == at::kFloat, op, ": grad_losses has dtype ", torch_dtype(grad_dtype),
                     "; expected torch.float32");
  } else {
    TORCH_CHECK_TYPE(grad_dtype == at::kFloat || grad_dtype == logits.scalar_type(), op, ": grad_losses has dtype ",
                     torch_dtype(grad_dtype), "; expected torch.float32 or ", torch_dtype(logits.scalar_type()));
  }
  check_per_row(op, "grad_losses", grad_losses, logits);
  TORCH_CHECK_TYPE(lse.scalar_type() == at::kFloat, op, ": lse has dtype ", torch_dtype(lse.scalar_type()),
                   "; expected torch.float32");
  check_per_row(op, "lse", lse, logits);
  check_smoothing(op, smoothing);
}

// Device helpers ---------------------------------------------------------------------------------

// What a row's label says: an ordinary row, a padding row (nothing read, zeros written) or a bad
// label (NaN written).
enum class RowKind { kLabel, kPadding, kBadLabel };

__device__ __forceinline__ RowKind row_kind(int64_t label, int64_t vocab, bool has_padding, int64_t padding_idx) {
  if (has_padding && label == padding_idx) return RowKind::kPadding;
  return (label >= 0 && label < vocab) ? RowKind::kLabel : RowKind::kBadLabel;
}

// Visits the n elements of one row with the kGroup threads of its group (lane = the thread's
// place in it): vector_body(count, first) for `count` 16-byte vectors at elements first,
// first + kGroup * W, ... (count is std::integral_constant<int, kUnroll or 1>), and
// scalar_body(i) for single elements: those before the row's first 16-byte boundary of `anchor`
// and after its last whole vector, or every element when `vectorize` is false. The row's other
// arrays must share anchor's misalignment when vectorize is true.
template <typename T, int kGroup, typename VectorBody, typename ScalarBody>
__device__ __forceinline__ void visit_row(const T* anchor, int64_t n, int lane, bool vectorize,
                                          VectorBody&& vector_body, ScalarBody&& scalar_body) {
  constexpr int W = apex::vector_width<T>();
  int64_t head = n;
  if (vectorize) {
    const int64_t to_boundary = (W - apex::misalignment<W>(anchor)) % W;
    head = to_boundary < n ? to_boundary : n;
  }
  const int64_t vectors = (n - head) / W;
  const int64_t tail = head + vectors * W;
  for (int64_t i = lane; i < head; i += kGroup) scalar_body(i);
  constexpr int64_t kStep = int64_t{kGroup} * kUnroll;
  const int64_t whole = vectors / kStep * kStep;
  for (int64_t v = lane; v < whole; v += kStep) vector_body(std::integral_constant<int, kUnroll>{}, head + v * W);
  for (int64_t v = whole + lane; v < vectors; v += kGroup) vector_body(std::integral_constant<int, 1>{}, head + v * W);
  for (int64_t i = tail + lane; i < n; i += kGroup) scalar_body(i);
}

// Reduction over a row's group: a warp's shuffles, or the whole block.
template <int kGroup, typename Op>
__device__ __forceinline__ float group_reduce(float value, Op op, float* shared) {
  if constexpr (kGroup == apex::kWarpSize) {
    return apex::warp_reduce(value, op);
  } else {
    static_assert(kGroup == kBlock, "a group is a warp or the block");
    return apex::block_reduce(value, op, shared);
  }
}

// One thread's online logsumexp of the values it saw, in base 2 (max2 = max of x * log2(e);
// sum = sum of 2^(x * log2(e) - max2)), and the plain sum of the values (label smoothing).
struct OnlineLse {
  float max2 = -kInf;
  float sum = 0.0f;
  float total = 0.0f;

  template <int N>
  __device__ __forceinline__ void add(const float (&x)[N]) {
    float high = x[0];
#pragma unroll
    for (int j = 1; j < N; ++j) high = fmaxf(high, x[j]);
    const float high2 = high * kLog2e;
    if (high2 > max2) {  // false for NaN: a NaN reaches the sum below instead
      sum *= exp2f(max2 - high2);
      max2 = high2;
    }
    if (max2 != -kInf) {  // all -inf so far: nothing to add (and -inf - -inf would be NaN)
#pragma unroll
      for (int j = 0; j < N; ++j) sum += exp2f(fmaf(x[j], kLog2e, -max2));
    }
#pragma unroll
    for (int j = 0; j < N; ++j) total += x[j];
  }
};

// Forward ----------------------------------------------------------------------------------------

template <typename T, int kGroup>
__global__ void __launch_bounds__(kBlock) forward_kernel(const T* __restrict__ logits,
                                                         const int64_t* __restrict__ labels, void* __restrict__ losses,
                                                         bool losses_float, float* __restrict__ lse, int64_t rows,
                                                         int64_t vocab, int64_t row_stride, float smoothing,
                                                         bool has_padding, int64_t padding_idx) {
  constexpr int W = apex::vector_width<T>();
  __shared__ float shared[apex::kWarpSize];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kBlock / kGroup) + threadIdx.x / kGroup;
  const int lane = threadIdx.x % kGroup;
  if (row >= rows) return;  // whole groups: a block-wide group always has its row
  const int64_t label = labels[row];
  const RowKind kind = row_kind(label, vocab, has_padding, padding_idx);
  float loss = 0.0f;
  float row_lse = 0.0f;
  if (kind == RowKind::kLabel) {
    const T* x = logits + row * row_stride;
    OnlineLse acc;
    visit_row<T, kGroup>(
        x, vocab, lane, true,  // each row's vectors aligned by visit_row
        [&](auto count, int64_t first) {
          constexpr int C = decltype(count)::value;
          apex::AlignedVector<T, W> raw[C];
#pragma unroll
          for (int k = 0; k < C; ++k) raw[k] = apex::load_vector<T, W>(x + first + int64_t{k} * kGroup * W);
          float v[C * W];
#pragma unroll
          for (int k = 0; k < C; ++k) {
            float part[W];
            apex::to_floats(part, raw[k]);
#pragma unroll
            for (int j = 0; j < W; ++j) v[k * W + j] = part[j];
          }
          acc.add(v);
        },
        [&](int64_t i) {
          const float v[1] = {static_cast<float>(x[i])};
          acc.add(v);
        });
    const float max2 = group_reduce<kGroup>(acc.max2, apex::MaxOp{}, shared);
    const float scaled = acc.max2 == -kInf ? 0.0f : acc.sum * exp2f(acc.max2 - max2);
    const float sum = group_reduce<kGroup>(scaled, apex::SumOp{}, shared);
    const float total = group_reduce<kGroup>(acc.total, apex::SumOp{}, shared);
    row_lse = (max2 + log2f(sum)) * kLn2;
    if (lane == 0) {
      loss = row_lse - (1.0f - smoothing) * static_cast<float>(x[label]);
      if (smoothing != 0.0f) loss -= smoothing * (total / static_cast<float>(vocab));
    }
  } else if (kind == RowKind::kBadLabel) {
    loss = kNaN;
    row_lse = kNaN;
  }
  if (lane == 0) {
    lse[row] = row_lse;
    if (losses_float) {
      static_cast<float*>(losses)[row] = loss;
    } else {
      static_cast<T*>(losses)[row] = static_cast<T>(loss);
    }
  }
}

// Backward ---------------------------------------------------------------------------------------
// grad may be logits itself (the in-place op): each element is read, then written, by one thread.

template <typename T, int kGroup>
__global__ void __launch_bounds__(kBlock) backward_kernel(const void* __restrict__ grad_losses, bool grad_float,
                                                          const T* logits, const float* __restrict__ lse,
                                                          const int64_t* __restrict__ labels, T* grad, int64_t rows,
                                                          int64_t vocab, int64_t x_stride, int64_t dx_stride,
                                                          float smoothing, bool has_padding, int64_t padding_idx) {
  constexpr int W = apex::vector_width<T>();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kBlock / kGroup) + threadIdx.x / kGroup;
  const int lane = threadIdx.x % kGroup;
  if (row >= rows) return;
  const int64_t label = labels[row];
  const RowKind kind = row_kind(label, vocab, has_padding, padding_idx);
  const T* x = logits + row * x_stride;
  T* dx = grad + row * dx_stride;
  // 16-byte vectors need the row's logits and gradient at one offset from a 16-byte boundary:
  // always so in place; for a fresh gradient unless the logits' rows start elsewhere.
  const bool vectorize = (reinterpret_cast<uintptr_t>(x) - reinterpret_cast<uintptr_t>(dx)) % 16 == 0;

  if (kind != RowKind::kLabel) {  // a constant row: 0 for padding, NaN for a bad label
    const float value = kind == RowKind::kPadding ? 0.0f : kNaN;
    visit_row<T, kGroup>(
        dx, vocab, lane, true,
        [&](auto count, int64_t first) {
          constexpr int C = decltype(count)::value;
          apex::AlignedVector<T, W> fill;
#pragma unroll
          for (int j = 0; j < W; ++j) fill.val[j] = static_cast<T>(value);
#pragma unroll
          for (int k = 0; k < C; ++k) apex::store_vector(dx + first + int64_t{k} * kGroup * W, fill);
        },
        [&](int64_t i) { dx[i] = static_cast<T>(value); });
    return;
  }

  const float g = grad_float ? static_cast<const float*>(grad_losses)[row]
                             : static_cast<float>(static_cast<const T*>(grad_losses)[row]);
  const float lse2 = lse[row] * kLog2e;
  const float uniform = g * smoothing / static_cast<float>(vocab);  // subtracted everywhere
  const float picked = g * (1.0f - smoothing);                      // and at the label
  const auto element = [&](float xv, bool at_label) {
    const float v = fmaf(g, exp2f(fmaf(xv, kLog2e, -lse2)), -uniform);
    return at_label ? v - picked : v;
  };
  visit_row<T, kGroup>(
      x, vocab, lane, vectorize,
      [&](auto count, int64_t first) {
        constexpr int C = decltype(count)::value;
        apex::AlignedVector<T, W> raw[C];
#pragma unroll
        for (int k = 0; k < C; ++k) raw[k] = apex::load_vector<T, W>(x + first + int64_t{k} * kGroup * W);
#pragma unroll
        for (int k = 0; k < C; ++k) {
          const int64_t start = first + int64_t{k} * kGroup * W;
          const int64_t offset = label - start;  // the label's place in this vector, if it is there
          const int at = (offset >= 0 && offset < W) ? static_cast<int>(offset) : -1;
          float v[W];
          apex::to_floats(v, raw[k]);
          apex::AlignedVector<T, W> out;
#pragma unroll
          for (int j = 0; j < W; ++j) out.val[j] = static_cast<T>(element(v[j], j == at));
          apex::store_vector(dx + start, out);
        }
      },
      [&](int64_t i) { dx[i] = static_cast<T>(element(static_cast<float>(x[i]), i == label)); });
}

// Launch -----------------------------------------------------------------------------------------

template <int kGroup>
unsigned int blocks_for(int64_t rows) {
  return static_cast<unsigned int>(apex::ceil_div(rows, kBlock / kGroup));
}

}  // namespace

namespace apex_contrib_xentropy {

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& logits, const at::Tensor& labels, double smoothing,
                                                std::optional<int64_t> padding_idx, bool half_to_float) {
  check_logits(kForward, logits);
  check_labels(kForward, labels, logits);
  check_smoothing(kForward, smoothing);

  const c10::cuda::CUDAGuard device_guard(logits.device());
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  const auto losses_dtype = half_to_float ? at::kFloat : logits.scalar_type();
  at::Tensor losses = at::empty({rows}, logits.options().dtype(losses_dtype));
  at::Tensor lse = at::empty({rows}, logits.options().dtype(at::kFloat));
  if (rows == 0) return {losses, lse};
  const auto stream = at::cuda::getCurrentCUDAStream();
  APEX_DISPATCH_FLOAT_TYPES(logits.scalar_type(), kForward, "logits", scalar_t, {
    const auto launch = [&](auto kernel, unsigned int blocks) {
      kernel<<<blocks, kBlock, 0, stream>>>(logits.const_data_ptr<scalar_t>(), labels.const_data_ptr<int64_t>(),
                                            losses.mutable_data_ptr(), losses_dtype == at::kFloat,
                                            lse.mutable_data_ptr<float>(), rows, vocab, logits.stride(0),
                                            static_cast<float>(smoothing), padding_idx.has_value(),
                                            padding_idx.value_or(0));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (vocab <= kWarpRowMaxVocab) {
      launch(forward_kernel<scalar_t, apex::kWarpSize>, blocks_for<apex::kWarpSize>(rows));
    } else {
      launch(forward_kernel<scalar_t, kBlock>, blocks_for<kBlock>(rows));
    }
  });
  return {losses, lse};
}

}  // namespace apex_contrib_xentropy

namespace {

void backward_into(const char* op, const at::Tensor& grad_losses, const at::Tensor& logits, const at::Tensor& lse,
                   const at::Tensor& labels, double smoothing, std::optional<int64_t> padding_idx, at::Tensor& grad) {
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  if (rows == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  APEX_DISPATCH_FLOAT_TYPES(logits.scalar_type(), op, "logits", scalar_t, {
    const auto launch = [&](auto kernel, unsigned int blocks) {
      kernel<<<blocks, kBlock, 0, stream>>>(grad_losses.const_data_ptr(), grad_losses.scalar_type() == at::kFloat,
                                            logits.const_data_ptr<scalar_t>(), lse.const_data_ptr<float>(),
                                            labels.const_data_ptr<int64_t>(), grad.mutable_data_ptr<scalar_t>(), rows,
                                            vocab, logits.stride(0), grad.stride(0), static_cast<float>(smoothing),
                                            padding_idx.has_value(), padding_idx.value_or(0));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (vocab <= kWarpRowMaxVocab) {
      launch(backward_kernel<scalar_t, apex::kWarpSize>, blocks_for<apex::kWarpSize>(rows));
    } else {
      launch(backward_kernel<scalar_t, kBlock>, blocks_for<kBlock>(rows));
    }
  });
}

}  // namespace

namespace apex_contrib_xentropy {

at::Tensor backward_cuda(const at::Tensor& grad_losses, const at::Tensor& logits, const at::Tensor& lse,
                         const at::Tensor& labels, double smoothing, std::optional<int64_t> padding_idx) {
  check_backward(kBackward, grad_losses, logits, lse, labels, smoothing);
  const c10::cuda::CUDAGuard device_guard(logits.device());
  at::Tensor grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
  backward_into(kBackward, grad_losses, logits, lse, labels, smoothing, padding_idx, grad);
  return grad;
}

void backward_inplace_cuda(const at::Tensor& grad_losses, at::Tensor& logits, const at::Tensor& lse,
                           const at::Tensor& labels, double smoothing, std::optional<int64_t> padding_idx) {
  check_backward(kBackwardInplace, grad_losses, logits, lse, labels, smoothing);
  const c10::cuda::CUDAGuard device_guard(logits.device());
  backward_into(kBackwardInplace, grad_losses, logits, lse, labels, smoothing, padding_idx, logits);
}

}  // namespace apex_contrib_xentropy

