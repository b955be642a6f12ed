// Shared by the layer norm / RMS norm kernels of apex-normalization: argument checks worded like
// apex/normalization/_ops.py, the dtype combinations the kernels are built for, row groups and
// their reductions, and launch helpers. The math is specified by apex/normalization/_reference.py.
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
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

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
  TORCH_CHECK_TYPE(apex::checks::contains(apex::checks::kFloatDtypes, dtype), op, ": ", what, " ",
                   torch_dtype(dtype), "; expected one of float32, float16, bfloat16");
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

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <int N, typename T>
__device__ __forceinline__ void to_floats(float (&dst)[N], const Vec<T, N>& v) {
#pragma unroll
  for (int j = 0; j < N; ++j) dst[j] = static_cast<float>(v.val[j]);
}

// bfloat16 pairs: the low element is the word shifted up, the high one the word with its low
// half cleared; one instruction each (the generic conversion spends two on the high element).
template <int N>
__device__ __forceinline__ void to_floats(float (&dst)[N], const Vec<c10::BFloat16, N>& v) {
  static_assert(N % 2 == 0, "whole 32-bit words");
  const uint32_t* words = reinterpret_cast<const uint32_t*>(&v);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    dst[2 * i] = __uint_as_float(words[i] << 16);
    dst[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

template <int N, typename T>
__device__ __forceinline__ void load_floats(float (&dst)[N], const T* p) {
  to_floats(dst, load_vec<T, N>(p));
}

// Stores whole 16-byte pieces as uint4, a native vector type: one 16-byte store each (a struct
// assignment may be split). Unlike apex::store_vector this is an ordinary store, not an asm
// statement with a memory clobber, so loads of other (restrict-qualified) arrays may move
// above it.
template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  static_assert(sizeof(v) % 16 == 0, "whole 16-byte pieces");
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(v) / 16); ++i) {
    reinterpret_cast<uint4*>(p)[i] = reinterpret_cast<const uint4*>(&v)[i];
  }
}

template <int N, typename T>
__device__ __forceinline__ void store_floats(T* p, const float (&src)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int j = 0; j < N; ++j) v.val[j] = static_cast<T>(src[j]);
  store_vec(p, v);
}

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

// Asynchronous copies into shared memory (cp.async, 16 bytes each), used to fetch the next tile's
// rows while the current one is reduced and written. Every thread copies exactly the vectors it
// will read back itself, so no barrier is needed: waiting for its own copies is enough.
__device__ __forceinline__ void copy_async16(void* smem, const void* gmem) {
  const auto address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(gmem) : "memory");
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most `kPending` of this thread's committed copy groups are still in flight.
template <int kPending>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Copies a vector V (whole 16-byte pieces) into shared memory asynchronously (cp.async).
template <typename V>
__device__ __forceinline__ void stage(uint4* smem, const void* gmem) {
  static_assert(sizeof(V) % 16 == 0, "whole 16-byte pieces");
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(V) / 16); ++i) {
    copy_async16(smem + i, reinterpret_cast<const uint4*>(gmem) + i);
  }
}

template <typename V>
__device__ __forceinline__ void unstage(V& dst, const uint4* smem) {
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(V) / 16); ++i) reinterpret_cast<uint4*>(&dst)[i] = smem[i];
}

// An integer from the environment (tuning switches), or `fallback` when unset or empty.
inline int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value == nullptr || value[0] == '\0' ? fallback : std::atoi(value);
}

// Launch helpers ----------------------------------------------------------------------------

using apex::ceil_div;
using apex::next_power_of_two;
using apex::sm_count;

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Blocks of `threads` threads (and `smem` bytes of dynamic shared memory) that fit on one
// multiprocessor of the current device at once; cached, as launches ask for it every call.
inline int resident_blocks(const void* kernel, int threads, size_t smem) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, size_t, int>, int> cache;
  const int device = at::cuda::current_device();
  const auto key = std::make_tuple(kernel, threads, smem, device);
  const std::lock_guard<std::mutex> lock(mutex);
  auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem));
  blocks = blocks > 0 ? blocks : 1;
  cache.emplace(key, blocks);
  return blocks;
}

// Lets `kernel` use `bytes` of dynamic shared memory on the current device; the attribute is set
// once per kernel, device and size. Always set, not only past 48 KiB: the default limit counts
// the kernel's static shared memory too, so 48 KiB of dynamic memory alone can exceed it.
// max_shared_carveout asks for the largest shared-memory carveout, so that as many blocks fit as
// the occupancy calculation (resident_blocks) counted on; it also leaves the least L1 (28 KiB on
// the H200). Without it the driver chooses.
inline void allow_dynamic_smem(const void* kernel, size_t bytes, bool max_shared_carveout) {
  if (bytes == 0) return;
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int>, size_t> allowed;
  const int device = at::cuda::current_device();
  const std::lock_guard<std::mutex> lock(mutex);
  size_t& current = allowed[std::make_tuple(kernel, device)];
  if (current >= bytes) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  if (max_shared_carveout) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        static_cast<int>(cudaSharedmemCarveoutMaxShared)));
  }
  current = bytes;
}

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
