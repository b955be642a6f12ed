// What the two translation units of norm_backward share: the checked arguments, the kernel
// parameters, the per-element math, and the host entry points of each unit.
//
// Math (see _reference.norm_backward): with xhat the normalized input and wdy = weight * dy,
//   dx = rstd * (wdy - xhat * sum(wdy * xhat) / hidden - sum(wdy) / hidden)    (RMS: no last term)
// xhat = (x - mean) * rstd from the saved input, or (y - bias) / weight from the saved output
// (memory_efficient). Weight and bias gradients are sums over rows of dy * xhat and dy: each
// block adds up its rows into one row of a float32 partial buffer, and sum_partials adds the
// partial rows in a fixed order, so the result is the same on every run (no atomics).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "norm_common.cuh"

namespace apex_normalization {

struct BackwardArgs {
  const at::Tensor* grad_output;
  const at::Tensor* saved;
  const at::Tensor* weight;         // may be null
  const at::Tensor* bias;           // may be null
  const at::Tensor* mean;           // null unless layer norm from the saved input
  const at::Tensor* rstd;
  const at::Tensor* grad_residual;  // may be null
  at::Tensor* grad_input;
  at::Tensor* grad_weight;  // null when not computed
  at::Tensor* grad_bias;    // null when not computed
  int64_t rows;
  int64_t hidden;
  bool rms;
  bool memory_efficient;
};

template <typename T, typename W, typename O, typename S>
struct BackwardParams {
  const O* grad_output;
  const S* saved;
  const W* weight;
  const W* bias;
  const float* mean;
  const float* rstd;
  const T* grad_residual;
  T* grad_input;
  float* partial_weight;  // [parts, hidden], null without weight gradients
  float* partial_bias;    // [parts, hidden], null without a bias gradient
  W* grad_weight;         // backward_in_registers launched cooperatively: sums the partials itself
  W* grad_bias;           // into these (null otherwise: sum_partials does)
  int64_t rows;
  int64_t hidden;
  bool rms;
  bool memory_efficient;
  int group_threads;
};

template <typename T, typename W, typename O, typename S>
BackwardParams<T, W, O, S> backward_params(const BackwardArgs& a) {
  BackwardParams<T, W, O, S> p{};
  p.grad_output = static_cast<const O*>(a.grad_output->const_data_ptr());
  p.saved = static_cast<const S*>(a.saved->const_data_ptr());
  p.weight = a.weight != nullptr ? static_cast<const W*>(a.weight->const_data_ptr()) : nullptr;
  p.bias = a.bias != nullptr ? static_cast<const W*>(a.bias->const_data_ptr()) : nullptr;
  p.mean = a.mean != nullptr ? a.mean->const_data_ptr<float>() : nullptr;
  p.rstd = a.rstd->const_data_ptr<float>();
  p.grad_residual = a.grad_residual != nullptr ? static_cast<const T*>(a.grad_residual->const_data_ptr()) : nullptr;
  p.grad_input = static_cast<T*>(a.grad_input->data_ptr());
  p.rows = a.rows;
  p.hidden = a.hidden;
  p.rms = a.rms;
  p.memory_efficient = a.memory_efficient;
  return p;
}

template <typename F>
void dispatch_backward_types(const BackwardArgs& a, F&& f) {
  const auto input = a.grad_input->scalar_type();
  const auto weight = a.weight != nullptr ? a.weight->scalar_type() : input;
  dispatch_norm_types("norm_backward", input, weight, a.grad_output->scalar_type(), a.saved->scalar_type(),
                      std::forward<F>(f));
}

// xhat and wdy of N elements at column `col` of a row; xhat holds the saved values on entry, w the
// weight of these columns (read only when has_weight). kFma: xhat = x * rstd - mean * rstd, one
// operation per element rather than two; its error is an ulp of mean * rstd, below what 16-bit
// values carry, but not of float32 values (rows with a large mean), which keep (x - mean) * rstd.
template <int N, typename W, bool kFma = false>
__device__ __forceinline__ void xhat_and_wdy(float (&xhat)[N], float (&wdy)[N], const float (&dy)[N], bool has_weight,
                                             const float (&w)[N], const W* bias, bool memory_efficient, int col,
                                             float mean, float rstd) {
#pragma unroll
  for (int j = 0; j < N; ++j) wdy[j] = has_weight ? dy[j] * w[j] : dy[j];
  if (memory_efficient) {
    if (bias != nullptr) {
      float b[N];
      load_floats(b, bias + col);
#pragma unroll
      for (int j = 0; j < N; ++j) xhat[j] -= b[j];
    }
    if (has_weight) {
#pragma unroll
      for (int j = 0; j < N; ++j) xhat[j] /= w[j];
    }
  } else {
    if constexpr (kFma) {
      const float shift = -mean * rstd;
#pragma unroll
      for (int j = 0; j < N; ++j) xhat[j] = fmaf(xhat[j], rstd, shift);
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) xhat[j] = (xhat[j] - mean) * rstd;
    }
  }
}

// norm_backward_streaming.cu: any hidden size and alignment; grad_input, then the weight
// gradients (if asked for) from a column pass over the saved values and dy.
void backward_streaming(const BackwardArgs& a);

// norm_backward.cu: grad_weight (and grad_bias) = the column sums of the partial rows.
void sum_partials(const at::Tensor& partial_weight, const at::Tensor* partial_bias, at::Tensor& grad_weight,
                  at::Tensor* grad_bias);

}  // namespace apex_normalization
