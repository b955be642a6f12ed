// Shared by the transducer kernels: dtype dispatch (float64 included, as upstream), the argument
// checks of _ops.py in the same words, and small vector and math helpers.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/vectorized.cuh>

namespace transducer {

// float32 arithmetic for float32/float16/bfloat16, float64 for float64.
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename F>
decltype(auto) dispatch(c10::ScalarType dtype, const char* op, const char* arg, F&& f) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return f(apex::TypeTag<float>{});
    case c10::ScalarType::Half:
      return f(apex::TypeTag<c10::Half>{});
    case c10::ScalarType::BFloat16:
      return f(apex::TypeTag<c10::BFloat16>{});
    case c10::ScalarType::Double:
      return f(apex::TypeTag<double>{});
    default:
      TORCH_CHECK_TYPE(false, op, ": ", arg, " has dtype ", apex::checks::torch_dtype(dtype),
                       "; expected one of float32, float16, bfloat16, float64");
  }
}

inline c10::ScalarType compute_dtype(c10::ScalarType dtype) {
  return dtype == c10::ScalarType::Double ? c10::ScalarType::Double : c10::ScalarType::Float;
}

// checks (the same, in the same order and words, as _ops.py) -----------------------------------

inline bool is_float(c10::ScalarType dtype) {
  return dtype == c10::ScalarType::Float || dtype == c10::ScalarType::Half || dtype == c10::ScalarType::BFloat16 ||
         dtype == c10::ScalarType::Double;
}

inline void float_tensor(const char* op, const char* name, const at::Tensor& t, c10::Device device) {
  TORCH_CHECK_TYPE(is_float(t.scalar_type()), op, ": ", name, " has dtype ", apex::checks::torch_dtype(t.scalar_type()),
                   "; expected one of float32, float16, bfloat16, float64");
  apex::checks::dense(op, name, t, device);
}

inline void dims(const char* op, const char* name, const at::Tensor& t, int64_t n, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == n, op, ": ", name, " must be ", n, "-D ", layout, ", got shape ",
                    apex::checks::shape_string(t.sizes()));
}

inline void index_tensor(const char* op, const char* name, const at::Tensor& t, c10::ScalarType dtype,
                         c10::IntArrayRef shape, c10::Device device) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": ", name, " has dtype ", apex::checks::torch_dtype(t.scalar_type()),
                   "; expected ", apex::checks::torch_dtype(dtype));
  TORCH_CHECK_VALUE(t.sizes() == shape, op, ": ", name, " has shape ", apex::checks::shape_string(t.sizes()),
                    "; expected ", apex::checks::shape_string(shape));
  apex::checks::dense(op, name, t, device);
}

inline void lengths(const char* op, const char* first, const at::Tensor& a, const char* second, const at::Tensor& b,
                    const std::optional<at::Tensor>& batch_offset, int64_t batch, c10::Device device) {
  index_tensor(op, first, a, c10::ScalarType::Int, {batch}, device);
  index_tensor(op, second, b, c10::ScalarType::Int, {batch}, device);
  if (batch_offset.has_value()) index_tensor(op, "batch_offset", *batch_offset, c10::ScalarType::Long, {batch}, device);
}

inline void non_negative(const char* op, const char* name, int64_t value) {
  TORCH_CHECK_VALUE(value >= 0, op, ": ", name, " must be >= 0, got ", value);
}

// device helpers ---------------------------------------------------------------------------------

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// N elements from p (aligned to N elements) as acc values.
template <int N, typename T, typename A>
__device__ __forceinline__ void load_acc(A (&dst)[N], const T* p) {
  const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int j = 0; j < N; ++j) dst[j] = static_cast<A>(v.v[j]);
}

// N acc values to p (aligned to N elements) as T. Whole 16-byte pieces go through apex::store_vector
// (one 16-byte store instruction each; kStreaming adds its streaming cache hint): nvcc 13.0 compiled
// the struct assignment of a Vec<Half, 8>, and also a store of it as uint4, into four 4-byte stores
// (STG.E), which held the joint forward, a pure write stream, at 65% of the copy rate.
template <int N, bool kStreaming = false, typename T, typename A>
__device__ __forceinline__ void store_acc(T* p, const A (&src)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int j = 0; j < N; ++j) v.v[j] = static_cast<T>(src[j]);
  if constexpr (sizeof(v) % 16 == 0) {
    apex::store_vector<T, N, kStreaming>(p, reinterpret_cast<const apex::AlignedVector<T, N>&>(v));
  } else {
    *reinterpret_cast<Vec<T, N>*>(p) = v;
  }
}

__device__ __forceinline__ int64_t clamp64(int64_t v, int64_t low, int64_t high) {
  return v < low ? low : (v > high ? high : v);
}

template <typename A>
__device__ __forceinline__ A neg_inf() {
  return -std::numeric_limits<A>::infinity();
}

// log(exp(a) + exp(b)), -inf when both are.
template <typename A>
__device__ __forceinline__ A log_add_exp(A a, A b) {
  const A hi = a > b ? a : b;
  const A lo = a > b ? b : a;
  if (hi == neg_inf<A>()) return hi;
  return hi + log1p(exp(lo - hi));
}

}  // namespace transducer
