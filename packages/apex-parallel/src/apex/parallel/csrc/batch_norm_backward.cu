// The backward kernels of SyncBatchNorm. See _reference.reduce_bn / batch_norm_backward /
// relu_backward.
//
// - reduce_bn[_c_last]: per channel sum_dy and sum_dy_xmu (and the local weight gradients),
//   reading x and dy once; the same block layout and chunking as the Welford kernels, with
//   partial sums merged in chunk order (deterministic);
// - batch_norm_backward[_c_last]: dx from x, dy and the group's sums: one read of each, one
//   write, as the forward kernels;
// - relu_backward_c_last: dy masked where the recomputed pre-activation bn(x) + z <= 0.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>
#include <tuple>

#include "syncbn_common.cuh"
#include "cuda_ops.h"

namespace apex_parallel {
namespace {

// (sum_dy, sum_dy_xmu) of one channel: one 8-byte (float) or 16-byte (double) access.
template <typename A>
struct alignas(2 * sizeof(A)) SumPair {
  A x;
  A y;
};

template <typename W, typename A>
struct SumsOut {
  A* sum_dy;  // [C]
  A* sum_dy_xmu;
  W* grad_weight;  // [C] or null
  W* grad_bias;
  const A* invstd;
  SumPair<A>* partial;  // [chunks, C] or null
};

// What relu's derivative needs in the fused kernels (reduce_bn_relu_c_last,
// batch_norm_backward_relu_c_last): the pre-activation bn(x) [+ z] recomputed from the forward's
// statistics, as relu_backward_c_last does, so that the masked gradient need not be written out.
template <typename T, typename W, typename A>
struct ReluInputs {
  const T* z;  // may be null
  const A* invstd;
  const W* weight;  // may be null
  const W* bias;    // may be null
  T* masked;        // reduce_bn_relu_c_last's masked gradient, written when not null
};

template <typename W, typename A>
__device__ __forceinline__ void write_sums(const SumsOut<W, A>& out, A dy, A dy_xmu, int64_t chunk, int64_t c,
                                           int64_t channels) {
  if (out.partial != nullptr) {
    out.partial[chunk * channels + c] = SumPair<A>{dy, dy_xmu};
    return;
  }
  out.sum_dy[c] = dy;
  out.sum_dy_xmu[c] = dy_xmu;
  if (out.grad_weight != nullptr) {
    out.grad_weight[c] = static_cast<W>(dy_xmu * out.invstd[c]);
    out.grad_bias[c] = static_cast<W>(dy);
  }
}

template <typename T, typename W, int V, typename A = acc_t<T>>
__global__ void __launch_bounds__(kThreads)
    reduce_channels_first(const T* __restrict__ grad_output, const T* __restrict__ input, const A* __restrict__ mean,
                          int64_t channels, int64_t plane_units, int64_t units, int64_t per_chunk, PlaneStep step,
                          SumsOut<W, A> out) {
  __shared__ A shared[apex::kWarpSize];
  const int64_t c = blockIdx.x;
  const int64_t chunk = blockIdx.y;
  const int64_t begin = chunk * per_chunk;
  const int64_t end = begin + per_chunk < units ? begin + per_chunk : units;
  const A m = mean[c];
  A sum_dy = A(0);
  A sum_dy_xmu = A(0);
  int64_t j = begin + threadIdx.x;
  PlaneCursor cursor{j / plane_units, j % plane_units};
  const int64_t plane = plane_units * V;
  for (; j < end; j += static_cast<int64_t>(kUnroll) * blockDim.x) {
    Packed<T, V> px[kUnroll];
    Packed<T, V> pdy[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const bool ok = j + u * static_cast<int64_t>(blockDim.x) < end;
      const int64_t offset = (cursor.n * channels + c) * plane + cursor.l * V;
      px[u] = load_packed<V>(input, offset, ok);
      pdy[u] = load_packed<V>(grad_output, offset, ok);
      cursor.advance(step, plane_units);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      A x[V];
      A dy[V];
      unpack(x, px[u]);  // zeros past the end
      unpack(dy, pdy[u]);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        sum_dy += dy[k];
        sum_dy_xmu += dy[k] * (x[k] - m);
      }
    }
  }
  sum_dy = apex::block_sum(sum_dy, shared);
  sum_dy_xmu = apex::block_sum(sum_dy_xmu, shared);
  if (threadIdx.x == 0) write_sums(out, sum_dy, sum_dy_xmu, chunk, c, channels);
}

template <typename T, typename W, int V, bool RELU, typename A = acc_t<T>>
__global__ void __launch_bounds__(kThreads, kRowsInFlightBlocks)
    reduce_channels_last(const T* __restrict__ grad_output, const T* __restrict__ input, const A* __restrict__ mean,
                         int64_t rows, int64_t channels, SumsOut<W, A> out, ReluInputs<T, W, A> relu) {
  __shared__ SumPair<A> shared[kThreads * V];
  const int64_t cu = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const bool active = cu * V < channels;
  A m[V];
  A scale[V];  // RELU: the forward's scale and shift, for the pre-activation
  A shift[V];
  SumPair<A> sums[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t c = cu * V + k;
    m[k] = active ? mean[c] : A(0);
    sums[k] = SumPair<A>{A(0), A(0)};
    if constexpr (RELU) {
      scale[k] = active ? relu.invstd[c] * load_or(relu.weight, c, A(1)) : A(0);
      shift[k] = active ? load_or(relu.bias, c, A(0)) : A(0);
    }
  }
  constexpr int kRows = rows_in_flight(RELU);
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t r = blockIdx.y * static_cast<int64_t>(blockDim.y) + threadIdx.y; active && r < rows;
       r += kRows * row_step) {
    Packed<T, V> px[kRows];
    Packed<T, V> pdy[kRows];
    Packed<T, V> pz[kRows];
    bool ok[kRows];
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      ok[u] = r + u * row_step < rows;
      const int64_t offset = (r + u * row_step) * channels + cu * V;
      px[u] = load_packed<V>(input, offset, ok[u]);
      pdy[u] = load_packed<V>(grad_output, offset, ok[u]);
      if constexpr (RELU) pz[u] = load_packed<V>(relu.z, offset, ok[u] && relu.z != nullptr);
    }
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      A x[V];
      A dy[V];
      unpack(x, px[u]);  // zeros past the last row
      unpack(dy, pdy[u]);
      if constexpr (RELU) {
        A z[V];
        unpack(z, pz[u]);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          A y = (x[k] - m[k]) * scale[k] + shift[k];
          if (relu.z != nullptr) y += z[k];
          dy[k] = y > A(0) ? dy[k] : A(0);
        }
        if (relu.masked != nullptr && ok[u]) {
          store_values<V>(relu.masked + (r + u * row_step) * channels + cu * V, dy);
        }
      }
#pragma unroll
      for (int k = 0; k < V; ++k) {
        sums[k].x += dy[k];
        sums[k].y += dy[k] * (x[k] - m[k]);
      }
    }
  }
  const int slot = (threadIdx.y * blockDim.x + threadIdx.x) * V;
#pragma unroll
  for (int k = 0; k < V; ++k) shared[slot + k] = sums[k];
  for (int half = blockDim.y / 2; half > 0; half /= 2) {
    __syncthreads();
    if (threadIdx.y < half) {
      const int other = slot + half * blockDim.x * V;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        shared[slot + k].x += shared[other + k].x;
        shared[slot + k].y += shared[other + k].y;
      }
    }
  }
  if (threadIdx.y == 0 && active) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      write_sums(out, shared[slot + k].x, shared[slot + k].y, blockIdx.y, cu * V + k, channels);
    }
  }
}

template <typename W, typename A>
__global__ void __launch_bounds__(apex::kWarpSize* kFinalizeLanes)
    sums_finalize(int64_t chunks, int64_t channels, SumsOut<W, A> out) {
  __shared__ SumPair<A> lanes[kFinalizeLanes][apex::kWarpSize + 1];
  const int64_t c = blockIdx.x * static_cast<int64_t>(apex::kWarpSize) + threadIdx.x;
  SumPair<A> sums{A(0), A(0)};
  if (c < channels) {
    for (int64_t k = threadIdx.y; k < chunks; k += kFinalizeLanes) {
      const SumPair<A> s = out.partial[k * channels + c];
      sums.x += s.x;
      sums.y += s.y;
    }
  }
  lanes[threadIdx.y][threadIdx.x] = sums;
  for (int half = kFinalizeLanes / 2; half > 0; half /= 2) {
    __syncthreads();
    if (static_cast<int>(threadIdx.y) < half) {
      lanes[threadIdx.y][threadIdx.x].x += lanes[threadIdx.y + half][threadIdx.x].x;
      lanes[threadIdx.y][threadIdx.x].y += lanes[threadIdx.y + half][threadIdx.x].y;
    }
  }
  if (threadIdx.y == 0 && c < channels) {
    SumsOut<W, A> final_out = out;
    final_out.partial = nullptr;
    write_sums(final_out, lanes[0][threadIdx.x].x, lanes[0][threadIdx.x].y, 0, c, channels);
  }
}

// relu (channels-last only): grad_output masked where bn(x) [+ z] <= 0 on the fly.
// masked (with relu): the masked gradient is also written out, as a fifth result (else empty).
using ReduceResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
ReduceResult reduce(const char* op, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean,
                    const at::Tensor& invstd, const std::optional<at::Tensor>& weight, bool channel_last,
                    bool relu = false, const std::optional<at::Tensor>& z = std::nullopt,
                    const std::optional<at::Tensor>& bias = std::nullopt, bool masked = false) {
  const int64_t channels = checks::stats(op, input, mean, invstd, weight, bias, channel_last);
  checks::like_input(op, "grad_output", grad_output, input);
  const at::Tensor* zt = optional_tensor(z);
  if (zt != nullptr) checks::like_input(op, "z", *zt, input);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const auto f32 = input.options().dtype(stat_dtype(input.scalar_type()));  // the statistics' dtype
  const at::Tensor* w = optional_tensor(weight);
  const int64_t numel = input.numel();
  at::Tensor masked_out = masked ? at::empty(input.sizes(), input.options()) : at::empty({0}, input.options());
  if (numel == 0) {
    at::Tensor grad_weight = w != nullptr ? at::zeros({channels}, w->options()) : at::empty({0}, f32);
    at::Tensor grad_bias = w != nullptr ? at::zeros({channels}, w->options()) : at::empty({0}, f32);
    return {at::zeros({channels}, f32), at::zeros({channels}, f32), grad_weight, grad_bias, masked_out};
  }
  at::Tensor sum_dy = at::empty({channels}, f32);
  at::Tensor sum_dy_xmu = at::empty({channels}, f32);
  at::Tensor grad_weight = w != nullptr ? at::empty({channels}, w->options()) : at::empty({0}, f32);
  at::Tensor grad_bias = w != nullptr ? at::empty({channels}, w->options()) : at::empty({0}, f32);
  at::Tensor partial;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t per_channel = numel / channels;
  dispatch_input_weight(op, input.scalar_type(), weight, [&](auto t, auto wt) {
    using T = typename decltype(t)::type;
    using W = typename decltype(wt)::type;
    using A = acc_t<T>;
    const T* x = static_cast<const T*>(input.const_data_ptr());
    const T* dy = static_cast<const T*>(grad_output.const_data_ptr());
    const T* zp = zt != nullptr ? static_cast<const T*>(zt->const_data_ptr()) : nullptr;
    const ReluInputs<T, W, A> relu_inputs{zp, invstd.const_data_ptr<A>(), optional_ptr<W>(weight),
                                          optional_ptr<W>(bias),
                                          masked ? static_cast<T*>(masked_out.data_ptr()) : nullptr};
    SumsOut<W, A> out{sum_dy.data_ptr<A>(),
                      sum_dy_xmu.data_ptr<A>(),
                      w != nullptr ? static_cast<W*>(grad_weight.data_ptr()) : nullptr,
                      w != nullptr ? static_cast<W*>(grad_bias.data_ptr()) : nullptr,
                      invstd.const_data_ptr<A>(),
                      nullptr};
    auto finish = [&](int64_t chunks) {
      if (chunks <= 1) return;
      sums_finalize<W, A><<<finalize_grid(channels), finalize_block(), 0, stream>>>(chunks, channels, out);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    auto partials = [&](int64_t chunks) {
      if (chunks <= 1) return;
      partial = at::empty({chunks * channels * 2}, f32);
      out.partial = reinterpret_cast<SumPair<A>*>(partial.data_ptr<A>());
    };
    if (!channel_last) {
      const int64_t plane = per_channel / input.size(0);
      dispatch_vector<T>(pick_vector<T>(plane, {x, dy}), [&](auto v) {
        constexpr int V = decltype(v)::value;
        const int64_t plane_units = plane / V;
        const int64_t units = input.size(0) * plane_units;
        const int64_t chunks = chunks_for(channels, units, static_cast<int64_t>(kThreads) * kUnroll);
        partials(chunks);
        const dim3 grid(static_cast<unsigned>(channels), static_cast<unsigned>(chunks));
        reduce_channels_first<T, W, V><<<grid, kThreads, 0, stream>>>(dy, x, mean.const_data_ptr<A>(), channels,
                                                                       plane_units, units, ceil_div(units, chunks),
                                                                       plane_step(kThreads, plane_units), out);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        finish(chunks);
      });
    } else {
      dispatch_vector<T>(pick_vector<T>(channels, {x, dy, zp}), [&](auto v) {
        constexpr int V = decltype(v)::value;
        const int64_t rows = per_channel;
        const TileShape tile = tile_shape(channels / V);
        const int64_t tiles = ceil_div(channels / V, tile.bx);
        const int64_t chunks =
            std::min<int64_t>(chunks_for(tiles, rows, static_cast<int64_t>(tile.by) * kUnroll), 65535);
        partials(chunks);
        const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(chunks));
        if (relu) {
          reduce_channels_last<T, W, V, true><<<grid, dim3(tile.bx, tile.by), 0, stream>>>(
              dy, x, mean.const_data_ptr<A>(), rows, channels, out, relu_inputs);
        } else {
          reduce_channels_last<T, W, V, false><<<grid, dim3(tile.bx, tile.by), 0, stream>>>(
              dy, x, mean.const_data_ptr<A>(), rows, channels, out, relu_inputs);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        finish(chunks);
      });
    }
  });
  return {sum_dy, sum_dy_xmu, grad_weight, grad_bias, masked_out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sums_of(ReduceResult r) {
  return {std::move(std::get<0>(r)), std::move(std::get<1>(r)), std::move(std::get<2>(r)), std::move(std::get<3>(r))};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> reduce_bn_cuda(const at::Tensor& grad_output,
                                                                          const at::Tensor& input,
                                                                          const at::Tensor& mean,
                                                                          const at::Tensor& invstd,
                                                                          const std::optional<at::Tensor>& weight) {
  return sums_of(reduce("reduce_bn", grad_output, input, mean, invstd, weight, false));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> reduce_bn_c_last_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const std::optional<at::Tensor>& weight) {
  return sums_of(reduce("reduce_bn_c_last", grad_output, input, mean, invstd, weight, true));
}

ReduceResult reduce_bn_relu_c_last_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                        const std::optional<at::Tensor>& z, const at::Tensor& mean,
                                        const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                                        const std::optional<at::Tensor>& bias, bool masked) {
  return reduce("reduce_bn_relu_c_last", grad_output, input, mean, invstd, weight, true, true, z, bias, masked);
}

namespace {

// batch_norm_backward -------------------------------------------------------------------------

template <typename T, typename W, typename A = acc_t<T>>
struct BackwardParams {
  const T* grad_output;
  const T* input;
  const A* mean;
  const A* invstd;
  const W* weight;  // may be null
  const A* sum_dy;
  const A* sum_dy_xmu;
  const A* count;
  int64_t count_size;
  int64_t count_stride;
  T* grad_input;
  // relu (channels-last): the masked gradient's inputs, and where it goes for z (may be null)
  const T* z;
  const W* bias;
  T* grad_z;
};

// Per channel: dx = (dy - mean_dy - (x - mean) * factor) * scale.
template <typename A>
struct BackwardCoefficients {
  A mean;
  A mean_dy;
  A factor;
  A scale;
};

template <typename T, typename W, typename A>
__device__ __forceinline__ BackwardCoefficients<A> coefficients(const BackwardParams<T, W, A>& p, int64_t c,
                                                                A inv_count) {
  const A invstd = p.invstd[c];
  BackwardCoefficients<A> k;
  k.mean = p.mean[c];
  k.mean_dy = p.sum_dy[c] * inv_count;
  k.factor = invstd * invstd * p.sum_dy_xmu[c] * inv_count;
  k.scale = invstd * load_or(p.weight, c, A(1));
  return k;
}

template <typename T, typename W, int V, typename A = acc_t<T>>
__global__ void __launch_bounds__(kThreads)
    backward_channels_first(BackwardParams<T, W> p, int64_t channels, int64_t plane_units, int64_t units,
                            ChannelStep step) {
  __shared__ A shared[apex::kWarpSize];
  const A inv_count = A(1) / block_count(p.count, p.count_size, p.count_stride, shared);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  ChannelCursor cursor{(j / plane_units) % channels, j % plane_units};
  for (; j < units; j += kUnroll * stride) {
    Packed<T, V> px[kUnroll];
    Packed<T, V> pdy[kUnroll];
    int64_t c[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      c[u] = cursor.c;
      const bool ok = j + u * stride < units;
      px[u] = load_packed<V>(p.input, (j + u * stride) * V, ok);
      pdy[u] = load_packed<V>(p.grad_output, (j + u * stride) * V, ok);
      cursor.advance(step, plane_units, channels);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (j + u * stride >= units) continue;
      const BackwardCoefficients<A> k = coefficients(p, c[u], inv_count);
      A x[V];
      A dy[V];
      unpack(x, px[u]);
      unpack(dy, pdy[u]);
      A dx[V];
#pragma unroll
      for (int e = 0; e < V; ++e) dx[e] = (dy[e] - k.mean_dy - (x[e] - k.mean) * k.factor) * k.scale;
      store_values<V>(p.grad_input + (j + u * stride) * V, dx);
    }
  }
}

template <typename T, typename W, int V, bool RELU, typename A = acc_t<T>>
__global__ void __launch_bounds__(kThreads, kRowsInFlightBlocks)
    backward_channels_last(BackwardParams<T, W> p, int64_t rows, int64_t channels) {
  __shared__ A shared[apex::kWarpSize];
  const A inv_count = A(1) / block_count(p.count, p.count_size, p.count_stride, shared);
  const int64_t cu = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (cu * V >= channels) return;
  BackwardCoefficients<A> k[V];
  A shift[V];  // RELU: the pre-activation is (x - mean) * scale + shift [+ z], scale = k.scale
#pragma unroll
  for (int e = 0; e < V; ++e) {
    k[e] = coefficients(p, cu * V + e, inv_count);
    if constexpr (RELU) shift[e] = load_or(p.bias, cu * V + e, A(0));
  }
  constexpr int kRows = rows_in_flight(RELU);
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t r = blockIdx.y * static_cast<int64_t>(blockDim.y) + threadIdx.y; r < rows; r += kRows * row_step) {
    Packed<T, V> px[kRows];
    Packed<T, V> pdy[kRows];
    Packed<T, V> pz[kRows];
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const bool ok = r + u * row_step < rows;
      const int64_t offset = (r + u * row_step) * channels + cu * V;
      px[u] = load_packed<V>(p.input, offset, ok);
      pdy[u] = load_packed<V>(p.grad_output, offset, ok);
      if constexpr (RELU) pz[u] = load_packed<V>(p.z, offset, ok && p.z != nullptr);
    }
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      if (r + u * row_step >= rows) continue;
      const int64_t offset = (r + u * row_step) * channels + cu * V;
      A x[V];
      A dy[V];
      unpack(x, px[u]);
      unpack(dy, pdy[u]);
      if constexpr (RELU) {
        A z[V];
        unpack(z, pz[u]);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          A y = (x[e] - k[e].mean) * k[e].scale + shift[e];
          if (p.z != nullptr) y += z[e];
          dy[e] = y > A(0) ? dy[e] : A(0);
        }
      }
      A dx[V];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        dx[e] = (dy[e] - k[e].mean_dy - (x[e] - k[e].mean) * k[e].factor) * k[e].scale;
      }
      store_values<V>(p.grad_input + offset, dx);
      if constexpr (RELU) {
        if (p.grad_z != nullptr) store_values<V>(p.grad_z + offset, dy);
      }
    }
  }
}

// relu (channels-last only): grad_output masked where bn(x) [+ z] <= 0 on the fly; with grad_z,
// the masked gradient is also written out (z's gradient). Returns (grad_input, grad_z or empty).
std::tuple<at::Tensor, at::Tensor> backward(const char* op, const at::Tensor& grad_output, const at::Tensor& input,
                                            const at::Tensor& mean, const at::Tensor& invstd,
                                            const std::optional<at::Tensor>& weight, const at::Tensor& sum_dy,
                                            const at::Tensor& sum_dy_xmu, const at::Tensor& count, bool channel_last,
                                            bool relu = false, const std::optional<at::Tensor>& z = std::nullopt,
                                            const std::optional<at::Tensor>& bias = std::nullopt,
                                            bool want_grad_z = false) {
  const int64_t channels = checks::stats(op, input, mean, invstd, weight, bias, channel_last);
  checks::like_input(op, "grad_output", grad_output, input);
  const at::Tensor* zt = optional_tensor(z);
  if (zt != nullptr) checks::like_input(op, "z", *zt, input);
  checks::channel_stat(op, "sum_dy", sum_dy, channels, input.device(), input.scalar_type());
  checks::channel_stat(op, "sum_dy_xmu", sum_dy_xmu, channels, input.device(), input.scalar_type());
  checks::count(op, count, input.device());
  const c10::cuda::CUDAGuard device_guard(input.device());
  at::Tensor grad_input = at::empty(input.sizes(), input.options());
  at::Tensor grad_z = want_grad_z ? at::empty(input.sizes(), input.options()) : at::empty({0}, input.options());
  const int64_t numel = input.numel();
  if (numel == 0) return {grad_input, grad_z};
  // the counts in the statistics' dtype (a float32 count with float64 statistics, or the reverse)
  const auto stats = stat_dtype(input.scalar_type());
  const at::Tensor counts = count.scalar_type() == stats ? count : count.to(stats);
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_input_weight(op, input.scalar_type(), weight, [&](auto t, auto wt) {
    using T = typename decltype(t)::type;
    using W = typename decltype(wt)::type;
    using A = acc_t<T>;
    BackwardParams<T, W> p{};
    p.grad_output = static_cast<const T*>(grad_output.const_data_ptr());
    p.input = static_cast<const T*>(input.const_data_ptr());
    p.mean = mean.const_data_ptr<A>();
    p.invstd = invstd.const_data_ptr<A>();
    p.weight = optional_ptr<W>(weight);
    p.sum_dy = sum_dy.const_data_ptr<A>();
    p.sum_dy_xmu = sum_dy_xmu.const_data_ptr<A>();
    p.count = counts.const_data_ptr<A>();
    p.count_size = counts.size(0);
    p.count_stride = counts.stride(0);
    p.grad_input = static_cast<T*>(grad_input.data_ptr());
    p.z = zt != nullptr ? static_cast<const T*>(zt->const_data_ptr()) : nullptr;
    p.bias = optional_ptr<W>(bias);
    p.grad_z = want_grad_z ? static_cast<T*>(grad_z.data_ptr()) : nullptr;
    if (!channel_last) {
      const int64_t plane = numel / (input.size(0) * channels);
      dispatch_vector<T>(pick_vector<T>(plane, {p.input, p.grad_output, p.grad_input}), [&](auto v) {
        constexpr int V = decltype(v)::value;
        const int64_t plane_units = plane / V;
        const int64_t units = numel / V;
        const FlatLaunch launch = channels_first_launch(units, plane_units, channels);
        backward_channels_first<T, W, V><<<static_cast<unsigned>(launch.grid), kThreads, 0, stream>>>(
            p, channels, plane_units, units, launch.step);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    } else {
      dispatch_vector<T>(pick_vector<T>(channels, {p.input, p.grad_output, p.grad_input, p.z, p.grad_z}), [&](auto v) {
        constexpr int V = decltype(v)::value;
        const int64_t rows = numel / channels;
        const TileLaunch launch = channels_last_launch(channels / V, rows, kUnroll);
        if (relu) {
          backward_channels_last<T, W, V, true><<<launch.grid, launch.block, 0, stream>>>(p, rows, channels);
        } else {
          backward_channels_last<T, W, V, false><<<launch.grid, launch.block, 0, stream>>>(p, rows, channels);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
  });
  return {grad_input, grad_z};
}

}  // namespace

at::Tensor batch_norm_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean,
                                    const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                                    const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu, const at::Tensor& count) {
  return std::get<0>(
      backward("batch_norm_backward", grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count, false));
}

at::Tensor batch_norm_backward_c_last_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                           const at::Tensor& mean, const at::Tensor& invstd,
                                           const std::optional<at::Tensor>& weight, const at::Tensor& sum_dy,
                                           const at::Tensor& sum_dy_xmu, const at::Tensor& count) {
  return std::get<0>(backward("batch_norm_backward_c_last", grad_output, input, mean, invstd, weight, sum_dy,
                              sum_dy_xmu, count, true));
}

std::tuple<at::Tensor, at::Tensor> batch_norm_backward_relu_c_last_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const std::optional<at::Tensor>& z,
    const at::Tensor& mean, const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu,
    const at::Tensor& count, bool grad_z) {
  return backward("batch_norm_backward_relu_c_last", grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu,
                  count, true, true, z, bias, grad_z);
}

namespace {

// relu_backward_c_last ------------------------------------------------------------------------

template <typename T, typename W, int V, typename A = acc_t<T>>
__global__ void __launch_bounds__(kThreads)
    relu_backward_channels_last(const T* __restrict__ grad_output, const T* __restrict__ input,
                                const T* __restrict__ z, const A* __restrict__ mean, const A* __restrict__ invstd,
                                const W* __restrict__ weight, const W* __restrict__ bias, T* __restrict__ grad,
                                int64_t rows, int64_t channels) {
  const int64_t cu = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (cu * V >= channels) return;
  A m[V], scale[V], shift[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t c = cu * V + k;
    m[k] = mean[c];
    scale[k] = invstd[c] * load_or(weight, c, A(1));
    shift[k] = load_or(bias, c, A(0));
  }
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t r = blockIdx.y * static_cast<int64_t>(blockDim.y) + threadIdx.y; r < rows; r += row_step) {
    const int64_t offset = r * channels + cu * V;
    A x[V], dy[V], zv[V];
    load_values<V>(x, input + offset);
    load_values<V>(dy, grad_output + offset);
    if (z != nullptr) load_values<V>(zv, z + offset);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      A y = (x[k] - m[k]) * scale[k] + shift[k];
      if (z != nullptr) y += zv[k];
      dy[k] = y > A(0) ? dy[k] : A(0);
    }
    store_values<V>(grad + offset, dy);
  }
}

}  // namespace

at::Tensor relu_backward_c_last_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                     const std::optional<at::Tensor>& z, const at::Tensor& mean,
                                     const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                                     const std::optional<at::Tensor>& bias) {
  const char* op = "relu_backward_c_last";
  const int64_t channels = checks::stats(op, input, mean, invstd, weight, bias, true);
  checks::like_input(op, "grad_output", grad_output, input);
  const at::Tensor* zt = optional_tensor(z);
  if (zt != nullptr) checks::like_input(op, "z", *zt, input);
  const c10::cuda::CUDAGuard device_guard(input.device());
  at::Tensor grad = at::empty(input.sizes(), input.options());
  const int64_t numel = input.numel();
  if (numel == 0) return grad;
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_input_weight(op, input.scalar_type(), weight, [&](auto t, auto wt) {
    using T = typename decltype(t)::type;
    using W = typename decltype(wt)::type;
    using A = acc_t<T>;
    const T* x = static_cast<const T*>(input.const_data_ptr());
    const T* dy = static_cast<const T*>(grad_output.const_data_ptr());
    const T* zp = zt != nullptr ? static_cast<const T*>(zt->const_data_ptr()) : nullptr;
    T* out = static_cast<T*>(grad.data_ptr());
    dispatch_vector<T>(pick_vector<T>(channels, {x, dy, zp, out}), [&](auto v) {
      constexpr int V = decltype(v)::value;
      const int64_t rows = numel / channels;
      const TileLaunch launch = channels_last_launch(channels / V, rows, 1);
      relu_backward_channels_last<T, W, V><<<launch.grid, launch.block, 0, stream>>>(
          dy, x, zp, mean.const_data_ptr<A>(), invstd.const_data_ptr<A>(), optional_ptr<W>(weight),
          optional_ptr<W>(bias), out, rows, channels);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return grad;
}

}  // namespace apex_parallel

