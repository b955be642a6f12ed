// norm_backward: grad_input, grad_weight and grad_bias of layer norm / RMS norm in one pass over
// the saved tensor and grad_output (norm_backward.cuh has the math).
//
// backward_in_registers, when rows are 16-byte aligned, hold whole vectors and fit (at most 1024
// threads x kBackwardVecs vectors: 16384 elements of 16-bit types, 8192 of float32): a row group
// loads its slice of the saved row and of dy into registers once, reduces the two row sums, and
// writes dx. Each thread adds dy * xhat and dy of its own columns (the same columns in every row
// it visits) into its group's region of dynamic shared memory, [groups][2][hidden] floats: no
// other thread touches them until the end, so no barrier is needed per row, and they cost no
// registers (two per element held would not fit next to the row at 1024 threads per block).
// The grid is persistent (as many blocks as fit at once), so the partial buffer has few rows;
// at the end a block adds its groups' accumulators in group order into its partial row. Launched
// cooperatively (where the device allows), the grid then waits for every block's row
// (grid.sync()) and adds the partial rows up itself, from L2; otherwise sum_partials does, a
// second kernel. Where blocks walk over several tiles and shared memory allows, the next tile's
// rows are copied in (cp.async) while a tile is reduced and written. Rows that fill their
// threads exactly (long rows: every thread holds its 4 vectors, rows a multiple of the groups,
// with a weight) take kernels without per-vector checks (kWhole; faster, benchmarks/NOTES.md).
// plan_backward, beside the launch, makes these choices.
// Traffic per 16-bit element: read x and dy, write dx, 6 bytes, plus 8 bytes per column per
// block for the partials. Anything else goes to norm_backward_streaming.cu.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <type_traits>

#include "norm_backward.cuh"
#include "norm_float64.h"
#include "cuda_ops.h"

namespace apex_normalization {
namespace {

constexpr int kBackwardVecs = 2;
// Rows of at least kLongRowVectors vectors (8192 16-bit elements) take kLongRowVecs vectors per
// thread in blocks of at most 512 threads, with the next tile's copies issued before the row
// reduction rather than after: layer norm gains (benchmarks/NOTES.md), RMS norm ties. Either
// change alone gained nothing; at hidden 4096 and less the pair loses (fewer warps per row,
// more partial rows).
constexpr int kLongRowVecs = 4;
constexpr int64_t kLongRowVectors = 1024;
// Short rows of 65 to 128 vectors (520 to 1024 16-bit elements: GPT-2's 768, hidden 1024) take
// kLongRowVecs vectors per thread too, one warp a row and 16 rows a block, where 2 vectors per
// thread gave them two warps (a named barrier per row reduction, and at 768 a quarter of the
// threads idle): 53.9 -> 38.7 us at 16384 x 768 (layer norm, residual form), 68.6 -> 52.1 at
// 16384 x 1024 (H100, benchmarks/NOTES.md). Only with rows enough for a tile of 16 per SM: with
// fewer (1024 x 1024) the two-warp rows, twice the tiles, were faster.
// Threads per block: several row groups per block keep the number of partial rows low (256 and
// 1024 measured no faster).
constexpr int kBackwardBlock = 512;

// The column sums of a row group live in its region of shared memory, [2][hidden] floats (weight,
// then bias), each half stored as planes of float4: piece q (columns 4q..4q+3) of vector v at
// float4 index q * vectors + v. The threads of a warp hold consecutive vectors, so each access
// touches consecutive 16-byte pieces; stored vector-major, 8-column vectors put consecutive
// threads 32 bytes apart, a two-way bank conflict on every access.
template <int kV>
__device__ __forceinline__ int plane_index(int col, int vectors) {
  const int v = col / kV;
  const int j = col % kV;
  return ((j / 4) * vectors + v) * 4 + j % 4;
}

template <int kV>
__device__ __forceinline__ void zero_columns(float* __restrict__ acc_w, float* __restrict__ acc_b, int v,
                                             int vectors) {
#pragma unroll
  for (int q = 0; q < kV / 4; ++q) {
    reinterpret_cast<float4*>(acc_w)[q * vectors + v] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (acc_b != nullptr) reinterpret_cast<float4*>(acc_b)[q * vectors + v] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
}

// Adds dy * xhat and dy of vector v to the column sums.
template <int kV>
__device__ __forceinline__ void accumulate_columns(float* __restrict__ acc_w, float* __restrict__ acc_b, int v,
                                                   int vectors, const float (&dxhat)[kV], const float (&dy)[kV]) {
#pragma unroll
  for (int q = 0; q < kV / 4; ++q) {
    float4* pw = reinterpret_cast<float4*>(acc_w) + q * vectors + v;
    float4 w = *pw;
    w.x += dxhat[4 * q];
    w.y += dxhat[4 * q + 1];
    w.z += dxhat[4 * q + 2];
    w.w += dxhat[4 * q + 3];
    *pw = w;
    if (acc_b == nullptr) continue;
    float4* pb = reinterpret_cast<float4*>(acc_b) + q * vectors + v;
    float4 b = *pb;
    b.x += dy[4 * q];
    b.y += dy[4 * q + 1];
    b.z += dy[4 * q + 2];
    b.w += dy[4 * q + 3];
    *pb = b;
  }
}

// The column sums of the block's groups, added in group order, become row blockIdx.x of the
// partials.
template <int kV>
__device__ __forceinline__ void write_partial_row(const float* all, int groups, int64_t hidden, float* partial_weight,
                                                  float* partial_bias) {
  __syncthreads();
  const int vectors = static_cast<int>(hidden / kV);
  float* out_w = partial_weight + blockIdx.x * hidden;
  float* out_b = partial_bias != nullptr ? partial_bias + blockIdx.x * hidden : nullptr;
  for (int64_t col = threadIdx.x; col < hidden; col += blockDim.x) {
    const int at = plane_index<kV>(static_cast<int>(col), vectors);
    const int64_t stride = (out_b != nullptr ? 2 : 1) * hidden;  // between groups' regions
    float w = 0.0f;
    float b = 0.0f;
    for (int group = 0; group < groups; ++group) {
      w += all[group * stride + at];
      if (out_b != nullptr) b += all[group * stride + hidden + at];
    }
    out_w[col] = w;
    if (out_b != nullptr) out_b[col] = b;
  }
}

// Makes the compiler forget the bits of v, so that values computed from v before this point are
// computed again afterwards rather than kept in registers across the row reduction.
template <typename T, int N>
__device__ __forceinline__ void launder(Vec<T, N>& v) {
  uint32_t* words = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(v) / 4); ++i) asm volatile("" : "+r"(words[i]));
}

// dx for the vectors of a row that a thread holds (see norm_backward.cuh). The restrict-qualified
// pointers let the weight loads of later vectors move above earlier stores. kFma: as in
// xhat_and_wdy, x * slope + (offset - mean * slope) rather than (x - mean) * slope + offset.
// kWeight: weight is known not to be null.
template <bool kFma, bool kWeight, int kVecs, int kV, typename T, typename W, typename O, typename S>
__device__ __forceinline__ void write_grad_row(T* __restrict__ grad_input, const T* __restrict__ grad_residual,
                                               const W* __restrict__ weight, const W* __restrict__ bias,
                                               bool memory_efficient,
                                               Vec<S, kV> (&xs)[kVecs], Vec<O, kV> (&dys)[kVecs],
                                               const bool (&valid)[kVecs], int lane, int threads, float mean,
                                               float rstd, float projection, float centering) {
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    if (!valid[k]) continue;
    launder(xs[k]);
    launder(dys[k]);
    const int col = (lane + k * threads) * kV;
    float xhat[kV], wdy[kV], dy[kV], w[kV];
    to_floats(xhat, xs[k]);
    to_floats(dy, dys[k]);
    const bool has_weight = kWeight || weight != nullptr;
    if (has_weight) load_floats(w, weight + col);
    float dx[kV];
    if (memory_efficient) {
      xhat_and_wdy(xhat, wdy, dy, has_weight, w, bias, memory_efficient, col, mean, rstd);
#pragma unroll
      for (int j = 0; j < kV; ++j) dx[j] = rstd * (wdy[j] - (xhat[j] * projection + centering));
    } else {
      // rstd * (wdy - xhat * projection - centering) with xhat = (x - mean) * rstd, as
      // rstd * wdy - ((x - mean) * slope + offset): four operations per element, not six.
      const float slope = rstd * rstd * projection;
      const float offset = rstd * centering;
      const float offset_at_zero = fmaf(-mean, slope, offset);
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        const float w_dy = has_weight ? dy[j] * w[j] : dy[j];
        const float shifted = kFma ? fmaf(xhat[j], slope, offset_at_zero) : fmaf(xhat[j] - mean, slope, offset);
        dx[j] = fmaf(rstd, w_dy, -shifted);
      }
    }
    if (grad_residual != nullptr) {
      float extra[kV];
      load_floats(extra, grad_residual + col);
#pragma unroll
      for (int j = 0; j < kV; ++j) dx[j] += extra[j];
    }
    store_floats(grad_input + col, dx);
  }
}

// Starts the copies of a tile's rows (this group's row, if any) into shared memory and loads the
// row's mean and rstd; commits one copy group, possibly empty. kWhole: see backward_in_registers.
template <int kVecs, int kV, bool kWhole, typename T, typename W, typename O, typename S>
__device__ __forceinline__ void prefetch_rows(const BackwardParams<T, W, O, S>& p, const RowGroup& g, int64_t tile,
                                              int64_t tiles, uint4* staged_saved, uint4* staged_dy, float& mean,
                                              float& rstd) {
  constexpr int kPiecesS = sizeof(Vec<S, kV>) / 16;
  constexpr int kPiecesO = sizeof(Vec<O, kV>) / 16;
  const int64_t row = tile * g.count + g.index;
  if (tile < tiles && row < p.rows) {
    const int64_t offset = row * p.hidden;
    const int vectors = static_cast<int>(p.hidden / kV);
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int v = g.lane + k * g.threads;
      if (kWhole || v < vectors) {
        stage<Vec<S, kV>>(staged_saved + v * kPiecesS, p.saved + offset + v * kV);
        stage<Vec<O, kV>>(staged_dy + v * kPiecesO, p.grad_output + offset + v * kV);
      }
    }
    rstd = p.rstd[row];
    if (p.mean != nullptr) mean = p.mean[row];
  }
  copy_async_commit();
}

// The weight (and bias) gradients from a grid's partial rows, by the grid itself once every
// block has written its row (cooperative launch, after grid.sync()): a block takes tiles of
// 128 columns, its threads 4 adjacent columns each and every lanes-th part (lanes = blockDim.x /
// 32), in kChains sums; the lanes' sums are added in lane order through `scratch`
// (2 x lanes x 128 floats). The order is fixed by the grid and block size: the same bits every
// run. The partial rows are read through L2 (ld.global.cg): other multiprocessors wrote them.
template <typename W>
__device__ __forceinline__ void finish_column_sums(const float* partial_weight, const float* partial_bias,
                                                   W* grad_weight, W* grad_bias, int64_t hidden, float* scratch) {
  constexpr int kChains = 4;
  constexpr int kColumns = 4;
  constexpr int kTile = kWarp * kColumns;
  const int parts = static_cast<int>(gridDim.x);
  const int lanes = static_cast<int>(blockDim.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x) / kWarp;
  const int c = static_cast<int>(threadIdx.x) % kWarp * kColumns;
  const int sources = partial_bias != nullptr ? 2 : 1;
  const int64_t tiles = ceil_div(hidden, kTile);
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t col = tile * kTile + c;
    for (int s = 0; s < sources; ++s) {
      const float* partial = s == 0 ? partial_weight : partial_bias;
      float4 chains[kChains];
#pragma unroll
      for (int k = 0; k < kChains; ++k) chains[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      auto add = [&](float4& sum, int part) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(partial + part * hidden + col));
        sum.x += v.x;
        sum.y += v.y;
        sum.z += v.z;
        sum.w += v.w;
      };
      if (col < hidden) {  // hidden is a multiple of 4
        int part = lane;
        for (; part + (kChains - 1) * lanes < parts; part += kChains * lanes) {
#pragma unroll
          for (int k = 0; k < kChains; ++k) add(chains[k], part + k * lanes);
        }
        for (; part < parts; part += lanes) add(chains[0], part);
      }
      float* out = scratch + (s * lanes + lane) * kTile + c;
      out[0] = (chains[0].x + chains[1].x) + (chains[2].x + chains[3].x);
      out[1] = (chains[0].y + chains[1].y) + (chains[2].y + chains[3].y);
      out[2] = (chains[0].z + chains[1].z) + (chains[2].z + chains[3].z);
      out[3] = (chains[0].w + chains[1].w) + (chains[2].w + chains[3].w);
    }
    __syncthreads();
    for (int i = static_cast<int>(threadIdx.x); i < sources * kTile; i += static_cast<int>(blockDim.x)) {
      const int s = i / kTile;
      const int64_t column = tile * kTile + i % kTile;
      if (column >= hidden) continue;
      float sum = 0.0f;
      for (int l = 0; l < lanes; ++l) sum += scratch[(s * lanes + l) * kTile + i % kTile];
      (s == 0 ? grad_weight : grad_bias)[column] = static_cast<W>(sum);
    }
    __syncthreads();
  }
}

// kEfficient: memory_efficient, saved is the output (S = O); else the input (S = T). A template
// parameter: decided at run time it costs some 20 registers.
// kPrefetch: the next tile's rows of the saved tensor and dy are copied into shared memory (after
// the column accumulators: [groups][vectors] of each) while this tile is reduced and written, so
// that loads stay in flight through the row reduction; the next row's mean and rstd are loaded
// with them. One buffer: the copies into it are issued after the row reduction, which needed
// every value this thread had read from it.
// kWhole: every row group's threads hold whole rows of exactly kVecs vectors each, every group of
// every tile has a row (rows a multiple of the groups), and there is a weight: no vector, row or
// weight pointer is checked, and the weight loads are no longer behind a branch, free to be
// issued early.
// __launch_bounds__ with a minimum of one block per SM: without it ptxas gave the
// memory_efficient kernel with float32 saved values 32 registers and 312 bytes of stack (64 and
// 128 with it).
template <typename T, typename W, typename O, bool kEfficient, bool kPrefetch, int kVecs, bool kWhole,
          typename S = std::conditional_t<kEfficient, O, T>>
__global__ void __launch_bounds__(kMaxThreads * kBackwardVecs / kVecs, 1)
    backward_in_registers(const BackwardParams<T, W, O, S> p) {
  constexpr int kV = apex::vector_width<T, W, O, S>();
  static_assert(kV % 4 == 0, "column sums are accessed as float4");
  constexpr int kPiecesS = sizeof(Vec<S, kV>) / 16;
  constexpr int kPiecesO = sizeof(Vec<O, kV>) / 16;
  constexpr bool kEarly = kVecs == kLongRowVecs;  // see kLongRowVecs
  // See xhat_and_wdy. Not for 2 vectors per thread: at their 64 registers it spilled (40 bytes of
  // stack for bfloat16), and was slower (benchmarks/NOTES.md).
  constexpr bool kFma = sizeof(S) == 2 && kVecs == kLongRowVecs;
  __shared__ float scratch[2 * 2 * (kMaxThreads / kWarp)];  // group_sum: two buffers of two sums per warp
  int turn = 0;
  extern __shared__ float4 accumulators[];
  const RowGroup g(p.group_threads);
  const int vectors = static_cast<int>(p.hidden / kV);
  const int64_t tiles = ceil_div(p.rows, g.count);
  const float inv_hidden = 1.0f / static_cast<float>(p.hidden);
  const bool accumulate = p.partial_weight != nullptr;
  const int sums_per_column = p.partial_bias != nullptr ? 2 : 1;  // dy * xhat, and dy for a bias
  float* acc_w = reinterpret_cast<float*>(accumulators) + sums_per_column * g.index * p.hidden;
  float* acc_b = p.partial_bias != nullptr ? acc_w + p.hidden : nullptr;  // RMS norm: no dy sums
  if (accumulate) {
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int v = g.lane + k * g.threads;
      if (kWhole || v < vectors) zero_columns<kV>(acc_w, acc_b, v, vectors);
    }
  }
  uint4* staged = reinterpret_cast<uint4*>(accumulators) + (accumulate ? sums_per_column * g.count * p.hidden / 4 : 0);
  uint4* staged_saved = staged + static_cast<int64_t>(g.index) * vectors * kPiecesS;
  uint4* staged_dy = staged + static_cast<int64_t>(g.count) * vectors * kPiecesS +
                     static_cast<int64_t>(g.index) * vectors * kPiecesO;
  float next_mean = 0.0f;
  float next_rstd = 0.0f;
  if constexpr (kPrefetch) {
    prefetch_rows<kVecs, kV, kWhole>(p, g, blockIdx.x, tiles, staged_saved, staged_dy, next_mean, next_rstd);
  }

  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t row = tile * g.count + g.index;
    const bool row_valid = kWhole || row < p.rows;
    const int64_t offset = row * p.hidden;
    Vec<S, kV> xs[kVecs];
    Vec<O, kV> dys[kVecs];
    bool valid[kVecs];
    if constexpr (kPrefetch) copy_async_wait<0>();
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int v = g.lane + k * g.threads;
      valid[k] = kWhole || (row_valid && v < vectors);
      if (valid[k]) {
        if constexpr (kPrefetch) {
          unstage(xs[k], staged_saved + v * kPiecesS);
          unstage(dys[k], staged_dy + v * kPiecesO);
        } else {
          xs[k] = load_vector<S, kV>(p.saved + offset + v * kV);
          dys[k] = load_vector<O, kV>(p.grad_output + offset + v * kV);
        }
      }
    }
    float mean = 0.0f;
    float rstd = 0.0f;
    if constexpr (kPrefetch) {
      mean = next_mean;
      rstd = next_rstd;
    } else if (row_valid) {
      rstd = p.rstd[row];
      if (p.mean != nullptr) mean = p.mean[row];
    }

    float sums[2] = {0.0f, 0.0f};  // sum(wdy * xhat), sum(wdy)
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      if (!valid[k]) continue;
      const int v = g.lane + k * g.threads;
      float xhat[kV], wdy[kV], dy[kV], w[kV], dxhat[kV];
      to_floats(xhat, xs[k]);
      to_floats(dy, dys[k]);
      const bool has_weight = kWhole || p.weight != nullptr;
      if (has_weight) load_floats(w, p.weight + v * kV);
      xhat_and_wdy<kV, W, kFma>(xhat, wdy, dy, has_weight, w, p.bias, kEfficient, v * kV, mean, rstd);
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        sums[0] += wdy[j] * xhat[j];
        sums[1] += wdy[j];
        dxhat[j] = dy[j] * xhat[j];
      }
      if (accumulate) accumulate_columns<kV>(acc_w, acc_b, v, vectors, dxhat, dy);
    }
    if constexpr (kPrefetch && kEarly) {
      prefetch_rows<kVecs, kV, kWhole>(p, g, tile + gridDim.x, tiles, staged_saved, staged_dy, next_mean, next_rstd);
    }
    group_sum(sums, g, scratch, turn);
    if constexpr (kPrefetch && !kEarly) {
      prefetch_rows<kVecs, kV, kWhole>(p, g, tile + gridDim.x, tiles, staged_saved, staged_dy, next_mean, next_rstd);
    }
    const float projection = sums[0] * inv_hidden;
    const float centering = p.rms ? 0.0f : sums[1] * inv_hidden;

    write_grad_row<kFma, kWhole>(p.grad_input + offset,
                                 p.grad_residual != nullptr ? p.grad_residual + offset : nullptr, p.weight, p.bias,
                                 kEfficient, xs, dys, valid, g.lane, g.threads, mean, rstd, projection, centering);
  }
  if (accumulate) {
    write_partial_row<kV>(reinterpret_cast<const float*>(accumulators), g.count, p.hidden, p.partial_weight,
                          p.partial_bias);
    if (p.grad_weight != nullptr) {  // launched cooperatively
      cooperative_groups::this_grid().sync();
      finish_column_sums(p.partial_weight, p.partial_bias, p.grad_weight, p.grad_bias, p.hidden,
                         reinterpret_cast<float*>(accumulators));
    }
  }
}

// grad[col] = sum over parts of partial[part, col], in a fixed order. Blocks of kSumRows x 32
// threads, each thread kColumns adjacent columns (one 16-byte load for 4); blockIdx.y 0: weight,
// 1: bias. A thread adds every kSumRows-th part into kChains separate sums, so that its loads are
// in flight together (one chain and one column per thread was slower:
// benchmarks/NOTES.md).
constexpr int kSumRows = 8;
template <typename W, int kColumns>
__global__ void __launch_bounds__(kSumRows * kWarp)
    sum_partials_kernel(const float* partial_weight, const float* partial_bias, int64_t parts, int64_t hidden,
                        W* grad_weight, W* grad_bias) {
  constexpr int kChains = 4;
  constexpr int kBlockColumns = kWarp * kColumns;
  __shared__ float tile[kSumRows][kBlockColumns + 1];
  const float* partial = blockIdx.y == 0 ? partial_weight : partial_bias;
  W* grad = blockIdx.y == 0 ? grad_weight : grad_bias;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kBlockColumns;
  const int64_t col = first + threadIdx.x * kColumns;
  float chains[kChains][kColumns] = {};
  if (col < hidden) {  // hidden is a multiple of kColumns
    auto add = [&](float(&sum)[kColumns], int64_t part) {
      float v[kColumns];
      load_floats(v, partial + part * hidden + col);
#pragma unroll
      for (int j = 0; j < kColumns; ++j) sum[j] += v[j];
    };
    int64_t part = threadIdx.y;
    for (; part + (kChains - 1) * kSumRows < parts; part += kChains * kSumRows) {
#pragma unroll
      for (int c = 0; c < kChains; ++c) add(chains[c], part + c * kSumRows);
    }
    for (; part < parts; part += kSumRows) add(chains[0], part);
  }
#pragma unroll
  for (int j = 0; j < kColumns; ++j) {
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kChains; ++c) sum += chains[c][j];
    tile[threadIdx.y][threadIdx.x * kColumns + j] = sum;
  }
  __syncthreads();
  const int t = static_cast<int>(threadIdx.y * kWarp + threadIdx.x);
  if (t < kBlockColumns && first + t < hidden) {
    float sum = 0.0f;
#pragma unroll
    for (int r = 0; r < kSumRows; ++r) sum += tile[r][t];
    grad[first + t] = static_cast<W>(sum);
  }
}

template <typename T, typename W, typename O, bool kEfficient, typename S = std::conditional_t<kEfficient, O, T>>
using BackwardKernelFn = void (*)(BackwardParams<T, W, O, S>);

struct BackwardPlan {
  int vecs;               // vectors per thread: kBackwardVecs, or kLongRowVecs for long rows
  bool whole;             // kWhole
  bool prefetch;          // kPrefetch
  bool finish_in_kernel;  // a cooperative launch that sums the partial rows itself; else sum_partials
  int group_threads;
  int block;
  int64_t grid;
  size_t smem;  // dynamic shared memory per block
};

// The instantiation of backward_in_registers that a plan names. Whole rows (kWhole) are built for
// the long rows only (hidden a multiple of 1024 16-bit elements; the common case there). At 2
// vectors per thread, 64 registers, ptxas spilled them (16 bytes of stack for bfloat16 with
// bfloat16 weights, against none). Not memory_efficient either: with float32 weights it spilled
// twice as much (80 bytes of stack, not 40).
template <typename T, typename W, typename O, bool kEfficient>
BackwardKernelFn<T, W, O, kEfficient> backward_kernel(const BackwardPlan& plan) {
  if (plan.vecs == kLongRowVecs) {
    if constexpr (!kEfficient) {
      if (plan.whole) {
        return plan.prefetch ? backward_in_registers<T, W, O, false, true, kLongRowVecs, true>
                             : backward_in_registers<T, W, O, false, false, kLongRowVecs, true>;
      }
    }
    return plan.prefetch ? backward_in_registers<T, W, O, kEfficient, true, kLongRowVecs, false>
                         : backward_in_registers<T, W, O, kEfficient, false, kLongRowVecs, false>;
  }
  return plan.prefetch ? backward_in_registers<T, W, O, kEfficient, true, kBackwardVecs, false>
                       : backward_in_registers<T, W, O, kEfficient, false, kBackwardVecs, false>;
}

// How backward_in_registers takes the problem p describes on the current device, or nothing when
// it cannot (misaligned rows, hidden not whole vectors, rows longer than the registers hold, or
// column accumulators larger than a block's shared memory): norm_backward_streaming.cu then does.
// Also sets the dynamic shared memory attributes of the kernels it weighs.
// - vecs: kLongRowVecs for rows of at least kLongRowVectors vectors, and for rows of 65 to 128
//   vectors when there are at least 16 rows per SM (one warp a row); else kBackwardVecs.
// - whole: rows that fill their groups exactly, every tile full, with a weight (see
//   backward_kernel for the instantiations built).
// - prefetch: where blocks walk over several tiles (more tiles than the grid holds at once) and
//   the copies fit next to the accumulators.
// - grid: as many blocks as are resident at once, at most one per tile. The driver's carveout,
//   not the largest: the largest leaves L1 only 28 KiB, and was slower (benchmarks/NOTES.md).
// - finish_in_kernel: weight gradients asked for, the accumulators large enough for
//   finish_column_sums' scratch, and a device that supports cooperative launches.
template <typename T, typename W, typename O, bool kEfficient, typename S>
std::optional<BackwardPlan> plan_backward(const BackwardParams<T, W, O, S>& p, bool weight_grads, bool bias_grads) {
  constexpr int kV = apex::vector_width<T, W, O, S>();
  const bool aligned = aligned16(p.grad_output) && aligned16(p.saved) && aligned16(p.weight) && aligned16(p.bias) &&
                       aligned16(p.grad_residual) && aligned16(p.grad_input);
  const int64_t vectors = p.hidden / kV;
  if (!aligned || p.hidden % kV != 0 || vectors > static_cast<int64_t>(kMaxThreads) * kBackwardVecs) {
    return std::nullopt;
  }

  BackwardPlan plan{};
  const bool short_warp_rows = vectors > kWarp * kBackwardVecs && vectors <= kWarp * kLongRowVecs &&
                               ceil_div(p.rows, static_cast<int64_t>(kBackwardBlock / kWarp)) >= sm_count();
  plan.vecs = vectors >= kLongRowVectors || short_warp_rows ? kLongRowVecs : kBackwardVecs;
  plan.group_threads = group_threads_for(vectors, plan.vecs);
  const int groups = plan.group_threads <= kWarp
                         ? kBackwardBlock / plan.group_threads
                         : std::max(1, std::min(kMaxBarrierGroups, kBackwardBlock / plan.group_threads));
  plan.block = plan.group_threads * groups;
  const size_t sums_per_column = bias_grads ? 2 : 1;
  const size_t accumulator_bytes = weight_grads ? sums_per_column * groups * p.hidden * sizeof(float) : 0;
  const size_t staged_bytes = static_cast<size_t>(groups) * vectors * (sizeof(Vec<S, kV>) + sizeof(Vec<O, kV>));
  // 128 KiB of accumulators for the longest rows (plus the static reduction scratch): more than
  // some GPUs give a block; those take the streaming path. The copies of the next tile's rows
  // come on top where they fit (192 KiB at 16384 bf16).
  const size_t static_smem = 4 * (kMaxThreads / kWarp) * sizeof(float);
  const size_t limit = apex::smem_per_block_optin();
  if (accumulator_bytes + static_smem > limit) return std::nullopt;
  plan.whole = !kEfficient && plan.vecs == kLongRowVecs && p.weight != nullptr &&
               vectors == static_cast<int64_t>(plan.group_threads) * plan.vecs && p.rows % groups == 0;

  const int64_t tiles = ceil_div(p.rows, static_cast<int64_t>(groups));
  auto resident = [&](size_t smem) {
    const void* kernel = reinterpret_cast<const void*>(backward_kernel<T, W, O, kEfficient>(plan));
    allow_dynamic_smem(kernel, smem, /*max_shared_carveout=*/false);
    return static_cast<int64_t>(sm_count()) * resident_blocks(kernel, plan.block, smem);
  };
  plan.smem = accumulator_bytes;
  plan.prefetch = accumulator_bytes + staged_bytes + static_smem <= limit;
  if (plan.prefetch) {
    plan.grid = resident(accumulator_bytes + staged_bytes);  // of the prefetching kernel
    plan.prefetch = tiles > plan.grid;
  }
  if (plan.prefetch) {
    plan.smem += staged_bytes;
  } else {
    plan.grid = resident(plan.smem);
  }
  plan.grid = std::min(plan.grid, tiles);

  // finish_column_sums' scratch: two sums of lanes x 128 floats; the accumulators hold it as a
  // rule (more than 8 floats per thread), else the partial rows go to sum_partials.
  const size_t finish_scratch = 2 * static_cast<size_t>(plan.block / kWarp) * 4 * kWarp * sizeof(float);
  plan.finish_in_kernel =
      weight_grads && plan.smem >= finish_scratch && device_attribute(cudaDevAttrCooperativeLaunch) != 0;
  return plan;
}

template <typename T, typename W, typename O, bool kEfficient>
bool backward_registers(const BackwardArgs& a) {
  using S = std::conditional_t<kEfficient, O, T>;
  auto p = backward_params<T, W, O, S>(a);
  const bool weight_grads = a.grad_weight != nullptr;
  const std::optional<BackwardPlan> plan = plan_backward<T, W, O, kEfficient>(p, weight_grads, a.grad_bias != nullptr);
  if (!plan) return false;
  p.group_threads = plan->group_threads;

  at::Tensor partial_weight, partial_bias;
  if (weight_grads) {
    const auto f32 = a.saved->options().dtype(at::kFloat);
    partial_weight = at::empty({plan->grid, p.hidden}, f32);
    p.partial_weight = partial_weight.data_ptr<float>();
    if (a.grad_bias != nullptr) {
      partial_bias = at::empty({plan->grid, p.hidden}, f32);
      p.partial_bias = partial_bias.data_ptr<float>();
    }
  }
  const auto kernel = backward_kernel<T, W, O, kEfficient>(*plan);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(plan->grid));
  if (plan->finish_in_kernel) {
    p.grad_weight = static_cast<W*>(a.grad_weight->data_ptr());
    p.grad_bias = a.grad_bias != nullptr ? static_cast<W*>(a.grad_bias->data_ptr()) : nullptr;
    void* args[] = {&p};
    const cudaError_t launched = cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), grid,
                                                             dim3(plan->block), args, plan->smem, stream);
    if (launched == cudaSuccess) return true;
    // A grid that cannot be resident at once here (fewer multiprocessors than the occupancy
    // calculation counted, as under MPS limits): the second-kernel sums, with a warning.
    TORCH_CHECK(launched == cudaErrorCooperativeLaunchTooLarge || launched == cudaErrorNotSupported,
                "norm_backward: cooperative launch failed: ", cudaGetErrorString(launched));
    (void)cudaGetLastError();
    TORCH_WARN_ONCE("norm_backward: the cooperative launch of ", plan->grid, " blocks was refused (",
                    cudaGetErrorString(launched), "); weight gradients are summed by a second kernel");
    p.grad_weight = nullptr;
    p.grad_bias = nullptr;
  }
  kernel<<<grid, plan->block, plan->smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (weight_grads) {
    sum_partials(partial_weight, a.grad_bias != nullptr ? &partial_bias : nullptr, *a.grad_weight, a.grad_bias);
  }
  return true;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& saved, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd,
    c10::SymIntArrayRef sym_shape, bool rms, bool memory_efficient, c10::ScalarType input_dtype, bool weight_grads,
    const std::optional<at::Tensor>& grad_residual_out) {
  constexpr const char* op = "norm_backward";
  const c10::IntArrayRef shape = C10_AS_INTARRAYREF_SLOW(sym_shape);
  checks::float_dtype(op, "input_dtype is", input_dtype);
  const int64_t hidden = checks::normalized(op, "saved", saved, shape);
  const c10::Device device = saved.device();
  checks::dense(op, "saved", saved, device);
  checks::affine(op, input_dtype, device, weight, bias, shape, rms);
  const at::Tensor* w = optional_tensor(weight);
  const at::Tensor* b = optional_tensor(bias);
  const auto out_dtype = grad_output.scalar_type();
  const bool output_dtype_ok = out_dtype == input_dtype || (w != nullptr && out_dtype == w->scalar_type());
  if (!output_dtype_ok) {
    std::string allowed = checks::torch_dtype(input_dtype);
    if (w != nullptr && w->scalar_type() != input_dtype) allowed += ", " + checks::torch_dtype(w->scalar_type());
    TORCH_CHECK_TYPE(false, op, ": grad_output has dtype ", checks::torch_dtype(out_dtype),
                     "; expected the output's dtype, one of ", allowed);
  }
  TORCH_CHECK_VALUE(grad_output.sizes().equals(saved.sizes()), op, ": grad_output has shape ",
                    apex::checks::shape_string(grad_output.sizes()), " but saved has ",
                    apex::checks::shape_string(saved.sizes()));
  checks::dense(op, "grad_output", grad_output, device);
  const auto expected_saved = memory_efficient ? out_dtype : input_dtype;
  TORCH_CHECK_TYPE(saved.scalar_type() == expected_saved, op, ": saved has dtype ",
                   checks::torch_dtype(saved.scalar_type()), "; expected ", checks::torch_dtype(expected_saved),
                   memory_efficient ? " (the output, like grad_output)" : " (the input, input_dtype)");
  const int64_t rows = saved.numel() / hidden;
  const bool uses_mean = !(rms || memory_efficient);
  const auto stats_dtype = input_dtype == at::kDouble ? at::kDouble : at::kFloat;  // upstream's
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"rstd", &rstd}, {"mean", &mean}}) {
    if (t == &mean && !uses_mean) continue;
    TORCH_CHECK_TYPE(t->scalar_type() == stats_dtype, op, ": ", name, " has dtype ",
                     checks::torch_dtype(t->scalar_type()), "; expected ", apex::checks::dtype_name(stats_dtype));
    TORCH_CHECK_VALUE(t->numel() == rows, op, ": ", name, " has ", t->numel(), " elements, expected one per row (",
                      rows, ")");
    checks::dense(op, name, *t, device);
  }
  const at::Tensor* grad_res = optional_tensor(grad_residual_out);
  if (grad_res != nullptr) {
    TORCH_CHECK_TYPE(grad_res->scalar_type() == input_dtype, op, ": grad_residual_out has dtype ",
                     checks::torch_dtype(grad_res->scalar_type()), "; expected ", checks::torch_dtype(input_dtype));
    TORCH_CHECK_VALUE(grad_res->sizes().equals(saved.sizes()), op, ": grad_residual_out has shape ",
                      apex::checks::shape_string(grad_res->sizes()), " but saved has ",
                      apex::checks::shape_string(saved.sizes()));
    checks::dense(op, "grad_residual_out", *grad_res, device);
  }

  if (input_dtype == at::kDouble) {
    return backward_float64(grad_output, saved, w, b, mean, rstd, shape, rms, memory_efficient, weight_grads, grad_res);
  }

  const c10::cuda::CUDAGuard device_guard(device);
  const auto f32 = saved.options().dtype(at::kFloat);
  at::Tensor grad_input = at::empty(saved.sizes(), saved.options().dtype(input_dtype));
  const bool with_weight = weight_grads && w != nullptr;
  at::Tensor grad_weight = with_weight ? at::empty_like(*w) : at::empty({0}, f32);
  at::Tensor grad_bias = with_weight && b != nullptr ? at::empty_like(*b) : at::empty({0}, f32);
  if (rows == 0) {
    grad_weight.zero_();
    grad_bias.zero_();
    return {grad_input, grad_weight, grad_bias};
  }

  BackwardArgs args{};
  args.grad_output = &grad_output;
  args.saved = &saved;
  args.weight = w;
  args.bias = b;
  args.mean = uses_mean ? &mean : nullptr;
  args.rstd = &rstd;
  args.grad_residual = grad_res;
  args.grad_input = &grad_input;
  args.grad_weight = with_weight ? &grad_weight : nullptr;
  args.grad_bias = with_weight && b != nullptr ? &grad_bias : nullptr;
  args.rows = rows;
  args.hidden = hidden;
  args.rms = rms;
  args.memory_efficient = memory_efficient;
  bool done = false;
  dispatch_backward_types(args, [&](auto t, auto wt, auto o, auto s) {
    using T = typename decltype(t)::type;
    using W = typename decltype(wt)::type;
    using O = typename decltype(o)::type;
    using S = typename decltype(s)::type;
    // The checks made S the output's dtype with memory_efficient, the input's otherwise.
    if constexpr (std::is_same_v<S, O>) {
      if (memory_efficient) done = backward_registers<T, W, O, true>(args);
    }
    if constexpr (std::is_same_v<S, T>) {
      if (!memory_efficient) done = backward_registers<T, W, O, false>(args);
    }
  });
  if (!done) backward_streaming(args);
  return {grad_input, grad_weight, grad_bias};
}

void sum_partials(const at::Tensor& partial_weight, const at::Tensor* partial_bias, at::Tensor& grad_weight,
                  at::Tensor* grad_bias) {
  const int64_t parts = partial_weight.size(0);
  const int64_t hidden = partial_weight.size(1);
  const bool wide = hidden % 4 == 0 && aligned16(partial_weight.const_data_ptr()) &&
                    (partial_bias == nullptr || aligned16(partial_bias->const_data_ptr()));
  const dim3 grid(static_cast<unsigned>(ceil_div(hidden, wide ? 4 * kWarp : kWarp)), partial_bias != nullptr ? 2 : 1);
  const dim3 block(kWarp, kSumRows);
  apex::dispatch_float_types(grad_weight.scalar_type(), "norm_backward", "weight", [&](auto tag) {
    using W = typename decltype(tag)::type;
    const auto kernel = wide ? sum_partials_kernel<W, 4> : sum_partials_kernel<W, 1>;
    kernel<<<grid, block, 0, at::cuda::getCurrentCUDAStream()>>>(
        partial_weight.const_data_ptr<float>(), partial_bias != nullptr ? partial_bias->const_data_ptr<float>() : nullptr,
        parts, hidden, static_cast<W*>(grad_weight.data_ptr()),
        grad_bias != nullptr ? static_cast<W*>(grad_bias->data_ptr()) : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace apex_normalization

