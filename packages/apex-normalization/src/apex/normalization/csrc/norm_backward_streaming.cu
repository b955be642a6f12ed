// norm_backward for rows that backward_in_registers does not take (odd hidden sizes, misaligned
// rows, rows longer than the registers hold). Correct for any size; not the fast path.
//
// - backward_streaming_kernel: one block per row; a pass over the row for the two row sums, then
//   a pass that writes dx (the second read mostly hits L2).
// - weight_grad_partials: the weight and bias gradients by columns: a block adds up dy * xhat and
//   dy over a chunk of rows for 32 columns, one partial row per chunk; sum_partials adds them.
//   This reads the saved tensor and dy once more, the price of not holding column accumulators.
#include <ATen/core/Tensor.h>

#include "norm_backward.cuh"

namespace apex_normalization {
namespace {

constexpr int kColumnRows = 16;  // blockDim.y of weight_grad_partials

template <typename T, typename W, typename O, typename S>
__global__ void __launch_bounds__(kStreamingThreads) backward_streaming_kernel(const BackwardParams<T, W, O, S> p) {
  constexpr int kV = apex::vector_width<T, W, O, S>();
  constexpr int kInFlight = 2;
  __shared__ float scratch[2 * 2 * (kStreamingThreads / kWarp)];  // group_sum: two buffers of two sums per warp
  int turn = 0;
  const BlockRowGroup block_group(static_cast<int>(blockDim.x));
  const float inv_hidden = 1.0f / static_cast<float>(p.hidden);

  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t offset = row * p.hidden;
    const S* x = p.saved + offset;
    const O* dy = p.grad_output + offset;
    const float rstd = p.rstd[row];
    const float mean = p.mean != nullptr ? p.mean[row] : 0.0f;

    // xhat and wdy of one access group, element by element (for_each_element's groups may be
    // scalar, so the per-vector helper of norm_backward.cuh does not apply).
    auto values = [&](auto group, auto& xhat, auto& wdy, auto& dys) {
      using G = decltype(group);
      float w[G::kCount][G::kWidth];
      float b[G::kCount][G::kWidth];
      group.load(xhat, x);
      group.load(dys, dy);
      if (p.weight != nullptr) group.load(w, p.weight);
      if (p.memory_efficient && p.bias != nullptr) group.load(b, p.bias);
#pragma unroll
      for (int i = 0; i < G::kCount; ++i) {
#pragma unroll
        for (int j = 0; j < G::kWidth; ++j) {
          const float weight = p.weight != nullptr ? w[i][j] : 1.0f;
          wdy[i][j] = dys[i][j] * weight;
          if (p.memory_efficient) {
            const float shifted = p.bias != nullptr ? xhat[i][j] - b[i][j] : xhat[i][j];
            xhat[i][j] = p.weight != nullptr ? shifted / weight : shifted;
          } else {
            xhat[i][j] = (xhat[i][j] - mean) * rstd;
          }
        }
      }
    };

    float sums[2] = {0.0f, 0.0f};
    apex::for_each_element<kV, kInFlight>(
        p.hidden,
        [&](auto group) {
          using G = decltype(group);
          float xhat[G::kCount][G::kWidth], wdy[G::kCount][G::kWidth], dys[G::kCount][G::kWidth];
          values(group, xhat, wdy, dys);
#pragma unroll
          for (int i = 0; i < G::kCount; ++i) {
#pragma unroll
            for (int j = 0; j < G::kWidth; ++j) {
              sums[0] += wdy[i][j] * xhat[i][j];
              sums[1] += wdy[i][j];
            }
          }
        },
        x, dy, p.weight, p.bias);
    group_sum(sums, block_group, scratch, turn);
    const float projection = sums[0] * inv_hidden;
    const float centering = p.rms ? 0.0f : sums[1] * inv_hidden;

    T* dx = p.grad_input + offset;
    const T* extra = p.grad_residual != nullptr ? p.grad_residual + offset : nullptr;
    apex::for_each_element<kV, kInFlight>(
        p.hidden,
        [&](auto group) {
          using G = decltype(group);
          float xhat[G::kCount][G::kWidth], wdy[G::kCount][G::kWidth], dys[G::kCount][G::kWidth];
          float more[G::kCount][G::kWidth];
          values(group, xhat, wdy, dys);
          if (extra != nullptr) group.load(more, extra);
#pragma unroll
          for (int i = 0; i < G::kCount; ++i) {
#pragma unroll
            for (int j = 0; j < G::kWidth; ++j) {
              float v = rstd * (wdy[i][j] - (xhat[i][j] * projection + centering));
              if (extra != nullptr) v += more[i][j];
              xhat[i][j] = v;
            }
          }
          group.store(dx, xhat);
        },
        x, dy, p.weight, p.bias, dx, extra);
  }
}

// Block (32, kColumnRows): columns blockIdx.x * 32 + threadIdx.x, rows of chunk blockIdx.y.
template <typename T, typename W, typename O, typename S>
__global__ void __launch_bounds__(kWarp* kColumnRows)
    weight_grad_partials(const BackwardParams<T, W, O, S> p, int64_t rows_per_chunk) {
  __shared__ float tile_w[kColumnRows][kWarp + 1];
  __shared__ float tile_b[kColumnRows][kWarp + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kWarp + threadIdx.x;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t last = first + rows_per_chunk < p.rows ? first + rows_per_chunk : p.rows;
  float acc_w = 0.0f;
  float acc_b = 0.0f;
  if (col < p.hidden) {
    const float w = p.weight != nullptr ? static_cast<float>(p.weight[col]) : 1.0f;
    const float b = p.bias != nullptr ? static_cast<float>(p.bias[col]) : 0.0f;
    for (int64_t row = first + threadIdx.y; row < last; row += kColumnRows) {
      const int64_t at = row * p.hidden + col;
      const float x = static_cast<float>(p.saved[at]);
      const float dy = static_cast<float>(p.grad_output[at]);
      const float xhat =
          p.memory_efficient ? (x - b) / w : (x - (p.mean != nullptr ? p.mean[row] : 0.0f)) * p.rstd[row];
      acc_w += dy * xhat;
      acc_b += dy;
    }
  }
  tile_w[threadIdx.y][threadIdx.x] = acc_w;
  tile_b[threadIdx.y][threadIdx.x] = acc_b;
  __syncthreads();
  for (int stride = kColumnRows / 2; stride > 0; stride /= 2) {
    if (static_cast<int>(threadIdx.y) < stride) {
      tile_w[threadIdx.y][threadIdx.x] += tile_w[threadIdx.y + stride][threadIdx.x];
      tile_b[threadIdx.y][threadIdx.x] += tile_b[threadIdx.y + stride][threadIdx.x];
    }
    __syncthreads();
  }
  if (threadIdx.y == 0 && col < p.hidden) {
    p.partial_weight[blockIdx.y * p.hidden + col] = tile_w[0][threadIdx.x];
    if (p.partial_bias != nullptr) p.partial_bias[blockIdx.y * p.hidden + col] = tile_b[0][threadIdx.x];
  }
}

template <typename T, typename W, typename O, typename S>
void launch_streaming(const BackwardArgs& a) {
  constexpr int kV = apex::vector_width<T, W, O, S>();
  auto p = backward_params<T, W, O, S>(a);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int sms = sm_count();
  {
    const int block = streaming_threads_for(p.hidden, kV);
    const auto kernel = backward_streaming_kernel<T, W, O, S>;
    const int64_t grid = std::min<int64_t>(
        p.rows, static_cast<int64_t>(sms) * resident_blocks(reinterpret_cast<const void*>(kernel), block, 0));
    kernel<<<static_cast<unsigned>(grid), block, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (a.grad_weight == nullptr) return;

  // Enough chunks of rows for a few blocks per multiprocessor, each chunk a few rows per thread.
  const int64_t column_blocks = ceil_div(p.hidden, kWarp);
  int64_t chunks = ceil_div(static_cast<int64_t>(sms) * 8, column_blocks);
  chunks = std::max<int64_t>(1, std::min<int64_t>({chunks, ceil_div(p.rows, 4 * kColumnRows), 65535}));
  const int64_t rows_per_chunk = ceil_div(p.rows, chunks);
  chunks = ceil_div(p.rows, rows_per_chunk);
  const auto f32 = a.saved->options().dtype(at::kFloat);
  at::Tensor partial_weight = at::empty({chunks, p.hidden}, f32);
  at::Tensor partial_bias;
  p.partial_weight = partial_weight.data_ptr<float>();
  if (a.grad_bias != nullptr) {
    partial_bias = at::empty({chunks, p.hidden}, f32);
    p.partial_bias = partial_bias.data_ptr<float>();
  }
  const dim3 grid(static_cast<unsigned>(column_blocks), static_cast<unsigned>(chunks));
  weight_grad_partials<T, W, O, S><<<grid, dim3(kWarp, kColumnRows), 0, stream>>>(p, rows_per_chunk);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  sum_partials(partial_weight, a.grad_bias != nullptr ? &partial_bias : nullptr, *a.grad_weight, a.grad_bias);
}

}  // namespace

void backward_streaming(const BackwardArgs& a) {
  dispatch_backward_types(a, [&](auto t, auto w, auto o, auto s) {
    launch_streaming<typename decltype(t)::type, typename decltype(w)::type, typename decltype(o)::type,
                     typename decltype(s)::type>(a);
  });
}

}  // namespace apex_normalization
