// Shared by the layer norm / RMS norm kernels of apex-normalization: argument checks worded like
// apex/normalization/_ops.py, the dtype combinations the kernels are built for, row groups and
// their reductions, and the threads a row takes. The math is specified by
// apex/normalization/_reference.py.
//
// Rows and row groups. A row (the last dimensions of the input, `hidden` elements) is handled by
// a group of threads: a power of two of at most 32 lanes (several rows per warp, reductions by
// shuffles only) or a multiple of 32 threads (shuffles, then shared memory and a barrier: the
// whole block, or a named barrier per group when a block holds several groups). Every thread of
// a group ends a reduction with the same bits, so the statistics a row is normalized with are
// the ones that are saved. Blocks walk over tiles of rows (grid-stride), so every thread of a
// block runs the same number of iterations and barriers stay uniform.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/ScalarType.h>
#include <c10/macros/Macros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include <apex/async_copy.cuh>
#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/launch.cuh>
#include <apex/reductions.cuh>
#include <apex/vectorized.cuh>
#include <apex/welford.cuh>

namespace apex_normalization {

constexpr int kWarp = apex::kWarpSize;
constexpr int kMaxThreads = 1024;
// Named barriers 1..15 serve the row groups of a block (0 is __syncthreads).
constexpr int kMaxBarrierGroups = 15;
// Threads per block of the streaming (any size) kernels: at most 128 registers per thread.
constexpr int kStreamingThreads = 512;

// Argument checks ---------------------------------------------------------------------------

namespace checks {

using apex::checks::torch_dtype;

using apex::checks::dense;

// `t` ends with normalized_shape; returns the number of normalized elements per row.
inline int64_t normalized(const char* op, const char* name, const at::Tensor& t, c10::IntArrayRef shape) {
  TORCH_CHECK_VALUE(!shape.empty(), op, ": normalized_shape must have at least one dimension");
  const int64_t ndim = static_cast<int64_t>(shape.size());
  const bool ends_with = t.dim() >= ndim && t.sizes().slice(t.dim() - ndim).equals(shape);
  TORCH_CHECK_VALUE(ends_with, op, ": ", name, " of shape ", apex::checks::shape_string(t.sizes()),
                    " does not end with normalized_shape ", apex::checks::shape_string(shape));
  const int64_t hidden = c10::multiply_integers(shape);
  TORCH_CHECK_VALUE(hidden > 0, op, ": normalized_shape ", apex::checks::shape_string(shape), " has no elements");
  return hidden;
}

inline void affine(const char* op, c10::ScalarType input_dtype, c10::Device device,
                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                   c10::IntArrayRef shape, bool rms) {
  const bool has_weight = weight.has_value() && weight->defined();
  if (has_weight) {
    const auto dtype = weight->scalar_type();
    TORCH_CHECK_TYPE(dtype == input_dtype || dtype == c10::kFloat, op, ": weight has dtype ", torch_dtype(dtype),
                     " but the input has ", torch_dtype(input_dtype), "; weight must be ",
                     input_dtype == c10::kFloat ? "float32" : apex::checks::dtype_name(input_dtype) + " or float32");
    TORCH_CHECK_VALUE(weight->sizes().equals(shape), op, ": weight has shape ",
                      apex::checks::shape_string(weight->sizes()), ", expected normalized_shape ",
                      apex::checks::shape_string(shape));
    dense(op, "weight", *weight, device);
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(!rms, op, ": RMS norm takes no bias");
    TORCH_CHECK_VALUE(has_weight, op, ": bias given without weight");
    TORCH_CHECK_TYPE(bias->scalar_type() == weight->scalar_type(), op, ": bias has dtype ",
                     torch_dtype(bias->scalar_type()), " but weight has ", torch_dtype(weight->scalar_type()));
    TORCH_CHECK_VALUE(bias->sizes().equals(shape), op, ": bias has shape ", apex::checks::shape_string(bias->sizes()),
                      ", expected normalized_shape ", apex::checks::shape_string(shape));
    dense(op, "bias", *bias, device);
  }
}

inline void float_dtype(const char* op, const char* what, c10::ScalarType dtype) {
  // float64 as upstream: computed by norm_float64.cpp, not by the kernels
  TORCH_CHECK_TYPE(apex::checks::contains(apex::checks::kFloatDtypes, dtype) || dtype == c10::kDouble, op, ": ",
                   what, " ", torch_dtype(dtype), "; expected one of float32, float16, bfloat16, float64");
}

}  // namespace checks

using apex::optional_ptr;
using apex::optional_tensor;

// Dtype combinations ------------------------------------------------------------------------
//
// T input (and grad_input, residual), W weight and bias, O output (and grad_output), S the
// tensor saved for backward (the input, or the output when memory_efficient). W is T or float;
// O is T or W; S is T or O. Without a weight W is T. Calls f(TypeTag<T>, <W>, <O>, <S>).
template <typename F>
void dispatch_norm_types(const char* op, c10::ScalarType input, c10::ScalarType weight, c10::ScalarType output,
                         c10::ScalarType saved, F&& f) {
  apex::dispatch_float_types(input, op, "input", [&](auto input_tag) {
    using T = typename decltype(input_tag)::type;
    using apex::TypeTag;
    if constexpr (std::is_same_v<T, float>) {
      f(TypeTag<float>{}, TypeTag<float>{}, TypeTag<float>{}, TypeTag<float>{});
    } else {
      if (weight != c10::kFloat) {
        f(TypeTag<T>{}, TypeTag<T>{}, TypeTag<T>{}, TypeTag<T>{});
      } else if (output != c10::kFloat) {
        f(TypeTag<T>{}, TypeTag<float>{}, TypeTag<T>{}, TypeTag<T>{});
      } else if (saved != c10::kFloat) {
        f(TypeTag<T>{}, TypeTag<float>{}, TypeTag<float>{}, TypeTag<T>{});
      } else {
        f(TypeTag<T>{}, TypeTag<float>{}, TypeTag<float>{}, TypeTag<float>{});
      }
    }
  });
}

// Vector access -----------------------------------------------------------------------------

template <typename T, int N>
using Vec = apex::AlignedVector<T, N>;

using apex::aligned16;
using apex::load_floats;
using apex::load_vector;
using apex::store_floats;
using apex::store_vector_plain;
using apex::to_floats;

using apex::copy_async16;
using apex::copy_async_commit;
using apex::copy_async_wait;
using apex::stage;
using apex::unstage;

// Row groups and their reductions -----------------------------------------------------------

// kNamedBarriers: groups of several warps that share a block synchronize with a named barrier
// each (`bar.sync id, threads`). The id is a run-time value, so the compiler reserves all 16
// barriers for the kernel, and a multiprocessor then holds at most 4 of its blocks whatever their
// size (Nsight Compute: "Block Limit Barriers 4"). Kernels whose multi-warp groups fill their
// block take BlockRowGroup, which synchronizes with __syncthreads() alone.
template <bool kNamedBarriers>
struct BasicRowGroup {
  int threads;  // per row: a power of two <= 32, or a multiple of 32
  int lane;     // this thread's index in its group
  int index;    // the group's index in the block
  int count;    // groups per block

  // Groups of a power of two threads (every group of at most a warp) are indexed with shifts: the
  // divisions would precede a small problem's first loads.
  __device__ __forceinline__ explicit BasicRowGroup(int group_threads) : threads(group_threads) {
    const int tid = static_cast<int>(threadIdx.x);
    const int block = static_cast<int>(blockDim.x);
    if ((group_threads & (group_threads - 1)) == 0) {
      const int shift = __ffs(group_threads) - 1;
      lane = tid & (group_threads - 1);
      index = tid >> shift;
      count = block >> shift;
    } else {
      lane = tid % group_threads;
      index = tid / group_threads;
      count = block / group_threads;
    }
  }

  // A barrier over this group's threads (groups of more than one warp only). Without named
  // barriers it is a block barrier: right as long as every group of the block reaches it.
  __device__ __forceinline__ void sync() const {
    if constexpr (kNamedBarriers) {
      if (count != 1) {
        asm volatile("bar.sync %0, %1;" ::"r"(index + 1), "r"(threads) : "memory");
        return;
      }
    }
    __syncthreads();
  }

  // This group's slots in a block-wide scratch array of one slot per warp.
  __device__ __forceinline__ int first_warp_slot() const { return index * (threads / kWarp); }
};
using RowGroup = BasicRowGroup<true>;
using BlockRowGroup = BasicRowGroup<false>;

// Sums v[0..N) over the group. scratch: two buffers, each of one slot of N floats per warp of the
// block; `turn` (0 before a thread's first call) picks the buffer and alternates. A reduction
// then needs one barrier, not two: the readers of the buffer it writes (two reductions back)
// are done with it, as they have passed the barrier of the reduction in between.
template <int N, typename Group>
__device__ __forceinline__ void group_sum(float (&v)[N], const Group& g, float* scratch, int& turn) {
  const int width = g.threads < kWarp ? g.threads : kWarp;
  for (int offset = width / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int n = 0; n < N; ++n) v[n] += __shfl_xor_sync(0xffffffffu, v[n], offset);
  }
  if (g.threads <= kWarp) return;
  const int warp = g.lane / kWarp;
  const int lane = g.lane % kWarp;
  const int warps = g.threads / kWarp;
  float* slots = scratch + (turn * (static_cast<int>(blockDim.x) / kWarp) + g.first_warp_slot()) * N;
  turn ^= 1;
  if (lane == 0) {
#pragma unroll
    for (int n = 0; n < N; ++n) slots[warp * N + n] = v[n];
  }
  g.sync();
#pragma unroll
  for (int n = 0; n < N; ++n) v[n] = lane < warps ? slots[lane * N + n] : 0.0f;
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int n = 0; n < N; ++n) v[n] += __shfl_xor_sync(0xffffffffu, v[n], offset);
  }
}

// Launch helpers ----------------------------------------------------------------------------

using apex::allow_dynamic_smem;
using apex::ceil_div;
using apex::device_attribute;
using apex::next_power_of_two;
using apex::resident_blocks;
using apex::sm_count;

// Threads per row for a row held in registers: enough threads that each holds at most
// `vecs_per_thread` vectors; a power of two up to a warp, else whole warps.
inline int group_threads_for(int64_t vectors, int vecs_per_thread) {
  const int64_t needed = ceil_div(vectors, vecs_per_thread);
  if (needed <= kWarp) return next_power_of_two(needed);
  return static_cast<int>(ceil_div(needed, kWarp) * kWarp);
}

// Threads per row for the streaming kernels (any hidden size, one row per block).
inline int streaming_threads_for(int64_t hidden, int vector_width) {
  const int64_t wanted = ceil_div(ceil_div(hidden, vector_width * 4), kWarp) * kWarp;
  return static_cast<int>(wanted < kWarp ? kWarp : (wanted > kStreamingThreads ? kStreamingThreads : wanted));
}

}  // namespace apex_normalization
