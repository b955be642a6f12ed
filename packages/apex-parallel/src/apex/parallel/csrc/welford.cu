// welford_mean_var, welford_mean_var_c_last: this rank's per-channel mean and biased variance,
// reading the input once; welford_parallel: the count-weighted merge of every rank's statistics
// and the running-statistics update. See _reference.welford_mean_var / welford_parallel.
//
// Channels-first: a block per (channel, chunk of the channel's N * L elements), each thread
// folding kUnroll units (V elements each) at a time into its Welford state as one batch.
// Channels-last: a block per (tile of channel units, chunk of rows); bx threads across
// channels read whole 16-byte vectors of a row, by threads go down the rows; the by states of
// a channel merge in shared memory in a fixed tree order; each thread merges its rows into its
// state through shifted sums every kFlushRows rows. More than one chunk: partials
// [chunks, C] and a second kernel that merges them in chunk order.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>
#include <tuple>

#include "syncbn_common.cuh"
#include "cuda_ops.h"

namespace apex_parallel {
namespace {

template <typename A>
using Welford = apex::Welford<A>;

template <typename A>
struct WelfordOut {
  A* mean;              // [C], or null when writing partials
  A* var;               // [C]
  Welford<A>* partial;  // [chunks, C]
};

template <typename A>
__device__ __forceinline__ void write_welford(const WelfordOut<A>& out, const Welford<A>& w, int64_t chunk, int64_t c,
                                              int64_t channels) {
  if (out.partial != nullptr) {
    out.partial[chunk * channels + c] = w;
  } else {
    out.mean[c] = w.mean;
    out.var[c] = w.variance(false);
  }
}

template <typename T, int V, typename A = acc_t<T>>
__global__ void __launch_bounds__(kThreads) welford_channels_first(const T* __restrict__ input, int64_t channels,
                                                                   int64_t plane_units, int64_t units,
                                                                   int64_t per_chunk, PlaneStep step,
                                                                   WelfordOut<A> out) {
  __shared__ Welford<A> shared[apex::kWarpSize];
  const int64_t c = blockIdx.x;
  const int64_t chunk = blockIdx.y;
  const int64_t begin = chunk * per_chunk;
  const int64_t end = begin + per_chunk < units ? begin + per_chunk : units;
  Welford<A> w{};
  int64_t j = begin + threadIdx.x;
  PlaneCursor cursor{j / plane_units, j % plane_units};
  const int64_t plane = plane_units * V;
  for (; j < end; j += static_cast<int64_t>(kUnroll) * blockDim.x) {
    Packed<T, V> packed[kUnroll];
    bool ok[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      ok[u] = j + u * static_cast<int64_t>(blockDim.x) < end;
      packed[u] = load_packed<V>(input, (cursor.n * channels + c) * plane + cursor.l * V, ok[u]);
      cursor.advance(step, plane_units);
    }
    A x[kUnroll * V];
    bool valid[kUnroll * V];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      A v[V];
      unpack(v, packed[u]);  // zeros where not ok
#pragma unroll
      for (int k = 0; k < V; ++k) {
        x[u * V + k] = v[k];
        valid[u * V + k] = ok[u];
      }
    }
    welford_batch(w, x, valid);
  }
  w = apex::block_welford(w, shared);
  if (threadIdx.x == 0) write_welford(out, w, chunk, c, channels);
}

// Rows a channels-last thread folds into shifted sums before it merges them into its state.
constexpr int kFlushRows = 8 * kUnroll;
// Blocks of the channels-last kernel a multiprocessor holds (its registers: 80 at most for float
// statistics; double's four-wide vectors would spill there, so they get what they need).
template <typename A>
constexpr int kWelfordLastBlocks = std::is_same_v<A, double> ? 1 : 3;

// The end of the channels-last kernel: the by states of each channel unit merge down
// threadIdx.y in shared memory (slot (y, x, k)) in a fixed tree order; row 0 writes them.
template <int V, typename A>
__device__ __forceinline__ void write_rows_merged(Welford<A> (&shared)[kThreads * V], const Welford<A> (&w)[V],
                                                  bool active, int64_t cu, int64_t channels,
                                                  const WelfordOut<A>& out) {
  const int slot = (threadIdx.y * blockDim.x + threadIdx.x) * V;
#pragma unroll
  for (int k = 0; k < V; ++k) shared[slot + k] = w[k];
  for (int half = blockDim.y / 2; half > 0; half /= 2) {
    __syncthreads();
    if (threadIdx.y < half) {
      const int other = slot + half * blockDim.x * V;
#pragma unroll
      for (int k = 0; k < V; ++k) shared[slot + k] = apex::welford_merge(shared[slot + k], shared[other + k]);
    }
  }
  if (threadIdx.y == 0 && active) {
#pragma unroll
    for (int k = 0; k < V; ++k) write_welford(out, shared[slot + k], blockIdx.y, cu * V + k, channels);
  }
}

template <typename T, int V, typename A = acc_t<T>>
__global__ void __launch_bounds__(kThreads, kWelfordLastBlocks<A>)
    welford_channels_last(const T* __restrict__ input, int64_t rows, int64_t channels, WelfordOut<A> out) {
  __shared__ Welford<A> shared[kThreads * V];
  const int64_t channel_units = channels / V;
  const int64_t cu = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const bool active = cu < channel_units;
  // The thread's state: V means and M2s over `count` rows (the same rows for every channel). After
  // the first kUnroll rows (an exact two-pass batch), rows go into sums of x - mean (s1) and of its
  // square (s2) with the mean as it stood, and every kFlushRows rows those sums are merged in: a
  // division or two per kFlushRows * V elements instead of per kUnroll (a merge per few rows made
  // this kernel compute-bound at half the bandwidth). The shift is the running mean, so the sums
  // stay small and s2 - s1^2 / n cancels no more than the two-pass batch does.
  A mean[V] = {}, m2[V] = {}, s1[V] = {}, s2[V] = {};
  A count = A(0), pending = A(0);
  const auto flush = [&]() {
    if (pending == A(0)) return;
    const A total = count + pending;
    const A inv_pending = A(1) / pending;
    const A b_weight = pending / total;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const A delta = s1[k] * inv_pending;  // the batch's mean minus the shift (the state's mean)
      const A batch_m2 = s2[k] - s1[k] * delta;
      mean[k] += delta * b_weight;
      m2[k] += (batch_m2 > A(0) ? batch_m2 : A(0)) + delta * delta * count * b_weight;
      s1[k] = s2[k] = A(0);
    }
    count = total;
    pending = A(0);
  };
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t r = blockIdx.y * static_cast<int64_t>(blockDim.y) + threadIdx.y; active && r < rows;
       r += kUnroll * row_step) {
    // The rows stay packed until used (as floats they would not fit in kWelfordLastBlocks' registers).
    Packed<T, V> packed[kUnroll];
    bool ok[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      ok[u] = r + u * row_step < rows;
      packed[u] = load_packed<V>(input, (r + u * row_step) * channels + cu * V, ok[u]);
    }
    if (count == A(0)) {
      A x[kUnroll][V];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) unpack(x[u], packed[u]);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        A column[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) column[u] = ok[u] ? x[u][k] : A(0);
        Welford<A> w{};
        welford_batch(w, column, ok);
        mean[k] = w.mean;
        m2[k] = w.m2;
        count = w.count;
      }
      continue;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!ok[u]) continue;
      A x[V];
      unpack(x, packed[u]);
      pending += A(1);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const A d = x[k] - mean[k];
        s1[k] += d;
        s2[k] = fma(d, d, s2[k]);
      }
    }
    if (pending >= A(kFlushRows)) flush();
  }
  flush();
  Welford<A> w[V];
#pragma unroll
  for (int k = 0; k < V; ++k) w[k] = Welford<A>{mean[k], m2[k], count};
  write_rows_merged(shared, w, active, cu, channels, out);
}

template <typename A>
__global__ void __launch_bounds__(apex::kWarpSize* kFinalizeLanes)
    welford_finalize(const Welford<A>* __restrict__ partial, int64_t chunks, int64_t channels, A* __restrict__ mean,
                     A* __restrict__ var) {
  __shared__ Welford<A> lanes[kFinalizeLanes][apex::kWarpSize + 1];
  const int64_t c = blockIdx.x * static_cast<int64_t>(apex::kWarpSize) + threadIdx.x;
  Welford<A> w{};
  if (c < channels) {
    for (int64_t k = threadIdx.y; k < chunks; k += kFinalizeLanes) w = apex::welford_merge(w, partial[k * channels + c]);
  }
  lanes[threadIdx.y][threadIdx.x] = w;
  for (int half = kFinalizeLanes / 2; half > 0; half /= 2) {
    __syncthreads();
    if (static_cast<int>(threadIdx.y) < half) {
      lanes[threadIdx.y][threadIdx.x] =
          apex::welford_merge(lanes[threadIdx.y][threadIdx.x], lanes[threadIdx.y + half][threadIdx.x]);
    }
  }
  if (threadIdx.y == 0 && c < channels) {
    mean[c] = lanes[0][threadIdx.x].mean;
    var[c] = lanes[0][threadIdx.x].variance(false);
  }
}

std::tuple<at::Tensor, at::Tensor> welford(const char* op, const at::Tensor& input, bool channel_last) {
  const int64_t channels = checks::input(op, input, channel_last);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const auto stats = input.options().dtype(stat_dtype(input.scalar_type()));
  const int64_t numel = input.numel();
  if (numel == 0) return {at::zeros({channels}, stats), at::zeros({channels}, stats)};
  at::Tensor mean = at::empty({channels}, stats);
  at::Tensor var = at::empty({channels}, stats);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t per_channel = numel / channels;
  at::Tensor partial;
  dispatch_input(op, input.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* x = static_cast<const T*>(input.const_data_ptr());
    if (!channel_last) {
      const int64_t plane = per_channel / input.size(0);
      dispatch_vector<T>(pick_vector<T>(plane, {x}), [&](auto v) {
        constexpr int V = decltype(v)::value;
        const int64_t plane_units = plane / V;
        const int64_t units = input.size(0) * plane_units;
        const int64_t chunks = chunks_for(channels, units, static_cast<int64_t>(kThreads) * kUnroll);
        const int64_t per_chunk = ceil_div(units, chunks);
        WelfordOut<A> out{mean.data_ptr<A>(), var.data_ptr<A>(), nullptr};
        if (chunks > 1) {
          partial = at::empty({chunks * channels * 3}, stats);
          out.partial = reinterpret_cast<Welford<A>*>(partial.data_ptr<A>());
        }
        const dim3 grid(static_cast<unsigned>(channels), static_cast<unsigned>(chunks));
        welford_channels_first<T, V><<<grid, kThreads, 0, stream>>>(x, channels, plane_units, units, per_chunk,
                                                                    plane_step(kThreads, plane_units), out);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (chunks > 1) {
          welford_finalize<A><<<finalize_grid(channels), finalize_block(), 0, stream>>>(
              out.partial, chunks, channels, out.mean, out.var);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      });
    } else {
      dispatch_vector<T>(pick_vector<T>(channels, {x}), [&](auto v) {
        constexpr int V = decltype(v)::value;
        const int64_t rows = per_channel;
        const TileShape tile = tile_shape(channels / V);
        const int64_t tiles = ceil_div(channels / V, tile.bx);
        // As many chunks as fill the device at the kernel's own occupancy (its registers allow
        // fewer than full_grid()'s eight blocks a multiprocessor: a ninth of a wave left over
        // cost as much as a whole one), each thread with at least two flushes' rows.
        const auto* kernel = reinterpret_cast<const void*>(&welford_channels_last<T, V>);
        const int64_t resident = static_cast<int64_t>(sm_count()) * apex::resident_blocks(kernel, kThreads, 0);
        const int64_t useful = std::max<int64_t>(rows / (2 * static_cast<int64_t>(tile.by) * kFlushRows), 1);
        const int64_t chunks = std::min<int64_t>({ceil_div(resident, tiles), useful, kMaxChunks, 65535});
        WelfordOut<A> out{mean.data_ptr<A>(), var.data_ptr<A>(), nullptr};
        if (chunks > 1) {
          partial = at::empty({chunks * channels * 3}, stats);
          out.partial = reinterpret_cast<Welford<A>*>(partial.data_ptr<A>());
        }
        const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(chunks));
        const dim3 block(tile.bx, tile.by);
        welford_channels_last<T, V><<<grid, block, 0, stream>>>(x, rows, channels, out);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (chunks > 1) {
          welford_finalize<A><<<finalize_grid(channels), finalize_block(), 0, stream>>>(
              out.partial, chunks, channels, out.mean, out.var);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      });
    }
  });
  return {mean, var};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> welford_mean_var_cuda(const at::Tensor& input) {
  return welford("welford_mean_var", input, false);
}

std::tuple<at::Tensor, at::Tensor> welford_mean_var_c_last_cuda(const at::Tensor& input) {
  return welford("welford_mean_var_c_last", input, true);
}

namespace {

// welford_parallel ---------------------------------------------------------------------------

template <typename A, typename R>
__global__ void welford_parallel_kernel(const A* __restrict__ mean, int64_t mean_stride, const A* __restrict__ var,
                                        int64_t var_stride, const A* __restrict__ count, int64_t count_stride,
                                        int64_t ranks, int64_t channels, A eps, R* running_mean, R* running_var,
                                        A momentum, A* __restrict__ merged_mean, A* __restrict__ invstd) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= channels) return;
  Welford<A> w{};
  for (int64_t r = 0; r < ranks; ++r) {
    Welford<A> rank{};
    rank.count = count[r * count_stride];
    rank.mean = mean[r * mean_stride + c];
    rank.m2 = var[r * var_stride + c] * rank.count;
    w = apex::welford_merge(w, rank);
  }
  merged_mean[c] = w.mean;
  invstd[c] = A(1) / sqrt(w.variance(false) + eps);
  if (running_mean != nullptr) {
    const A unbiased = w.m2 / (w.count - A(1));
    running_mean[c] = static_cast<R>(static_cast<A>(running_mean[c]) * (A(1) - momentum) + w.mean * momentum);
    running_var[c] = static_cast<R>(static_cast<A>(running_var[c]) * (A(1) - momentum) + unbiased * momentum);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> welford_parallel_cuda(const at::Tensor& mean, const at::Tensor& var_biased,
                                                         const at::Tensor& count, double eps,
                                                         const std::optional<at::Tensor>& running_mean,
                                                         const std::optional<at::Tensor>& running_var,
                                                         double momentum) {
  const char* op = "welford_parallel";
  TORCH_CHECK_TYPE(mean.scalar_type() == c10::kFloat || mean.scalar_type() == c10::kDouble, op,
                   ": mean has dtype ", checks::torch_dtype(mean.scalar_type()),
                   "; expected torch.float32 or torch.float64");
  TORCH_CHECK_TYPE(var_biased.scalar_type() == mean.scalar_type(), op, ": var_biased has dtype ",
                   checks::torch_dtype(var_biased.scalar_type()), " but mean has ",
                   checks::torch_dtype(mean.scalar_type()));
  TORCH_CHECK_VALUE(mean.dim() == 2, op, ": mean must be 2-D (ranks, channels), got shape ",
                    apex::checks::shape_string(mean.sizes()));
  TORCH_CHECK_VALUE(var_biased.sizes().equals(mean.sizes()), op, ": var_biased has shape ",
                    apex::checks::shape_string(var_biased.sizes()), " but mean has ",
                    apex::checks::shape_string(mean.sizes()));
  const c10::Device device = mean.device();
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"mean", mean}, {"var_biased", var_biased}}) {
    checks::placed(op, name, t, device);
    TORCH_CHECK_VALUE(t.size(1) <= 1 || t.stride(1) == 1, op, ": ", name,
                      " must have unit stride in its last dimension");
  }
  checks::count(op, count, device);
  const int64_t ranks = mean.size(0);
  const int64_t channels = mean.size(1);
  TORCH_CHECK_VALUE(count.size(0) == ranks, op, ": count has ", count.size(0), " elements, expected one per rank (",
                    ranks, ")");
  const at::Tensor* rm = optional_tensor(running_mean);
  const at::Tensor* rv = optional_tensor(running_var);
  TORCH_CHECK_VALUE((rm == nullptr) == (rv == nullptr), op, ": running_mean and running_var must be given together");
  if (rm != nullptr) {
    TORCH_CHECK_TYPE(apex::checks::contains(apex::checks::kFloatDtypes, rm->scalar_type()) ||
                         rm->scalar_type() == c10::kDouble,
                     op, ": running_mean has dtype ", checks::torch_dtype(rm->scalar_type()),
                     "; expected one of float32, float16, bfloat16, float64");
    TORCH_CHECK_TYPE(rv->scalar_type() == rm->scalar_type(), op, ": running_var has dtype ",
                     checks::torch_dtype(rv->scalar_type()), " but running_mean has ",
                     checks::torch_dtype(rm->scalar_type()));
    for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"running_mean", rm}, {"running_var", rv}}) {
      TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == channels, op, ": ", name, " has shape ",
                        apex::checks::shape_string(t->sizes()), ", expected ", checks::channels_shape(channels));
      checks::dense(op, name, *t, device);
    }
  }

  const c10::cuda::CUDAGuard device_guard(device);
  const auto stats = mean.options().dtype(mean.scalar_type());
  at::Tensor merged = at::empty({channels}, stats);
  at::Tensor invstd = at::empty({channels}, stats);
  if (channels == 0) return {merged, invstd};
  // the counts in the statistics' dtype (a float32 count with float64 statistics, or the reverse)
  const at::Tensor counts = count.scalar_type() == mean.scalar_type() ? count : count.to(mean.scalar_type());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto running_dtype = rm != nullptr ? rm->scalar_type() : mean.scalar_type();
  auto launch = [&](auto stat_tag) {
    using A = typename decltype(stat_tag)::type;
    dispatch_input(op, running_dtype, [&](auto tag) {
      using R = typename decltype(tag)::type;
      welford_parallel_kernel<A, R><<<static_cast<unsigned>(ceil_div(channels, kThreads)), kThreads, 0, stream>>>(
          mean.const_data_ptr<A>(), mean.stride(0), var_biased.const_data_ptr<A>(), var_biased.stride(0),
          counts.const_data_ptr<A>(), counts.stride(0), ranks, channels, static_cast<A>(eps),
          rm != nullptr ? static_cast<R*>(rm->data_ptr()) : nullptr,
          rv != nullptr ? static_cast<R*>(rv->data_ptr()) : nullptr, static_cast<A>(momentum), merged.data_ptr<A>(),
          invstd.data_ptr<A>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  };
  if (mean.scalar_type() == c10::kDouble) {
    launch(apex::TypeTag<double>{});
  } else {
    launch(apex::TypeTag<float>{});
  }
  return {merged, invstd};
}

}  // namespace apex_parallel

