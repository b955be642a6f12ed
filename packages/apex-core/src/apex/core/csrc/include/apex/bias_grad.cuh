// The backward of `act(x W^T + b)` after the GEMM that gives dy = d act(...): the activation's
// gradient and the bias gradient in one pass over the rows,
//
//   dz[r, c]   = dy[r, c] * act'(saved[r, c])       (the gradient of x W^T + b)
//   d_bias[c]  = sum over r of dz[r, c]             (float32 sums of the unrounded dz)
//
// `saved` is the activation's output for relu (dz = dy where y > 0, else 0) and sigmoid
// (dy y (1 - y)), its input for GELU (tanh approximation, as F.gelu(approximate="tanh")). kIdentity
// is a column sum only (dz is dy; nothing is written). Either output may be left out: without
// d_bias this is the element-wise derivative, without dz (kIdentity) a column sum.
//
// Why not cuBLASLt: on the H200 with CUDA 13.0 its DRELU_BGRAD / DGELU_BGRAD epilogues run as the
// GEMM plus a separate generic kernel (0.3-0.4 ms at 8192 x 4096 bf16), and BGRADB as the GEMM
// plus a bias-gradient kernel slower than the column sum here (see apex/cublaslt.h); a separate
// column sum after an element-wise kernel would read dz once more.
//
// Layout: a block is 32 column vectors (16 bytes each) x 8 row lanes, over a chunk of rows; each
// thread keeps its vector's sums in registers, the block adds its 8 lanes in shared memory and
// writes one float32 row of partial sums per row chunk, and a second kernel adds the partial rows
// in a fixed order (the same bits on every run, no atomics). One row chunk: d_bias directly.
// H200, bf16 [8192, 4096], GELU: 48 us (4.2 TB/s of the 201 MB read and written).
// dz may be dy itself (written in place: each element is read before it is written, by the same
// thread). Rows whose length is not a multiple of the vector, or pointers not 16-byte aligned,
// take scalar accesses.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/macros/Macros.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <apex/dispatch.h>
#include <apex/launch.cuh>
#include <apex/vectorized.cuh>

namespace apex::bias_grad {
// Internal linkage: each package's library keeps its own kernels (as apex/cublaslt.h).
namespace {

enum class Act { kIdentity, kRelu, kSigmoid, kGeluTanh };

constexpr int kColThreads = 32;
constexpr int kRowThreads = 8;
constexpr int kThreads = kColThreads * kRowThreads;
constexpr int kRowsInFlight = 4;  // rows a thread loads before it uses the first

// dy * act'(s) in float32.
template <Act A>
C10_DEVICE C10_ALWAYS_INLINE float times_derivative(float dy, float s) {
  if constexpr (A == Act::kIdentity) {
    return dy;
  } else if constexpr (A == Act::kRelu) {
    return s > 0.0f ? dy : 0.0f;
  } else if constexpr (A == Act::kSigmoid) {
    return dy * s * (1.0f - s);
  } else {
    // gelu(x) = x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3):
    // gelu'(x) = (1 + tanh(u))/2 + x/2 (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2).
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    constexpr float kCubic = 0.044715f;
    // tanh(u) = 1 - 2 / (e^2u + 1): the packages build with --use_fast_math, which makes tanhf the
    // hardware approximation (relative error 2^-11, too coarse for float32); e^2u overflowing to
    // infinity gives 1, underflowing to 0 gives -1.
    const float x2 = s * s;
    const float t = 1.0f - 2.0f / (__expf(2.0f * kSqrt2OverPi * s * (1.0f + kCubic * x2)) + 1.0f);
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kCubic * x2);
    return dy * (0.5f * (1.0f + t) + 0.5f * s * (1.0f - t * t) * du);
  }
}

// One block: columns [blockIdx.x * 32 W, +32 W) of rows [blockIdx.y * rows_per_block, +rows_per_block).
// W > 1 needs cols % W == 0 and 16-byte aligned pointers (the host checks). With partials the
// block writes its row of partial sums there, else (one row chunk) d_bias itself; with neither,
// no sums.
template <typename T, int W, Act A>
__global__ void __launch_bounds__(kThreads)
    activation_bias_grad_kernel(const T* dy, const T* __restrict__ saved, T* dz, float* __restrict__ partials,
                                T* __restrict__ d_bias, int64_t rows, int64_t cols, int64_t rows_per_block) {
  constexpr bool kWritesDz = A != Act::kIdentity;
  const int tx = static_cast<int>(threadIdx.x) % kColThreads;
  const int ty = static_cast<int>(threadIdx.x) / kColThreads;
  const int64_t block_col = static_cast<int64_t>(blockIdx.x) * kColThreads * W;
  const int64_t col = block_col + static_cast<int64_t>(tx) * W;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t row_end = rows - row_begin < rows_per_block ? rows : row_begin + rows_per_block;

  float sums[W];
#pragma unroll
  for (int j = 0; j < W; ++j) sums[j] = 0.0f;

  // Rows r, r + 8, ..., r + 8 (count - 1) of this thread's vector.
  auto step = [&](int64_t r, auto count_tag) {
    constexpr int kCount = decltype(count_tag)::value;
    float g[kCount][W];
    float s[kCount][W];
#pragma unroll
    for (int u = 0; u < kCount; ++u) {
      const int64_t at = (r + u * kRowThreads) * cols + col;
      if constexpr (W == 1) {
        g[u][0] = static_cast<float>(dy[at]);
        if constexpr (kWritesDz) s[u][0] = static_cast<float>(saved[at]);
      } else {
        to_floats(g[u], load_vector_whole<T, W>(dy + at));
        if constexpr (kWritesDz) to_floats(s[u], load_vector_whole<T, W>(saved + at));
      }
    }
#pragma unroll
    for (int u = 0; u < kCount; ++u) {
#pragma unroll
      for (int j = 0; j < W; ++j) {
        g[u][j] = times_derivative<A>(g[u][j], s[u][j]);
        sums[j] += g[u][j];
      }
      if constexpr (kWritesDz) {
        const int64_t at = (r + u * kRowThreads) * cols + col;
        if constexpr (W == 1) {
          dz[at] = static_cast<T>(g[u][0]);
        } else {
          AlignedVector<T, W> v;
#pragma unroll
          for (int j = 0; j < W; ++j) v.val[j] = static_cast<T>(g[u][j]);
          store_vector(dz + at, v);  // 16-byte stores (store_floats' plain ones were split in four)
        }
      }
    }
  };

  if (col < cols) {
    int64_t r = row_begin + ty;
    for (; r + (kRowsInFlight - 1) * kRowThreads < row_end; r += kRowsInFlight * kRowThreads) {
      step(r, std::integral_constant<int, kRowsInFlight>{});
    }
    for (; r < row_end; r += kRowThreads) step(r, std::integral_constant<int, 1>{});
  }
  if (partials == nullptr && d_bias == nullptr) return;

  // The 8 row lanes' sums of each column, added in shared memory in lane order.
  __shared__ float lane_sums[kRowThreads][kColThreads * W];
#pragma unroll
  for (int j = 0; j < W; ++j) lane_sums[ty][tx * W + j] = sums[j];
  __syncthreads();
  for (int c = static_cast<int>(threadIdx.x); c < kColThreads * W; c += kThreads) {
    if (block_col + c >= cols) break;
    float total = 0.0f;
#pragma unroll
    for (int y = 0; y < kRowThreads; ++y) total += lane_sums[y][c];
    if (partials != nullptr) {
      partials[static_cast<int64_t>(blockIdx.y) * cols + block_col + c] = total;
    } else {
      d_bias[block_col + c] = static_cast<T>(total);
    }
  }
}

// d_bias[c] = the sum of partials[0..parts)[c]: a block is 32 columns x 8 lanes, lane l adding
// parts l, l + 8, ... (four loads in flight), then the lanes' sums added in lane order.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    sum_partials_kernel(const float* __restrict__ partials, int64_t parts, int64_t cols, T* __restrict__ d_bias) {
  const int tx = static_cast<int>(threadIdx.x) % kColThreads;
  const int ty = static_cast<int>(threadIdx.x) / kColThreads;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColThreads + tx;
  float total = 0.0f;
  if (col < cols) {
    int64_t p = ty;
    for (; p + 3 * kRowThreads < parts; p += 4 * kRowThreads) {
      float v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = partials[(p + u * kRowThreads) * cols + col];
#pragma unroll
      for (int u = 0; u < 4; ++u) total += v[u];
    }
    for (; p < parts; p += kRowThreads) total += partials[p * cols + col];
  }
  __shared__ float lane_totals[kRowThreads][kColThreads];
  lane_totals[ty][tx] = total;
  __syncthreads();
  if (ty == 0 && col < cols) {
    float sum = 0.0f;
#pragma unroll
    for (int y = 0; y < kRowThreads; ++y) sum += lane_totals[y][tx];
    d_bias[col] = static_cast<T>(sum);
  }
}

// The launch for dy, saved, dz: [rows, cols] contiguous, d_bias: [cols], all of one float dtype
// (float32, float16, bfloat16) on the current device. dz undefined: not written (kIdentity must
// leave it so); d_bias undefined: no sums. dz may be dy.
template <Act A>
void activation_bias_grad(const at::Tensor& dy, const at::Tensor& saved, const at::Tensor& dz,
                          const at::Tensor& d_bias) {
  TORCH_INTERNAL_ASSERT(dy.dim() == 2 && dy.is_contiguous());
  TORCH_INTERNAL_ASSERT((A == Act::kIdentity) == !dz.defined());
  TORCH_INTERNAL_ASSERT(A != Act::kIdentity || d_bias.defined());
  const int64_t rows = dy.size(0);
  const int64_t cols = dy.size(1);
  if (cols == 0) return;
  if (rows == 0) {
    if (d_bias.defined()) d_bias.zero_();
    return;
  }
  APEX_DISPATCH_FLOAT_TYPES(dy.scalar_type(), "activation_bias_grad", "dy", T, {
    constexpr int kWidth = vector_width<T>();
    const T* dy_ptr = dy.const_data_ptr<T>();
    const T* saved_ptr = dz.defined() ? saved.const_data_ptr<T>() : nullptr;
    T* dz_ptr = dz.defined() ? dz.mutable_data_ptr<T>() : nullptr;
    T* bias_ptr = d_bias.defined() ? d_bias.mutable_data_ptr<T>() : nullptr;
    auto launch = [&](auto width_tag) {
      constexpr int W = decltype(width_tag)::value;
      const int64_t col_blocks = ceil_div(cols, int64_t{kColThreads} * W);
      // About one full wave of blocks (8 resident a multiprocessor), row chunks a multiple of the
      // rows a block takes per step.
      const int64_t row_blocks_wanted = std::max<int64_t>(1, int64_t{sm_count()} * 8 / col_blocks);
      const int64_t rows_per_block =
          ceil_div(ceil_div(rows, row_blocks_wanted), int64_t{kRowThreads} * kRowsInFlight) * kRowThreads *
          kRowsInFlight;
      const int64_t row_blocks = ceil_div(rows, rows_per_block);
      at::Tensor partials;
      if (bias_ptr != nullptr && row_blocks > 1) {
        partials = at::empty({row_blocks, cols}, dy.options().dtype(at::kFloat));
      }
      float* partials_ptr = partials.defined() ? partials.mutable_data_ptr<float>() : nullptr;
      const auto stream = at::cuda::getCurrentCUDAStream();
      const dim3 grid(static_cast<unsigned int>(col_blocks), static_cast<unsigned int>(row_blocks));
      activation_bias_grad_kernel<T, W, A><<<grid, kThreads, 0, stream>>>(
          dy_ptr, saved_ptr, dz_ptr, partials_ptr, partials_ptr == nullptr ? bias_ptr : nullptr, rows, cols,
          rows_per_block);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (partials_ptr != nullptr) {
        const auto blocks = static_cast<unsigned int>(ceil_div(cols, kColThreads));
        sum_partials_kernel<T><<<blocks, kThreads, 0, stream>>>(partials_ptr, row_blocks, cols, bias_ptr);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    };
    if (cols % kWidth == 0 && aligned16(dy_ptr) && aligned16(saved_ptr) && aligned16(dz_ptr)) {
      launch(std::integral_constant<int, kWidth>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
  });
}

}  // namespace
}  // namespace apex::bias_grad
