// The fused scale-mask softmax family: y = softmax(scale * x [masked]) over the last dimension,
// and its backward dx = scale * y * (dy - sum(dy * y)). See _softmax_ops.py for the contract and
// the PyTorch reference; this header holds what the forward and backward kernels share: the
// argument checks (worded as in Python), the plan (which kernel a row length gets) and the
// reductions over a row's threads.
//
// Two kernel shapes, chosen by plan():
// - in registers: a group of G threads (a power of two, 1 to 512) holds one row, each thread
//   kVecs = 4 vectors of V elements (V = 16 bytes of the element type when every row is 16-byte
//   aligned, else 1), loaded once and written once. Groups of up to 32 threads reduce with warp
//   shuffles (several rows per 128-thread block when G < 128); larger groups add one exchange
//   through shared memory. Up to 16384 elements a row for 16-bit types (512 x 4 x 8), 8192 for
//   float32, 2048 unaligned. At most 512 threads a block leaves 128 registers a thread (the
//   backward's bound); the forward keeps its row as loaded (16 registers for 32 bf16 elements),
//   a padding mask as one bit an element, and one reduction (group_stats), so it is built for 3
//   resident blocks (40 registers a thread).
// - streaming: longer rows (or long unaligned ones): one 1024-thread block per row, a first pass
//   computing the row's max and sum online, a second pass re-reading the row (from L2 at these
//   sizes) to write the output.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/launch.cuh>
#include <apex/vectorized.cuh>

#include <climits>
#include <cstdint>
#include <optional>

namespace apex_transformer::softmax {

using apex::AlignedVector;
using apex::checks::shape_string;
using apex::checks::torch_dtype;

constexpr float kLog2e = 1.4426950408889634f;
// Upstream's score for a masked element (natural-log units).
constexpr float kMaskedScore = -10000.0f;
// Threads per block when a row needs fewer (several rows per block).
constexpr int kRowsBlock = 128;
// Most threads a row in registers, and the threads of a streaming block.
constexpr int kMaxGroup = 512;
constexpr int kStreamBlock = 1024;
// Vectors per thread of the in-registers kernels.
constexpr int kVecs = 4;

enum class Masking { kNone, kCausal, kPadding };

// Checks -------------------------------------------------------------------------------------
// The same checks, in the same order and words, as _softmax_ops.py.

inline void float_input(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(apex::checks::contains(apex::checks::kFloatDtypes, t.scalar_type()), op, ": ", name,
                   " has dtype ", torch_dtype(t.scalar_type()), "; expected one of float32, float16, bfloat16");
}

inline void rows_layout(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() >= 2, op, ": ", name, " must have at least 2 dimensions [..., sq, sk], got shape ",
                    shape_string(t.sizes()));
}

inline void square(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.size(-2) == t.size(-1), op, ": causal masking needs a square ", name,
                    " (sq == sk), got ", name, " of shape ", shape_string(t.sizes()));
}

inline void check_forward(const char* op, const at::Tensor& input, const at::Tensor* mask, bool causal) {
  float_input(op, "input", input);
  rows_layout(op, "input", input);
  apex::checks::placed(op, "input", input, input.device());  // any strides: the kernel reads a contiguous copy
  if (causal) {
    TORCH_CHECK_VALUE(mask == nullptr, op, ": causal masking takes no mask (got a mask)");
    square(op, "input", input);
  }
  if (mask != nullptr) {
    TORCH_CHECK_TYPE(mask->scalar_type() == at::kBool || mask->scalar_type() == at::kByte, op,
                     ": mask has dtype ", torch_dtype(mask->scalar_type()), "; expected bool or uint8");
    TORCH_CHECK_VALUE(input.dim() == 4, op, ": input must be 4-D [b, np, sq, sk] with a mask, got shape ",
                      shape_string(input.sizes()));
    const int64_t b = input.size(0), sq = input.size(2), sk = input.size(3);
    const bool ok = mask->dim() == 4 && (mask->size(0) == 1 || mask->size(0) == b) && mask->size(1) == 1 &&
                    mask->size(2) == sq && mask->size(3) == sk;
    TORCH_CHECK_VALUE(ok, op, ": mask has shape ", shape_string(mask->sizes()), "; expected (", b, " or 1, 1, ", sq,
                      ", ", sk, ") for input of shape ", shape_string(input.sizes()));
    apex::checks::dense(op, "mask", *mask, input.device());
  }
}

inline void check_backward(const char* op, const at::Tensor& grad_output, const at::Tensor& output, bool causal) {
  float_input(op, "grad_output", grad_output);
  float_input(op, "output", output);
  TORCH_CHECK_TYPE(grad_output.scalar_type() == output.scalar_type(), op, ": grad_output has dtype ",
                   torch_dtype(grad_output.scalar_type()), " but output has ", torch_dtype(output.scalar_type()));
  rows_layout(op, "output", output);
  TORCH_CHECK_VALUE(grad_output.sizes().equals(output.sizes()), op, ": grad_output has shape ",
                    shape_string(grad_output.sizes()), " but output has ", shape_string(output.sizes()));
  apex::checks::dense(op, "output", output, output.device());
  apex::checks::dense(op, "grad_output", grad_output, output.device());
  if (causal) square(op, "output", output);
}

// Plan ---------------------------------------------------------------------------------------

struct Plan {
  bool vectorized;  // V = 16 bytes of the element type; else 1
  bool streaming;
  int group;        // threads per row (in registers)
  int block;        // threads per block
};

// sk elements a row, `width` elements a 16-byte vector, `aligned`: every row starts 16-byte aligned.
inline Plan plan(int64_t sk, int width, bool aligned) {
  Plan p{};
  p.vectorized = aligned && sk % width == 0;
  const int64_t vectors = p.vectorized ? sk / width : sk;
  if (vectors <= int64_t{kMaxGroup} * kVecs) {
    p.group = apex::next_power_of_two(apex::ceil_div(vectors, kVecs));
    p.block = p.group < kRowsBlock ? kRowsBlock : p.group;
  } else {
    p.streaming = true;
    p.group = kStreamBlock;
    p.block = kStreamBlock;
  }
  return p;
}

inline int grid_for(int64_t row_groups) {
  return static_cast<int>(row_groups < INT_MAX ? row_groups : INT_MAX);
}

// Device helpers -----------------------------------------------------------------------------

struct Max {
  __device__ __forceinline__ float operator()(float a, float b) const { return a > b ? a : b; }
};
struct Sum {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// Reduces N values elementwise over each group of `group` consecutive threads (a power of two;
// groups of more than a warp fill whole warps). Every thread of the block must call it; every
// thread of a group gets the same bits (one fixed order). `shared` holds 32 * N floats.
template <int N, typename Op>
__device__ __forceinline__ void group_reduce(float (&v)[N], int group, float* shared, Op op) {
  const int width = group < 32 ? group : 32;
  for (int offset = width / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = op(v[i], __shfl_xor_sync(0xffffffffu, v[i], offset));
  }
  if (group <= 32) return;
  const int warp = threadIdx.x / 32;
  const int warps = group / 32;
  const int first = warp / warps * warps;
  __syncthreads();  // the previous call's readers are done with `shared`
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) shared[i * 32 + warp] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float r = shared[i * 32 + first];
    for (int w = 1; w < warps; ++w) r = op(r, shared[i * 32 + first + w]);
    v[i] = r;
  }
}

template <typename Op>
__device__ __forceinline__ float group_reduce1(float v, int group, float* shared, Op op) {
  float a[1] = {v};
  group_reduce<1>(a, group, shared, op);
  return a[0];
}

// The softmax statistics of a row, combined over each group of `group` consecutive threads in
// one exchange (the forward's single reduction). Each thread enters with its own max m (-inf
// when it holds no element) and sum s = sum exp2(score - m) over its elements (0 when it holds
// none), and a flag (padding: whether one of its elements is unmasked); it leaves with the
// group's max M and sum S = sum s_t * exp2(m_t - M) (the online-softmax rule) and the OR of the
// flags. Within a warp: a max butterfly, each thread rescales its s by exp2(m - M), a sum
// butterfly, and one ballot for the flag. A group of more than a warp then exchanges one record
// (m, s, flag) a warp through `shared` behind ONE barrier: lane l of each warp reads the record
// of warp l % warps of its group and the same butterflies run over those records. `shared`
// alternates between two buffers by `parity` (a block's consecutive calls pass 0, 1, 0, ...),
// so a call's writes cannot meet the previous call's reads, which happened before this call's
// writers passed the previous call's barrier. -inf maxima (threads or warps holding nothing:
// causal rows shorter than the group's span, inactive rows) never meet -inf in a subtraction:
// exp2 takes -inf and gives 0. Every thread of the block must call it; every thread of a group
// gets the same bits (the same steps on the same values in the same order; the steps commute).
struct StatsShared {
  float2 ms[2][kMaxGroup / 32];  // (m, s) of each warp, two buffers
  unsigned flag[2][kMaxGroup / 32];
};

// exp2(m - M) for m <= M, 0 when m is -inf (also when M is: then every s is 0).
__device__ __forceinline__ float rescale_factor(float m, float M) {
  return exp2f(m == -INFINITY ? -INFINITY : m - M);
}

// (m, s) over aligned groups of `width` lanes (a power of two, at most 32).
__device__ __forceinline__ void warp_stats(float& m, float& s, int width) {
  float M = m;
  for (int offset = width / 2; offset > 0; offset /= 2) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, offset));
  s *= rescale_factor(m, M);
  for (int offset = width / 2; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
  m = M;
}

template <bool kFlag>
__device__ __forceinline__ void group_stats(float& m, float& s, bool& flag, int group, StatsShared& shared,
                                            int parity) {
  const int lane = threadIdx.x & 31;
  warp_stats(m, s, group < 32 ? group : 32);
  if constexpr (kFlag) {
    const unsigned votes = __ballot_sync(0xffffffffu, flag);
    const unsigned mine = group >= 32 ? 0xffffffffu : ((1u << group) - 1u) << (lane & ~(group - 1));
    flag = (votes & mine) != 0u;
  }
  if (group <= 32) return;
  const int warp = threadIdx.x / 32;
  const int warps = group / 32;
  if (lane == 0) {
    shared.ms[parity][warp] = make_float2(m, s);
    if constexpr (kFlag) shared.flag[parity][warp] = flag ? 1u : 0u;
  }
  __syncthreads();
  const int record = (warp & ~(warps - 1)) | (lane & (warps - 1));  // warps: a power of two
  const float2 r = shared.ms[parity][record];
  m = r.x;
  s = r.y;
  warp_stats(m, s, warps);
  if constexpr (kFlag) flag = __ballot_sync(0xffffffffu, shared.flag[parity][record] != 0u) != 0u;
}

// V elements at p (aligned to V elements when V > 1) as floats.
template <int V, typename T>
__device__ __forceinline__ void load_elements(float (&dst)[V], const T* p) {
  if constexpr (V == 1) {
    dst[0] = static_cast<float>(*p);
  } else {
    apex::load_floats<V>(dst, p);
  }
}

template <int V, typename T>
__device__ __forceinline__ void store_elements(T* p, const float (&src)[V]) {
  if constexpr (V == 1) {
    *p = static_cast<T>(src[0]);
  } else {
    apex::store_floats<V>(p, src);
  }
}

// V mask bytes at p (aligned to V bytes): whether each element is masked (nonzero).
template <int V>
__device__ __forceinline__ void load_mask(bool (&dst)[V], const uint8_t* p) {
  const auto bytes = *reinterpret_cast<const AlignedVector<uint8_t, V>*>(p);
#pragma unroll
  for (int j = 0; j < V; ++j) dst[j] = bytes.val[j] != 0;
}

}  // namespace apex_transformer::softmax
