// Shared by the SyncBatchNorm kernels of apex-parallel: argument checks worded like
// apex/parallel/_ops.py, dtype and vector-width dispatch, the walk over a channels-first
// tensor, per-thread Welford batches, and launch helpers. The math is specified by
// apex/parallel/_reference.py.
//
// Layouts. Channels-first: (N, C, L) contiguous, L the product of the spatial sizes; a "unit"
// is V consecutive elements of one (n, c) plane (V divides L). Channels-last: (M, C)
// contiguous; a unit is V consecutive channels of one row (V divides C). Per-channel
// reductions write one partial per (chunk, channel), [chunks, C], merged in chunk order by a
// second kernel when there is more than one chunk: deterministic, no atomics.
//
// Precision. Statistics, sums and the arithmetic are float32 (A = float) for float32, float16 and
// bfloat16 inputs, float64 (A = double) for float64 inputs: acc_t<T>.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/ScalarType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/launch.cuh>
#include <apex/reductions.cuh>
#include <apex/vectorized.cuh>
#include <apex/welford.cuh>

namespace apex_parallel {

// The type of the statistics and of the arithmetic for inputs of type T.
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// The dtype of the statistics of an input of dtype `input`.
inline c10::ScalarType stat_dtype(c10::ScalarType input) {
  return input == c10::kDouble ? c10::kDouble : c10::kFloat;
}

constexpr int kThreads = 256;
// Units each thread loads before it uses any (memory-level parallelism).
constexpr int kUnroll = 4;
// Upper bound on the chunks one channel's reduction is split into.
constexpr int64_t kMaxChunks = 1024;

// Argument checks ---------------------------------------------------------------------------

namespace checks {

using apex::checks::dense;
using apex::checks::placed;
using apex::checks::torch_dtype;

inline std::string channels_shape(int64_t channels) { return "(" + std::to_string(channels) + ",)"; }

// Returns the number of channels.
inline int64_t input(const char* op, const at::Tensor& t, bool channel_last) {
  TORCH_CHECK_TYPE(apex::checks::contains(apex::checks::kFloatDtypes, t.scalar_type()) || t.scalar_type() == c10::kDouble,
                   op, ": input has dtype ", torch_dtype(t.scalar_type()),
                   "; expected one of float32, float16, bfloat16, float64");
  TORCH_CHECK_VALUE(t.dim() >= 2, op, ": input must have at least 2 dimensions, got shape ",
                    apex::checks::shape_string(t.sizes()));
  dense(op, "input", t, t.device());
  return channel_last ? t.size(-1) : t.size(1);
}

inline void like_input(const char* op, const char* name, const at::Tensor& t, const at::Tensor& input) {
  TORCH_CHECK_TYPE(t.scalar_type() == input.scalar_type(), op, ": ", name, " has dtype ", torch_dtype(t.scalar_type()),
                   " but input has ", torch_dtype(input.scalar_type()));
  TORCH_CHECK_VALUE(t.sizes().equals(input.sizes()), op, ": ", name, " has shape ",
                    apex::checks::shape_string(t.sizes()), " but input has ",
                    apex::checks::shape_string(input.sizes()));
  dense(op, name, t, input.device());
}

// A per-channel statistic of an input of dtype `input_dtype` (float32, or float64 for float64).
inline void channel_stat(const char* op, const char* name, const at::Tensor& t, int64_t channels,
                         c10::Device device, c10::ScalarType input_dtype) {
  const c10::ScalarType expected = stat_dtype(input_dtype);
  TORCH_CHECK_TYPE(t.scalar_type() == expected, op, ": ", name, " has dtype ", torch_dtype(t.scalar_type()),
                   "; expected ", torch_dtype(expected),
                   expected == c10::kDouble ? " (the input's statistics)" : "");
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == channels, op, ": ", name, " has shape ",
                    apex::checks::shape_string(t.sizes()), ", expected ", channels_shape(channels));
  dense(op, name, t, device);
}

inline void affine(const char* op, c10::ScalarType input_dtype, c10::Device device,
                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, int64_t channels) {
  const bool has_weight = weight.has_value() && weight->defined();
  if (has_weight) {
    const auto dtype = weight->scalar_type();
    TORCH_CHECK_TYPE(dtype == input_dtype || dtype == c10::kFloat, op, ": weight has dtype ", torch_dtype(dtype),
                     " but the input has ", torch_dtype(input_dtype), "; weight must be ",
                     input_dtype == c10::kFloat ? "float32" : apex::checks::dtype_name(input_dtype) + " or float32");
    TORCH_CHECK_VALUE(weight->dim() == 1 && weight->size(0) == channels, op, ": weight has shape ",
                      apex::checks::shape_string(weight->sizes()), ", expected ", channels_shape(channels));
    dense(op, "weight", *weight, device);
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(has_weight, op, ": bias given without weight");
    TORCH_CHECK_TYPE(bias->scalar_type() == weight->scalar_type(), op, ": bias has dtype ",
                     torch_dtype(bias->scalar_type()), " but weight has ", torch_dtype(weight->scalar_type()));
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == channels, op, ": bias has shape ",
                      apex::checks::shape_string(bias->sizes()), ", expected ", channels_shape(channels));
    dense(op, "bias", *bias, device);
  }
}

inline void count(const char* op, const at::Tensor& t, c10::Device device) {
  TORCH_CHECK_TYPE(t.scalar_type() == c10::kFloat || t.scalar_type() == c10::kDouble, op, ": count has dtype ",
                   torch_dtype(t.scalar_type()), "; expected torch.float32 or torch.float64");
  TORCH_CHECK_VALUE(t.dim() == 1, op, ": count must be 1-D (one count per rank), got shape ",
                    apex::checks::shape_string(t.sizes()));
  placed(op, "count", t, device);
}

// input, mean, invstd, weight and bias; returns the number of channels.
inline int64_t stats(const char* op, const at::Tensor& input_, const at::Tensor& mean, const at::Tensor& invstd,
                     const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                     bool channel_last) {
  const int64_t channels = input(op, input_, channel_last);
  channel_stat(op, "mean", mean, channels, input_.device(), input_.scalar_type());
  channel_stat(op, "invstd", invstd, channels, input_.device(), input_.scalar_type());
  affine(op, input_.scalar_type(), input_.device(), weight, bias, channels);
  return channels;
}

}  // namespace checks

using apex::optional_ptr;
using apex::optional_tensor;

// Dtype and vector-width dispatch -----------------------------------------------------------

// Calls f(TypeTag<T>) for the input's dtype: apex's float types, and double.
template <typename F>
void dispatch_input(const char* op, c10::ScalarType input, F&& f) {
  if (input == c10::kDouble) return f(apex::TypeTag<double>{});
  apex::dispatch_float_types(input, op, "input", f);
}

// Calls f(TypeTag<T>, TypeTag<W>): T the input's type, W the weight's (float without a weight).
template <typename F>
void dispatch_input_weight(const char* op, c10::ScalarType input, const std::optional<at::Tensor>& weight, F&& f) {
  const at::Tensor* w = optional_tensor(weight);
  const bool float_weight = w == nullptr || w->scalar_type() == c10::kFloat;
  dispatch_input(op, input, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (float_weight || std::is_same_v<T, float>) {
      f(tag, apex::TypeTag<float>{});
    } else {
      f(tag, apex::TypeTag<T>{});
    }
  });
}

// The widest V <= 16 bytes of T that divides `inner` and to which every pointer (null: absent) is
// aligned.
template <typename T>
inline int pick_vector(int64_t inner, std::initializer_list<const void*> pointers) {
  for (int v = apex::vector_width<T>(); v > 1; v /= 2) {
    bool ok = inner % v == 0;
    for (const void* p : pointers) ok = ok && apex::aligned_to(p, v * sizeof(T));
    if (ok) return v;
  }
  return 1;
}

// Calls f(std::integral_constant<int, V>) for the run-time width v (a power of two).
template <typename T, typename F>
void dispatch_vector(int v, F&& f) {
  if constexpr (apex::vector_width<T>() >= 8) {
    if (v == 8) return f(std::integral_constant<int, 8>{});
  }
  if (v == 4) return f(std::integral_constant<int, 4>{});
  if (v == 2) return f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, 1>{});
}

// Vector access -----------------------------------------------------------------------------

// N elements of T from p (aligned to N elements) as A (acc_t<T>), in one access; and back.
template <int N, typename T, typename A>
__device__ __forceinline__ void load_values(A (&dst)[N], const T* p) {
  if constexpr (std::is_same_v<A, float>) {
    apex::load_floats<N>(dst, p);
  } else {
    const auto v = apex::load_vector<T, N>(p);
#pragma unroll
    for (int j = 0; j < N; ++j) dst[j] = static_cast<A>(v.val[j]);
  }
}

template <int N, typename T, typename A>
__device__ __forceinline__ void store_values(T* p, const A (&src)[N]) {
  if constexpr (std::is_same_v<A, float>) {
    apex::store_floats<N>(p, src);
  } else {
    apex::AlignedVector<T, N> v;
#pragma unroll
    for (int j = 0; j < N; ++j) v.val[j] = static_cast<T>(src[j]);
    *reinterpret_cast<apex::AlignedVector<T, N>*>(p) = v;
  }
}

// Rows a channels-last reduce or backward thread loads at once: kUnroll, or two for the fused-ReLU
// variants, which also load z and hold the mask's per-channel constants (with four rows of three
// tensors they took 131-145 registers, one block a multiprocessor; held to 128, they spilled).
constexpr int rows_in_flight(bool relu) { return relu ? 2 : kUnroll; }
// Blocks a multiprocessor holds of those kernels: two, i.e. 128 registers at most.
constexpr int kRowsInFlightBlocks = 2;

// A row's V elements of T as loaded. The kernels that unroll over rows load every row's vectors
// into these first and convert them afterwards: `if (in range) load_values(x[u], ...)` with the
// conversion (and the ReLU mask) in the same row's branch compiled (nvcc 13.0, sm_90a) into a
// branch per row whose loads reused the previous row's registers, so each thread had one row's
// loads in flight (16-48 bytes): on the H200 the channels-last Welford kernel took 2.1 passes of
// time for its one read, the reduction with z 4.0 for three. Loaded under a predicate and used
// after, the rows' loads issue back to back (checked in the SASS; not yet timed: no GPU was lent).
template <typename T, int V>
using Packed = apex::AlignedVector<T, V>;

// The vector at base + offset when `ok`, else zeros (0 in every floating type once unpacked);
// base may then be null and is not read.
template <int V, typename T>
__device__ __forceinline__ Packed<T, V> load_packed(const T* base, int64_t offset, bool ok) {
  // Zeroed as whole words: element-wise zeros of 16-bit types compiled to byte permutes, which
  // also kept the loads apart again.
  Packed<T, V> v;
  memset(&v, 0, sizeof(v));
  if (ok) v = apex::load_vector_whole<T, V>(base + offset);
  return v;
}

// The elements of a packed vector in the arithmetic type.
template <int V, typename T, typename A>
__device__ __forceinline__ void unpack(A (&dst)[V], const Packed<T, V>& v) {
  if constexpr (std::is_same_v<A, float>) {
    apex::to_floats(dst, v);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) dst[k] = static_cast<A>(v.val[k]);
  }
}

template <typename W, typename A>
__device__ __forceinline__ A load_or(const W* p, int64_t i, A fallback) {
  return p != nullptr ? static_cast<A>(p[i]) : fallback;
}

// Walks over channels-first tensors ---------------------------------------------------------

// A stride through the units of one channel (plane n, unit l of the plane), split once on
// the host so that stepping needs no division.
struct PlaneStep {
  int64_t planes;
  int64_t units;
};

inline PlaneStep plane_step(int64_t step, int64_t plane_units) { return {step / plane_units, step % plane_units}; }

struct PlaneCursor {
  int64_t n;
  int64_t l;

  __device__ __forceinline__ void advance(const PlaneStep& s, int64_t plane_units) {
    l += s.units;
    if (l >= plane_units) {
      l -= plane_units;
      ++n;
    }
    n += s.planes;
  }
};

// A stride through all units of a channels-first tensor, tracking the channel.
struct ChannelStep {
  int64_t channels;  // whole planes stepped, modulo C
  int64_t units;
};

inline ChannelStep channel_step(int64_t step, int64_t plane_units, int64_t channels) {
  return {(step / plane_units) % channels, step % plane_units};
}

struct ChannelCursor {
  int64_t c;
  int64_t l;

  __device__ __forceinline__ void advance(const ChannelStep& s, int64_t plane_units, int64_t channels) {
    l += s.units;
    int64_t carry = 0;
    if (l >= plane_units) {
      l -= plane_units;
      carry = 1;
    }
    c += s.channels + carry;
    if (c >= channels) c -= channels;
  }
};

// Welford batches ---------------------------------------------------------------------------

// Merges `count` values (the valid ones of x) into w as one batch: its exact mean and sum of
// squared deviations, then Chan's merge (one division per batch, not per element).
template <int N, typename A>
__device__ __forceinline__ void welford_batch(apex::Welford<A>& w, const A (&x)[N], const bool (&valid)[N]) {
  A sum = A(0);
  A count = A(0);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (valid[i]) {
      sum += x[i];
      count += A(1);
    }
  }
  if (count == A(0)) return;
  apex::Welford<A> batch{};
  batch.mean = sum / count;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (valid[i]) {
      const A d = x[i] - batch.mean;
      batch.m2 += d * d;
    }
  }
  batch.count = count;
  w = apex::welford_merge(w, batch);
}

// Launch helpers ----------------------------------------------------------------------------

using apex::ceil_div;
using apex::next_power_of_two;
using apex::sm_count;

// Blocks of kThreads that keep every multiprocessor full.
inline int64_t full_grid() { return static_cast<int64_t>(sm_count()) * (2048 / kThreads); }

// Chunks per channel (or per tile of channels) for the reductions: enough blocks to fill the
// device, each with at least two sweeps of its threads' work.
inline int64_t chunks_for(int64_t blocks_per_chunk, int64_t work_per_channel, int64_t work_per_sweep) {
  const int64_t wanted = ceil_div(full_grid(), std::max<int64_t>(blocks_per_chunk, 1));
  const int64_t useful = std::max<int64_t>(work_per_channel / (2 * work_per_sweep), 1);
  return std::min({wanted, useful, kMaxChunks});
}

// A channels-last block: bx threads over channel units (a power of two up to a warp), by rows.
struct TileShape {
  int bx;
  int by;
};

inline TileShape tile_shape(int64_t channel_units) {
  const int bx = static_cast<int>(std::min<int64_t>(next_power_of_two(channel_units), apex::kWarpSize));
  return {bx, kThreads / bx};
}

// Launch geometry of the elementwise kernels. Channels first: a grid-stride loop over `units`
// vectors, kUnroll per thread and sweep, with the channel step of one sweep.
struct FlatLaunch {
  int64_t grid;
  ChannelStep step;
};

inline FlatLaunch channels_first_launch(int64_t units, int64_t plane_units, int64_t channels) {
  const int64_t grid = std::min(ceil_div(units, static_cast<int64_t>(kThreads) * kUnroll), full_grid());
  return {grid, channel_step(grid * kThreads, plane_units, channels)};
}

// Channels last: blocks of tile_shape() threads over tiles of channel units, walking the rows
// (`rows_per_thread` at a time) with as many row blocks as fill the device.
struct TileLaunch {
  dim3 grid;
  dim3 block;
};

inline TileLaunch channels_last_launch(int64_t channel_units, int64_t rows, int rows_per_thread) {
  const TileShape tile = tile_shape(channel_units);
  const int64_t tiles = ceil_div(channel_units, tile.bx);
  const int64_t row_blocks = std::min<int64_t>(
      {ceil_div(rows, static_cast<int64_t>(tile.by) * rows_per_thread), ceil_div(full_grid(), tiles), 65535});
  return {dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(row_blocks)), dim3(tile.bx, tile.by)};
}

// Merging the [chunks, C] partials of a reduction: a block of (32 channels, kFinalizeLanes
// lanes); lane y takes chunks y, y + kFinalizeLanes, ... in order, then the lanes are merged in
// a fixed tree, so the result is the same on every run. (One thread per channel walking all
// chunks was slow for few channels with many chunks, e.g. C = 64 channels-last.)
constexpr int kFinalizeLanes = 32;

inline dim3 finalize_grid(int64_t channels) { return dim3(static_cast<unsigned>(ceil_div(channels, apex::kWarpSize))); }
inline dim3 finalize_block() { return dim3(apex::kWarpSize, kFinalizeLanes); }

// Sums a 1-D (strided) count tensor over the block; every thread gets the sum.
template <typename A>
__device__ __forceinline__ A block_count(const A* count, int64_t n, int64_t stride, A* shared) {
  A sum = A(0);
  const int tid = threadIdx.x + threadIdx.y * blockDim.x;
  const int threads = blockDim.x * blockDim.y;
  for (int64_t i = tid; i < n; i += threads) sum += count[i * stride];
  // block_sum indexes warps by threadIdx.x; a flat 1-D view of the block is what it needs.
  const int lane = tid % apex::kWarpSize;
  const int warp = tid / apex::kWarpSize;
  const int warps = threads / apex::kWarpSize;
  __syncthreads();
  sum = apex::warp_sum(sum);
  if (lane == 0) shared[warp] = sum;
  __syncthreads();
  sum = lane < warps ? shared[lane] : A(0);
  return apex::warp_sum(sum);
}

}  // namespace apex_parallel
