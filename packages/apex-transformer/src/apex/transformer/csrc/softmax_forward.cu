// scaled_softmax_forward: y = softmax(scale * x, masked) over the last dimension, fp32 math.
// Masking: none; causal (element j of row i of each [sq, sk] matrix is excluded when j > i, and
// those elements are neither read nor exponentiated, only written as 0); or a padding mask of
// shape [b or 1, 1, sq, sk] (nonzero = masked: score -10000, upstream's; a row with every
// element masked gives 0). Kernel shapes: softmax_common.cuh.
#include <torch/library.h>

#include <cmath>

#include "softmax_common.cuh"

namespace apex_transformer::softmax {
namespace {

template <typename T>
struct ForwardParams {
  const T* input;
  const uint8_t* mask;  // padding masking only
  T* output;
  int64_t rows;
  int64_t sk;
  int64_t sq;          // rows of one [sq, sk] matrix: a row's query index is row % sq
  int64_t batch_rows;  // np * sq, the input rows of one batch index; 0 when one mask serves the batch
  float scale;         // scale * log2(e): scores are kept in base-2 units, for exp2
  int group;           // threads per row
};

template <Masking kMasking, typename T>
__device__ __forceinline__ const uint8_t* mask_row(const ForwardParams<T>& p, int64_t row) {
  if constexpr (kMasking != Masking::kPadding) {
    return nullptr;
  } else {
    const int64_t batch = p.batch_rows == 0 ? 0 : row / p.batch_rows;
    return p.mask + (batch * p.sq + row % p.sq) * p.sk;
  }
}

// The readable length of a row: causal rows end at the diagonal.
template <Masking kMasking, typename T>
__device__ __forceinline__ int64_t row_length(const ForwardParams<T>& p, int64_t row) {
  if constexpr (kMasking == Masking::kCausal) {
    return row % p.sq + 1;
  } else {
    return p.sk;
  }
}

// Scores (base 2) of the V elements at column col from their loaded values and mask bytes;
// `unmasked` is set when a padding-masked element is not masked.
template <Masking kMasking, int V, typename T>
__device__ __forceinline__ void scores(float (&s)[V], const AlignedVector<T, V>& x,
                                       const AlignedVector<uint8_t, V>& mask, int64_t col, int64_t len, float scale,
                                       bool& unmasked) {
  apex::to_floats(s, x);
#pragma unroll
  for (int j = 0; j < V; ++j) s[j] *= scale;
  if constexpr (kMasking == Masking::kCausal) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (col + j >= len) s[j] = -INFINITY;
    }
  } else if constexpr (kMasking == Masking::kPadding) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (mask.val[j] != 0) {
        s[j] = kMaskedScore * kLog2e;
      } else {
        unmasked = true;
      }
    }
  }
}

// One row per group of p.group threads, held in registers: kVecs vectors of V elements a thread.
template <typename T, int V, Masking kMasking>
__global__ void __launch_bounds__(kMaxGroup)
    forward_in_registers(const ForwardParams<T> p) {
  __shared__ float shared[64];
  constexpr bool kPadding = kMasking == Masking::kPadding;
  const int group = p.group;
  const int lane = threadIdx.x & (group - 1);
  const int rows_per_block = blockDim.x / group;
  const int64_t row_groups = apex::ceil_div(p.rows, rows_per_block);
  for (int64_t g = blockIdx.x; g < row_groups; g += gridDim.x) {
    const int64_t row = g * rows_per_block + threadIdx.x / group;
    const bool active = row < p.rows;
    const int64_t len = active ? row_length<kMasking>(p, row) : 0;
    const T* x = p.input + row * p.sk;
    const uint8_t* m = active ? mask_row<kMasking>(p, row) : nullptr;

    // Every load in flight before the first use.
    AlignedVector<T, V> raw[kVecs];
    AlignedVector<uint8_t, V> raw_mask[kPadding ? kVecs : 1];
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int64_t col = static_cast<int64_t>(lane + k * group) * V;
      if (col < len) {
        raw[k] = *reinterpret_cast<const AlignedVector<T, V>*>(x + col);
        if constexpr (kPadding) raw_mask[k] = *reinterpret_cast<const AlignedVector<uint8_t, V>*>(m + col);
      }
    }
    float s[kVecs][V];
    float stats[2] = {-INFINITY, 0.0f};  // the row's max score; whether any element is unmasked
    bool unmasked = false;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int64_t col = static_cast<int64_t>(lane + k * group) * V;
      if (col < len) {
        scores<kMasking, V>(s[k], raw[k], raw_mask[kPadding ? k : 0], col, len, p.scale, unmasked);
#pragma unroll
        for (int j = 0; j < V; ++j) stats[0] = fmaxf(stats[0], s[k][j]);
      }
    }
    if constexpr (kPadding) {
      stats[1] = unmasked ? 1.0f : 0.0f;
      group_reduce<2>(stats, group, shared, Max{});
    } else {
      stats[0] = group_reduce1(stats[0], group, shared, Max{});
    }
    const float row_max = stats[0];
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int64_t col = static_cast<int64_t>(lane + k * group) * V;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        s[k][j] = col < len ? exp2f(s[k][j] - row_max) : 0.0f;
        sum += s[k][j];
      }
    }
    sum = group_reduce1(sum, group, shared, Sum{});
    const float inv = kPadding && stats[1] == 0.0f ? 0.0f : 1.0f / sum;
    if (!active) continue;
    T* y = p.output + row * p.sk;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int64_t col = static_cast<int64_t>(lane + k * group) * V;
      if (col < p.sk) {
        float out[V];
#pragma unroll
        for (int j = 0; j < V; ++j) out[j] = s[k][j] * inv;
        store_elements<V>(y + col, out);
      }
    }
  }
}

// One row per block of kMaxGroup threads, for rows longer than the registers hold: the max and
// sum in one online pass, then a second pass over the row writes the output.
template <typename T, int V, Masking kMasking>
__global__ void __launch_bounds__(kStreamBlock) forward_streaming(const ForwardParams<T> p) {
  __shared__ float shared[64];
  constexpr bool kPadding = kMasking == Masking::kPadding;
  const int64_t step = static_cast<int64_t>(blockDim.x) * V;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t len = row_length<kMasking>(p, row);
    const T* x = p.input + row * p.sk;
    const uint8_t* m = mask_row<kMasking>(p, row);
    AlignedVector<uint8_t, V> no_mask{};
    float run_max = -INFINITY;
    float run_sum = 0.0f;
    bool unmasked = false;
    for (int64_t col = threadIdx.x * V; col < len; col += step) {
      float s[V];
      const auto raw = *reinterpret_cast<const AlignedVector<T, V>*>(x + col);
      const auto raw_mask = kPadding ? *reinterpret_cast<const AlignedVector<uint8_t, V>*>(m + col) : no_mask;
      scores<kMasking, V>(s, raw, raw_mask, col, len, p.scale, unmasked);
      float vmax = s[0];
#pragma unroll
      for (int j = 1; j < V; ++j) vmax = fmaxf(vmax, s[j]);
      if (vmax > run_max) {
        run_sum *= exp2f(run_max - vmax);
        run_max = vmax;
      }
      if (run_max != -INFINITY) {
#pragma unroll
        for (int j = 0; j < V; ++j) run_sum += exp2f(s[j] - run_max);
      }
    }
    float stats[2] = {run_max, unmasked ? 1.0f : 0.0f};
    group_reduce<2>(stats, blockDim.x, shared, Max{});
    const float row_max = stats[0];
    const float mine = run_max == -INFINITY ? 0.0f : run_sum * exp2f(run_max - row_max);
    const float sum = group_reduce1(mine, blockDim.x, shared, Sum{});
    const float inv = kPadding && stats[1] == 0.0f ? 0.0f : 1.0f / sum;
    T* y = p.output + row * p.sk;
    for (int64_t col = threadIdx.x * V; col < p.sk; col += step) {
      float out[V];
      if (col < len) {
        const auto raw = *reinterpret_cast<const AlignedVector<T, V>*>(x + col);
        const auto raw_mask = kPadding ? *reinterpret_cast<const AlignedVector<uint8_t, V>*>(m + col) : no_mask;
        scores<kMasking, V>(out, raw, raw_mask, col, len, p.scale, unmasked);
#pragma unroll
        for (int j = 0; j < V; ++j) out[j] = exp2f(out[j] - row_max) * inv;
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) out[j] = 0.0f;
      }
      store_elements<V>(y + col, out);
    }
  }
}

template <typename T, int V, Masking kMasking>
void launch_width(const ForwardParams<T>& p, const Plan& plan, cudaStream_t stream) {
  if (plan.streaming) {
    forward_streaming<T, V, kMasking><<<grid_for(p.rows), kStreamBlock, 0, stream>>>(p);
  } else {
    const int64_t row_groups = apex::ceil_div(p.rows, plan.block / plan.group);
    forward_in_registers<T, V, kMasking><<<grid_for(row_groups), plan.block, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, Masking kMasking>
void launch_forward(const ForwardParams<T>& p, const Plan& plan) {
  constexpr int kWidth = 16 / sizeof(T);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (plan.vectorized) {
    launch_width<T, kWidth, kMasking>(p, plan, stream);
  } else {
    launch_width<T, 1, kMasking>(p, plan, stream);
  }
}

at::Tensor scaled_softmax_forward_cuda(const at::Tensor& input, const std::optional<at::Tensor>& mask, double scale,
                                       bool causal) {
  const char* op = "scaled_softmax_forward";
  const at::Tensor* m = apex::optional_tensor(mask);
  check_forward(op, input, m, causal);
  const c10::cuda::CUDAGuard device_guard(input.device());
  at::Tensor output = at::empty(input.sizes(), input.options());
  if (input.numel() == 0) return output;
  const int64_t sk = input.size(-1);
  const int64_t sq = input.size(-2);
  APEX_DISPATCH_FLOAT_TYPES(input.scalar_type(), op, "input", T, {
    constexpr int kWidth = 16 / sizeof(T);
    ForwardParams<T> p{};
    p.input = static_cast<const T*>(input.const_data_ptr());
    p.mask = m != nullptr ? static_cast<const uint8_t*>(m->const_data_ptr()) : nullptr;
    p.output = static_cast<T*>(output.data_ptr());
    p.rows = input.numel() / sk;
    p.sk = sk;
    p.sq = sq;
    p.batch_rows = m != nullptr && m->size(0) != 1 ? input.size(1) * sq : 0;
    p.scale = static_cast<float>(scale) * kLog2e;
    const bool aligned = apex::aligned16(p.input) && apex::aligned16(p.output) &&
                         (p.mask == nullptr || apex::aligned_to(p.mask, kWidth));
    const Plan pl = plan(sk, kWidth, aligned);
    p.group = pl.group;
    if (causal) {
      launch_forward<T, Masking::kCausal>(p, pl);
    } else if (m != nullptr) {
      launch_forward<T, Masking::kPadding>(p, pl);
    } else {
      launch_forward<T, Masking::kNone>(p, pl);
    }
  });
  return output;
}

}  // namespace
}  // namespace apex_transformer::softmax

TORCH_LIBRARY_IMPL(apex_transformer, CUDA, m) {
  m.impl("scaled_softmax_forward", &apex_transformer::softmax::scaled_softmax_forward_cuda);
}
