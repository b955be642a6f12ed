// Shared by group_norm_forward.cu and group_norm_backward.cu: the argument checks (worded as in
// _ops.py), the launch plan, and the per-thread view of a tile.
//
// x is (N, HW, C) contiguous: the memory of a channels-last (N, C, *spatial) tensor. Every pass
// over x (statistics, normalization, the two backward passes) uses one launch geometry, plan():
//   grid.x = N * hw_blocks: sample n, and a chunk of rows_per_block spatial positions (rows);
//   grid.y = c_tiles: a tile of up to kThreads channel vectors;
//   block  = (tx, ty): tx channel vectors (V elements each, 16 bytes, or 1 element when C is not
//            a multiple of the vector width or a pointer is misaligned) by ty rows.
// A warp's lanes run along one row's channels, then on to the next row: when the tile is the
// whole row (C <= kThreads * V), a block reads one contiguous span of memory.
// Each thread keeps its channels (and so their groups, weights and statistics) for the whole
// launch, so the loop over rows does no index arithmetic beyond a 64-bit add, and per-channel
// partial sums (over the block's rows) come out of a shared-memory reduction over ty. Those are
// combined per (sample, group) and per channel by small second kernels: any group size C/G,
// any C, no atomics (the same bits on every run).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string_view>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/launch.cuh>
#include <apex/reductions.cuh>
#include <apex/vectorized.cuh>

namespace apex_contrib_group_norm {

constexpr int kThreads = 256;
// Rows a thread loads before it uses any (independent 16-byte loads in flight per thread).
constexpr int kUnroll = 4;
// Fewest rows per thread in a block: fewer would spend more on the partial sums than on the rows.
constexpr int64_t kMinRowsPerThread = 8;
// Blocks per multiprocessor a pass aims at (a full wave of 256-thread blocks at 8 per SM is
// more than these small tensors can use; 4 leave each thread enough rows).
constexpr int kBlocksPerSm = 4;

inline bool is_silu(std::string_view act) { return act == "silu" || act == "swish"; }

// The checks of _ops.py's _check_x, same words. Returns (N, HW, C).
inline void check_params(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                         const std::optional<at::Tensor>& bias) {
  namespace checks = apex::checks;
  const int64_t channels = x.size(-1);
  const auto dtype = x.scalar_type();
  for (const auto& [name, t] : {std::pair<const char*, const std::optional<at::Tensor>*>{"weight", &weight},
                                std::pair<const char*, const std::optional<at::Tensor>*>{"bias", &bias}}) {
    if (!t->has_value()) continue;
    const at::Tensor& p = **t;
    const bool dtype_ok = p.scalar_type() == dtype || p.scalar_type() == c10::ScalarType::Float;
    TORCH_CHECK_TYPE(dtype_ok, op, ": ", name, " has dtype ", checks::torch_dtype(p.scalar_type()), " but x has ",
                     checks::torch_dtype(dtype), "; ", name, " must be ",
                     dtype == c10::ScalarType::Float ? std::string("float32")
                                                     : checks::dtype_name(dtype) + " or float32");
    TORCH_CHECK_VALUE(p.dim() == 1 && p.size(0) == channels, op, ": ", name, " has shape ",
                      checks::shape_string(p.sizes()), ", expected (", channels, ",) (the channel count)");
    checks::dense(op, name, p, x.device());
  }
  if (weight.has_value() && bias.has_value()) {
    TORCH_CHECK_TYPE(bias->scalar_type() == weight->scalar_type(), op, ": bias has dtype ",
                     checks::torch_dtype(bias->scalar_type()), " but weight has ",
                     checks::torch_dtype(weight->scalar_type()));
  }
}

inline void check_x(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                    const std::optional<at::Tensor>& bias, int64_t num_groups, std::string_view act) {
  namespace checks = apex::checks;
  TORCH_CHECK_TYPE(checks::contains(checks::kFloatDtypes, x.scalar_type()), op, ": x has dtype ",
                   checks::torch_dtype(x.scalar_type()), "; expected one of float32, float16, bfloat16");
  TORCH_CHECK_VALUE(x.dim() >= 2, op, ": x must be (N, *spatial, C) with at least 2 dimensions, got shape ",
                    checks::shape_string(x.sizes()));
  checks::dense(op, "x", x, x.device());
  const int64_t channels = x.size(-1);
  TORCH_CHECK_VALUE(num_groups > 0 && channels % num_groups == 0, op, ": num_groups (", num_groups,
                    ") must be positive and divide the channel count ", channels);
  TORCH_CHECK_VALUE(act.empty() || is_silu(act), op, ": act must be one of '', 'silu', 'swish', got '", act, "'");
  check_params(op, x, weight, bias);
}

struct Shape {
  int64_t n;
  int64_t hw;
  int64_t c;
  int64_t groups;
  int64_t group_channels;  // C / G
};

inline Shape shape_of(const at::Tensor& x, int64_t num_groups) {
  const int64_t n = x.size(0);
  const int64_t c = x.size(-1);
  const int64_t hw = n * c == 0 ? 0 : x.numel() / (n * c);
  return Shape{n, hw, c, num_groups, c / num_groups};
}

struct Plan {
  int vec;  // elements per access: the vector width, or 1
  int tx;
  int ty;
  int c_tiles;
  int64_t hw_blocks;
  int64_t rows_per_block;

  dim3 grid(const Shape& s) const {
    return dim3(static_cast<unsigned>(s.n * hw_blocks), static_cast<unsigned>(c_tiles));
  }
  dim3 block() const { return dim3(static_cast<unsigned>(tx), static_cast<unsigned>(ty)); }
};

// The launch geometry of every pass over x (see the top of this file). `aligned`: every tensor the
// pass reads or writes with vectors is 16-byte aligned.
inline Plan plan(const Shape& s, int vector_width, bool aligned) {
  Plan p{};
  p.vec = (aligned && s.c % vector_width == 0) ? vector_width : 1;
  const int64_t vectors = s.c / p.vec;
  p.c_tiles = static_cast<int>(apex::ceil_div(vectors, kThreads));
  p.tx = static_cast<int>(apex::ceil_div(vectors, p.c_tiles));
  p.ty = std::max(1, kThreads / p.tx);
  const int64_t target_blocks = static_cast<int64_t>(apex::sm_count()) * kBlocksPerSm;
  const int64_t wanted = apex::ceil_div(target_blocks, s.n * p.c_tiles);
  const int64_t most = std::max<int64_t>(1, s.hw / (p.ty * kMinRowsPerThread));
  p.hw_blocks = std::clamp<int64_t>(wanted, 1, most);
  p.rows_per_block = apex::ceil_div(s.hw, p.hw_blocks);
  p.hw_blocks = apex::ceil_div(s.hw, p.rows_per_block);  // no block without rows
  TORCH_CHECK_VALUE(p.c_tiles <= 65535, "group_norm: ", s.c, " channels are more than one launch can take");
  TORCH_CHECK_VALUE(s.n * p.hw_blocks <= 0x7fffffff, "group_norm: batch ", s.n, " is too large for one launch");
  return p;
}

// What a thread of a pass over x works on: sample n, rows [row_begin, row_end) stepping by ty from
// its own first row, and channels c0 .. c0 + V - 1 (active: c0 < C).
struct Tile {
  int64_t n;
  int64_t hb;
  int64_t row_begin;
  int64_t row_end;
  int64_t c0;
  bool active;
};

template <int V>
__device__ __forceinline__ Tile tile_of(const Shape& s, const Plan& p) {
  Tile t;
  t.n = blockIdx.x / static_cast<uint32_t>(p.hw_blocks);  // 32-bit: plan() keeps N * hw_blocks < 2^31
  t.hb = blockIdx.x - t.n * p.hw_blocks;
  t.row_begin = t.hb * p.rows_per_block + threadIdx.y;
  t.row_end = std::min(s.hw, (t.hb + 1) * p.rows_per_block);
  t.c0 = (static_cast<int64_t>(blockIdx.y) * p.tx + threadIdx.x) * V;
  t.active = t.c0 < s.c;
  return t;
}

// Sums each channel's per-thread values over the block's ty rows of threads and writes them to
// out[(n * hw_blocks + hb) * C + c] (two arrays: a and b). Every thread of the block calls it.
template <int V>
__device__ __forceinline__ void write_channel_partials(const Shape& s, const Plan& p, const Tile& t,
                                                       const float (&a)[V], const float (&b)[V], float* out_a,
                                                       float* out_b) {
  __shared__ float red[2][kThreads * 8];
  const int width = p.tx * V;  // channel slots of the tile
  const int slot = threadIdx.x * V;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    red[0][threadIdx.y * width + slot + j] = a[j];
    red[1][threadIdx.y * width + slot + j] = b[j];
  }
  __syncthreads();
  const int tid = threadIdx.y * p.tx + threadIdx.x;
  const int threads = p.tx * p.ty;
  const int64_t tile_c0 = static_cast<int64_t>(blockIdx.y) * p.tx * V;
  const int64_t base = (t.n * p.hw_blocks + t.hb) * s.c + tile_c0;
  for (int i = tid; i < width; i += threads) {
    if (tile_c0 + i >= s.c) break;
    float sa = 0.f, sb = 0.f;
    for (int y = 0; y < p.ty; ++y) {
      sa += red[0][y * width + i];
      sb += red[1][y * width + i];
    }
    out_a[base + i] = sa;
    out_b[base + i] = sb;
  }
}

// Calls f(hb, ci) for the entries hb * C/G + ci of [0, hw_blocks * C/G) of a block's threads,
// kThreads apart: a (sample, group)'s partial sums, row block by row block. The division is done
// once; the loop steps by carrying.
template <typename F>
__device__ __forceinline__ void for_each_group_entry(int64_t hw_blocks, int64_t group_channels, F&& f) {
  const int64_t step_hb = kThreads / group_channels;
  const int64_t step_c = kThreads - step_hb * group_channels;
  int64_t hb = threadIdx.x / group_channels;
  int64_t ci = threadIdx.x - hb * group_channels;
  while (hb < hw_blocks) {
    f(hb, ci);
    hb += step_hb;
    ci += step_c;
    if (ci >= group_channels) {
      ci -= group_channels;
      ++hb;
    }
  }
}

// The group of channel c (< C < 2^31: plan() allows at most 65535 tiles of 256 16-byte vectors).
__device__ __forceinline__ int64_t group_of(const Shape& s, int64_t c) {
  return static_cast<uint32_t>(c) / static_cast<uint32_t>(s.group_channels);
}

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + __expf(-z)); }

}  // namespace apex_contrib_group_norm
