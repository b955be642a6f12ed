// scaled_softmax_backward and scaled_softmax_backward_ (in place into grad_output, as upstream's
// modules do): dx = scale * y * (dy - sum(dy * y)) over the last dimension, fp32 math, reading y
// and dy once. Causal: only the elements j <= i of row i are read (the rest of y is zero in a
// causal softmax output); the others are written as 0. Kernel shapes: softmax_common.cuh.

#include "softmax_common.cuh"
#include "cuda_ops.h"

namespace apex_transformer::softmax {
namespace {

template <typename T>
struct BackwardParams {
  T* grad_input;  // grad_output itself when in place
  const T* grad_output;
  const T* output;
  int64_t rows;
  int64_t sk;
  int64_t sq;
  float scale;
  int group;
};

template <bool kCausal, typename T>
__device__ __forceinline__ int64_t row_length(const BackwardParams<T>& p, int64_t row) {
  if constexpr (kCausal) {
    return row % p.sq + 1;
  } else {
    return p.sk;
  }
}

// dx of V elements at column col (0 past the row's readable length).
template <bool kCausal, int V, typename T>
__device__ __forceinline__ void grad_elements(float (&dx)[V], const AlignedVector<T, V>& y_raw,
                                              const AlignedVector<T, V>& dy_raw, int64_t col, int64_t len,
                                              float dot, float scale) {
  float y[V], dy[V];
  apex::to_floats(y, y_raw);
  apex::to_floats(dy, dy_raw);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    dx[j] = kCausal && col + j >= len ? 0.0f : scale * y[j] * (dy[j] - dot);
  }
}

template <bool kCausal, int V, typename T>
__device__ __forceinline__ float dot_elements(const AlignedVector<T, V>& y_raw, const AlignedVector<T, V>& dy_raw,
                                              int64_t col, int64_t len) {
  float y[V], dy[V];
  apex::to_floats(y, y_raw);
  apex::to_floats(dy, dy_raw);
  float dot = 0.0f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (!kCausal || col + j < len) dot = fmaf(y[j], dy[j], dot);
  }
  return dot;
}

// One row per group of p.group threads; y and dy held in registers in their storage type.
template <typename T, int V, bool kCausal>
__global__ void __launch_bounds__(kMaxGroup)
    backward_in_registers(const BackwardParams<T> p) {
  __shared__ float shared[32];
  const int group = p.group;
  const int lane = threadIdx.x & (group - 1);
  const int rows_per_block = blockDim.x / group;
  const int64_t row_groups = apex::ceil_div(p.rows, rows_per_block);
  for (int64_t g = blockIdx.x; g < row_groups; g += gridDim.x) {
    const int64_t row = g * rows_per_block + threadIdx.x / group;
    const bool active = row < p.rows;
    const int64_t len = active ? row_length<kCausal>(p, row) : 0;
    const T* y = p.output + row * p.sk;
    const T* dy = p.grad_output + row * p.sk;
    AlignedVector<T, V> y_raw[kVecs], dy_raw[kVecs];
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int64_t col = static_cast<int64_t>(lane + k * group) * V;
      if (col < len) {
        y_raw[k] = *reinterpret_cast<const AlignedVector<T, V>*>(y + col);
        dy_raw[k] = *reinterpret_cast<const AlignedVector<T, V>*>(dy + col);
      }
    }
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int64_t col = static_cast<int64_t>(lane + k * group) * V;
      if (col < len) dot += dot_elements<kCausal, V>(y_raw[k], dy_raw[k], col, len);
    }
    dot = group_reduce1(dot, group, shared, Sum{});
    if (!active) continue;
    T* dx = p.grad_input + row * p.sk;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int64_t col = static_cast<int64_t>(lane + k * group) * V;
      if (col < p.sk) {
        float out[V];
        if (col < len) {
          grad_elements<kCausal, V>(out, y_raw[k], dy_raw[k], col, len, dot, p.scale);
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) out[j] = 0.0f;
        }
        store_elements<V>(dx + col, out);
      }
    }
  }
}

// One row per block of kMaxGroup threads, for rows longer than the registers hold: the dot
// product in one pass, then a second pass over y and dy writes dx.
template <typename T, int V, bool kCausal>
__global__ void __launch_bounds__(kStreamBlock) backward_streaming(const BackwardParams<T> p) {
  __shared__ float shared[32];
  const int64_t step = static_cast<int64_t>(blockDim.x) * V;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t len = row_length<kCausal>(p, row);
    const T* y = p.output + row * p.sk;
    const T* dy = p.grad_output + row * p.sk;
    float dot = 0.0f;
    for (int64_t col = threadIdx.x * V; col < len; col += step) {
      const auto yv = apex::load_vector_whole<T, V>(y + col);
      dot += dot_elements<kCausal, V>(yv, apex::load_vector_whole<T, V>(dy + col), col, len);
    }
    dot = group_reduce1(dot, blockDim.x, shared, Sum{});
    T* dx = p.grad_input + row * p.sk;
    for (int64_t col = threadIdx.x * V; col < p.sk; col += step) {
      float out[V];
      if (col < len) {
        const auto yv = apex::load_vector_whole<T, V>(y + col);
        const auto dyv = apex::load_vector_whole<T, V>(dy + col);
        grad_elements<kCausal, V>(out, yv, dyv, col, len, dot, p.scale);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) out[j] = 0.0f;
      }
      store_elements<V>(dx + col, out);
    }
  }
}

template <typename T, int V, bool kCausal>
void launch_width(const BackwardParams<T>& p, const Plan& plan, cudaStream_t stream) {
  if (plan.streaming) {
    backward_streaming<T, V, kCausal><<<grid_for(p.rows), kStreamBlock, 0, stream>>>(p);
  } else {
    const int64_t row_groups = apex::ceil_div(p.rows, plan.block / plan.group);
    backward_in_registers<T, V, kCausal><<<grid_for(row_groups), plan.block, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, bool kCausal>
void launch_backward(const BackwardParams<T>& p, const Plan& plan) {
  constexpr int kWidth = 16 / sizeof(T);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (plan.vectorized) {
    launch_width<T, kWidth, kCausal>(p, plan, stream);
  } else {
    launch_width<T, 1, kCausal>(p, plan, stream);
  }
}

void backward_into(const char* op, const at::Tensor& grad_input, const at::Tensor& grad_output,
                   const at::Tensor& output, double scale, bool causal) {
  if (output.numel() == 0) return;
  const int64_t sk = output.size(-1);
  APEX_DISPATCH_FLOAT_TYPES(output.scalar_type(), op, "output", T, {
    constexpr int kWidth = 16 / sizeof(T);
    BackwardParams<T> p{};
    p.grad_input = static_cast<T*>(grad_input.data_ptr());
    p.grad_output = static_cast<const T*>(grad_output.const_data_ptr());
    p.output = static_cast<const T*>(output.const_data_ptr());
    p.rows = output.numel() / sk;
    p.sk = sk;
    p.sq = output.size(-2);
    p.scale = static_cast<float>(scale);
    const bool aligned =
        apex::aligned16(p.grad_input) && apex::aligned16(p.grad_output) && apex::aligned16(p.output);
    const Plan pl = plan(sk, kWidth, aligned);
    p.group = pl.group;
    if (causal) {
      launch_backward<T, true>(p, pl);
    } else {
      launch_backward<T, false>(p, pl);
    }
  });
}

}  // namespace

at::Tensor scaled_softmax_backward_cuda(const at::Tensor& grad_output, const at::Tensor& output, double scale,
                                        bool causal) {
  const char* op = "scaled_softmax_backward";
  check_backward(op, grad_output, output, causal);
  const c10::cuda::CUDAGuard device_guard(output.device());
  at::Tensor grad_input = at::empty(output.sizes(), output.options());
  backward_into(op, grad_input, grad_output, output, scale, causal);
  return grad_input;
}

void scaled_softmax_backward_inplace_cuda(const at::Tensor& grad_output, const at::Tensor& output, double scale,
                                          bool causal) {
  const char* op = "scaled_softmax_backward_";
  check_backward(op, grad_output, output, causal);
  const c10::cuda::CUDAGuard device_guard(output.device());
  backward_into(op, grad_output, grad_output, output, scale, causal);
}

}  // namespace apex_transformer::softmax

