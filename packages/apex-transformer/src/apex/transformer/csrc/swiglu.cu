// SwiGLU (swiglu, swiglu_backward): the math and the argument conventions are in _swiglu_ops.py; the
// checks here say the same words as its checks.
//
// The input is rows of 2n elements, the gate half then the up half. An item is V consecutive
// columns of one row's halves (V elements make 16 bytes when n is a multiple of V and the tensors are
// 16-byte aligned; V = 1 otherwise): the forward reads the gate and up vectors and writes one output
// vector, the backward reads the output gradient's vector and both halves and writes both halves'
// gradients. Threads take items in a grid-stride loop, kItems of them per step with every load in
// flight before the first use. Memory traffic is the minimum: 3 n elements a row forward, 5 n backward.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/launch.cuh>
#include <apex/vectorized.cuh>

#include "cuda_ops.h"

namespace apex_transformer {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 2;  // items a thread has in flight: 2 x 16 bytes per array

C10_DEVICE C10_ALWAYS_INLINE float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// V floats to p as T: 16-byte vectors with the streaming hint (nothing reads the results back from
// L2 in this kernel, and they are larger than it), single elements plainly.
template <int V, typename T>
C10_DEVICE C10_ALWAYS_INLINE void store(T* p, const float (&src)[V]) {
  if constexpr (sizeof(T) * V % 16 == 0) {
    apex::AlignedVector<T, V> v;
#pragma unroll
    for (int j = 0; j < V; ++j) v.val[j] = static_cast<T>(src[j]);
    apex::store_vector<T, V, /*kStreaming=*/true>(p, v);
  } else {
    apex::store_floats<V>(p, src);
  }
}

// Item `item` of rows of `half` / V items: (row, column) -> element offsets.
struct Items {
  int64_t per_row;  // half / V
  int64_t half;
  int V;
  C10_DEVICE C10_ALWAYS_INLINE void locate(int64_t item, int64_t& in, int64_t& out) const {
    const int64_t row = item / per_row;
    const int64_t column = (item - row * per_row) * V;
    in = row * 2 * half + column;
    out = row * half + column;
  }
};

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) swiglu_forward_kernel(const T* __restrict__ input, T* __restrict__ output,
                                                                   Items items, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads * kItems;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads * kItems + threadIdx.x; base < count;
       base += stride) {
    float gate[kItems][V], up[kItems][V];
    int64_t in[kItems], out[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t item = base + k * kThreads;
      if (item < count) {
        items.locate(item, in[k], out[k]);
        apex::load_floats<V>(gate[k], input + in[k]);
        apex::load_floats<V>(up[k], input + in[k] + items.half);
      }
    }
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      if (base + k * kThreads < count) {
        float result[V];
#pragma unroll
        for (int j = 0; j < V; ++j) result[j] = gate[k][j] * sigmoid(gate[k][j]) * up[k][j];
        store<V>(output + out[k], result);
      }
    }
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const T* __restrict__ grad_output, const T* __restrict__ input, T* __restrict__ grad_input,
                           Items items, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads * kItems;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads * kItems + threadIdx.x; base < count;
       base += stride) {
    float grad[kItems][V], gate[kItems][V], up[kItems][V];
    int64_t in[kItems], out[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t item = base + k * kThreads;
      if (item < count) {
        items.locate(item, in[k], out[k]);
        apex::load_floats<V>(grad[k], grad_output + out[k]);
        apex::load_floats<V>(gate[k], input + in[k]);
        apex::load_floats<V>(up[k], input + in[k] + items.half);
      }
    }
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      if (base + k * kThreads < count) {
        float d_gate[V], d_up[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float g = gate[k][j];
          const float s = sigmoid(g);
          d_up[j] = grad[k][j] * g * s;
          d_gate[j] = grad[k][j] * up[k][j] * s * (1.0f + g * (1.0f - s));
        }
        store<V>(grad_input + in[k], d_gate);
        store<V>(grad_input + in[k] + items.half, d_up);
      }
    }
  }
}

// ---------------------------------------------------------------- checks (as _swiglu_ops.py words them)

int64_t check_input(const char* op, const at::Tensor& input) {
  const auto dtype = input.scalar_type();
  if (dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16) apex::unsupported_float_dtype(dtype, op, "input");
  TORCH_CHECK_VALUE(input.dim() > 0 && input.size(-1) % 2 == 0, op,
                    ": input's last dimension must be even (gate and up halves), got shape ",
                    apex::checks::shape_string(input.sizes()));
  apex::checks::dense(op, "input", input, input.device());
  return input.size(-1) / 2;
}

// Launches kernel<T, V> over rows x half columns: V = 16 bytes' worth when every pointer and the half
// width allow it, 1 otherwise.
template <typename T, typename Launch>
void launch(int64_t rows, int64_t half, bool aligned, Launch&& run) {
  constexpr int kVector = apex::vector_width<T>();
  const bool vectorized = aligned && half % kVector == 0;
  const int V = vectorized ? kVector : 1;
  const Items items{half / V, half, V};
  const int64_t count = rows * (half / V);
  if (count == 0) return;
  const int64_t wanted = apex::ceil_div(count, int64_t{kThreads} * kItems);
  const int blocks = static_cast<int>(std::min<int64_t>(wanted, int64_t{apex::sm_count()} * 8));
  if (vectorized) {
    run(std::integral_constant<int, kVector>{}, items, count, blocks);
  } else {
    run(std::integral_constant<int, 1>{}, items, count, blocks);
  }
}

}  // namespace

at::Tensor swiglu_cuda(const at::Tensor& input) {
  const char* op = "swiglu";
  const int64_t half = check_input(op, input);
  const c10::cuda::CUDAGuard guard(input.device());
  auto sizes = input.sizes().vec();
  sizes.back() = half;
  at::Tensor output = at::empty(sizes, input.options());
  const int64_t rows = half == 0 ? 0 : output.numel() / half;
  APEX_DISPATCH_FLOAT_TYPES(input.scalar_type(), op, "input", T, {
    const T* in = input.const_data_ptr<T>();
    T* out = output.mutable_data_ptr<T>();
    const bool aligned = apex::aligned16(in) && apex::aligned16(out);
    launch<T>(rows, half, aligned, [&](auto vector, const Items& items, int64_t count, int blocks) {
      constexpr int V = decltype(vector)::value;
      swiglu_forward_kernel<T, V>
          <<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(in, out, items, count);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return output;
}

at::Tensor swiglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input) {
  const char* op = "swiglu_backward";
  const int64_t half = check_input(op, input);
  TORCH_CHECK_TYPE(grad_output.scalar_type() == input.scalar_type(), op, ": grad_output has dtype ",
                   apex::checks::torch_dtype(grad_output.scalar_type()), " but input has ",
                   apex::checks::torch_dtype(input.scalar_type()));
  auto expected = input.sizes().vec();
  expected.back() = half;
  TORCH_CHECK_VALUE(grad_output.sizes() == c10::IntArrayRef(expected), op, ": grad_output has shape ",
                    apex::checks::shape_string(grad_output.sizes()), ", expected ",
                    apex::checks::shape_string(expected), " (input's, halved)");
  apex::checks::dense(op, "grad_output", grad_output, input.device());
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor grad_input = at::empty_like(input);
  const int64_t rows = half == 0 ? 0 : grad_output.numel() / half;
  APEX_DISPATCH_FLOAT_TYPES(input.scalar_type(), op, "input", T, {
    const T* dy = grad_output.const_data_ptr<T>();
    const T* in = input.const_data_ptr<T>();
    T* dx = grad_input.mutable_data_ptr<T>();
    const bool aligned = apex::aligned16(dy) && apex::aligned16(in) && apex::aligned16(dx);
    launch<T>(rows, half, aligned, [&](auto vector, const Items& items, int64_t count, int blocks) {
      constexpr int V = decltype(vector)::value;
      swiglu_backward_kernel<T, V>
          <<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(dy, in, dx, items, count);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return grad_input;
}

}  // namespace apex_transformer

