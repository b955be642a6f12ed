// The transducer joint: out[b, t, u] = f[b, t] + g[b, u] (then ReLU, dropout) and its backward, the
// sums of the output gradient over u (for f) and over t (for g). The math, the layouts and the
// wording of the checks are in _reference.py / _ops.py.
//
// The padded forward without ReLU or dropout writes the output as one flat array of vectors (the
// grid's writes at a time one contiguous stretch), loading f's and g's vectors for each. The other
// forwards and the backward give each block one batch element, a tile of t and a chunk of H: 8
// lanes along H (16-byte vectors) by 32 rows along t in the forward (256 threads), 32, 64 or 128
// rows in the backward. That forward holds its f vectors in registers and streams over u, reading
// g's vectors from shared memory (staged a chunk of u's at a time). The backward reads each gradient
// element once: a thread sums its t's over every u (f's gradient, complete), and the sums over its
// t's per u are added across the block's rows (shuffles, then shared memory) into g's gradient;
// with more than one t tile, into float32 partial sums that a second kernel adds in tile order
// (deterministic, no atomics).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include <apex/launch.cuh>

#include "transducer_common.cuh"
#include "cuda_ops.h"

namespace {

using namespace transducer;

constexpr int kLanes = 8;  // threads along H
constexpr int kRows = 32;  // threads along t
constexpr int kThreads = kLanes * kRows;
constexpr int kForwardTs = 4;             // t's per thread in the forward
// Forward blocks resident an SM (64 registers a thread): at 3 (78-80 registers) the 512 blocks of
// (32, 256, 64, 512) fp16 took 1.3 waves of 396 slots.
constexpr int kForwardMinBlocks = 4;
constexpr int kBackwardTs = 2;            // t's per thread in the backward
constexpr int kBackwardUs = 2;            // u's per step of the backward (loads in flight: Ts x Us)
constexpr int kUChunk = 8;                // u's per shared-memory buffer in the backward (Us divides it)
static_assert(kUChunk % kBackwardUs == 0);

// The dropout hash (_reference._mix32): xor-shift, multiply, xor-shift, multiply, xor-shift.
__host__ __device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

__device__ __forceinline__ uint32_t dropout_key(int64_t seed) {
  const auto s = static_cast<uint64_t>(seed);
  return mix32(static_cast<uint32_t>(s) ^ mix32(static_cast<uint32_t>(s >> 32) ^ 0x9e3779b9u));
}

struct Layout {
  const int* f_len;
  const int* g_len;
  const int64_t* batch_offset;  // null: padded
  int64_t B, T, U, H;
  int64_t rows;  // rows of the output / gradient (packed: the bound every row index is checked against)
  int64_t t_tiles, h_chunks;
};

struct Batch {
  int64_t b, F, G, base, stride_t;
};

__device__ __forceinline__ Batch batch_of(const Layout& l, int64_t b) {
  Batch r;
  r.b = b;
  r.F = clamp64(l.f_len[b], 0, l.T);
  r.G = clamp64(l.g_len[b], 0, l.U);
  if (l.batch_offset != nullptr) {
    r.base = b == 0 ? 0 : l.batch_offset[b - 1];
    r.stride_t = r.G;
  } else {
    r.base = b * l.T * l.U;
    r.stride_t = l.U;
  }
  return r;
}

// g's vectors of the block (its H chunk) are staged in shared memory kRows u's at a time, one
// vector a thread, so the u loop reads them from shared memory: loaded from global memory at each
// u (as first written), each g vector's latency stood between a thread's stores of one u and the
// next, and the forward, a pure write stream, ran at 62% of the DRAM rate (ncu: 84% of the warps'
// time waiting on those loads).
template <typename T, int VW, bool kMasked>
__global__ void __launch_bounds__(kThreads, kMasked ? 1 : kForwardMinBlocks)
    joint_forward_kernel(const T* __restrict__ f, const T* __restrict__ g, Layout l, bool relu,
                         const int64_t* seed, uint64_t threshold, double scale, T* __restrict__ out,
                         uint8_t* __restrict__ mask) {
  using A = acc_t<T>;
  __shared__ Vec<T, VW> g_stage[kRows][kLanes];
  const int lane = threadIdx.x % kLanes;
  const int row = threadIdx.x / kLanes;
  const int64_t block = blockIdx.x;
  const int64_t hc = block % l.h_chunks;
  const int64_t tile = (block / l.h_chunks) % l.t_tiles;
  const Batch bt = batch_of(l, block / (l.h_chunks * l.t_tiles));
  const int64_t h0 = (hc * kLanes + lane) * VW;
  const bool active = h0 < l.H;  // every thread stays for the block's barriers
  const bool packed = l.batch_offset != nullptr;
  const uint32_t key = (kMasked && seed != nullptr) ? dropout_key(*seed) : 0u;

  const int64_t n_u = packed ? bt.G : l.U;
  const int64_t t_end = packed ? bt.F : l.T;
  // Per t of this thread: f's vector as loaded (converted at each use: 16 registers, not 32, for
  // 4 x 8 16-bit values), whether f holds the t (t < F), its first output row (u = 0) and the u's
  // it writes (none past t_end; packed offsets beyond the output write nothing).
  Vec<T, VW> fv[kForwardTs];
  unsigned f_valid = 0u;
  int64_t row0[kForwardTs];
  int u_count[kForwardTs];
#pragma unroll
  for (int i = 0; i < kForwardTs; ++i) {
    const int64_t t = tile * (kForwardTs * kRows) + i * kRows + row;
    if (active && t < bt.F) {
      fv[i] = *reinterpret_cast<const Vec<T, VW>*>(f + (bt.b * l.T + t) * l.H + h0);
      f_valid |= 1u << i;
    }
    row0[i] = bt.base + t * bt.stride_t;
    u_count[i] = active && t < t_end ? static_cast<int>(clamp64(l.rows - row0[i], 0, n_u)) : 0;
  }
  for (int64_t u0 = 0; u0 < n_u; u0 += kRows) {  // (64-bit: u0 + kRows may pass 2^31)
    const int n = n_u - u0 < kRows ? static_cast<int>(n_u - u0) : kRows;
    __syncthreads();  // the previous chunk's reads are done
    if (active && u0 + row < bt.G) {
      g_stage[row][lane] = *reinterpret_cast<const Vec<T, VW>*>(g + (bt.b * l.U + u0 + row) * l.H + h0);
    }
    __syncthreads();
    for (int k = 0; k < n; ++k) {
      const int u = static_cast<int>(u0) + k;
      Vec<T, VW> graw;
      if (u < bt.G) graw = g_stage[k][lane];
#pragma unroll
      for (int i = 0; i < kForwardTs; ++i) {
        if (u >= u_count[i]) continue;
        const int64_t out_row = row0[i] + u;
        const bool valid = ((f_valid >> i) & 1u) != 0u && u < bt.G;
        A v[VW];
        Vec<uint8_t, VW> m;
        // The high word of the element index is the same across the vector (it starts at a
        // multiple of VW, and 2^32 is one), so the inner hash is taken once.
        const auto e0 = static_cast<uint64_t>(out_row * l.H + h0);
        const uint32_t inner = (kMasked && seed != nullptr) ? mix32(static_cast<uint32_t>(e0 >> 32) ^ key) : 0u;
#pragma unroll
        for (int j = 0; j < VW; ++j) {
          if (!valid) {
            v[j] = A(-1);
            m.v[j] = 0;
            continue;
          }
          v[j] = static_cast<A>(fv[i].v[j]) + static_cast<A>(graw.v[j]);
          if constexpr (kMasked) {
            bool keep = relu ? v[j] > A(0) : true;
            if (seed != nullptr) {
              const uint32_t r = mix32(static_cast<uint32_t>(e0 + j) ^ inner);
              keep = keep && static_cast<uint64_t>(r) < threshold;
              v[j] = v[j] * static_cast<A>(scale);
            }
            v[j] = keep ? v[j] : A(0);
            m.v[j] = keep ? 1 : 0;
          }
        }
        store_acc<VW>(out + out_row * l.H + h0, v);
        if constexpr (kMasked) *reinterpret_cast<Vec<uint8_t, VW>*>(mask + out_row * l.H + h0) = m;
      }
    }
  }
}

// The flat forward divides each vector's index three times by divisors fixed at launch: PyTorch's
// IntDivider does it as a multiply and a shift (indices below 2^31), where integer divisions would
// cost more instructions than the rest of the kernel's work.
using FastDiv = at::cuda::detail::IntDivider<uint32_t>;

// The padded forward without ReLU or dropout over the output as one flat array of vectors: block
// i writes vectors [256 K i, 256 K (i + 1)) of each grid step, so what the grid writes at a time is
// one contiguous stretch. The tiled kernel above (128 t's x 8 lanes a block, each thread over u)
// writes ~4000 separate 1 KB rows at once across the device; on the H200 a pure write stream in
// that pattern ran at 3.5 TB/s against 4.2 TB/s for a contiguous one (benchmarks/NOTES.md). Each
// vector's f and g vectors are loaded (L1 and L2 hits: f and g are 1/64 of the output at the bench
// shape), K vectors a thread in flight.
template <typename T, int VW, bool kStreaming>
__global__ void __launch_bounds__(256) joint_forward_flat_kernel(const T* __restrict__ f, const T* __restrict__ g,
                                                                   const int* __restrict__ f_len,
                                                                   const int* __restrict__ g_len, FastDiv per_row,
                                                                   FastDiv per_u, FastDiv per_t, uint32_t n_vec,
                                                                   T* __restrict__ out) {
  using A = acc_t<T>;
  constexpr int K = 4;
  const uint32_t hv = per_row.divisor, U = per_u.divisor, T_ = per_t.divisor;
  const int64_t H = int64_t{hv} * VW;
  for (uint32_t first = blockIdx.x * (256u * K) + threadIdx.x; first < n_vec; first += gridDim.x * (256u * K)) {
    Vec<T, VW> fv[K], gv[K];
    bool valid[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const uint32_t v = min(first + k * 256u, n_vec - 1);  // past the end: the last vector again, not stored
      const uint32_t row = per_row.div(v);
      const uint32_t hh = v - row * hv;
      const uint32_t bt = per_u.div(row);
      const uint32_t u = row - bt * U;
      const uint32_t b = per_t.div(bt);
      const uint32_t t = bt - b * T_;
      valid[k] = static_cast<int64_t>(t) < f_len[b] && static_cast<int64_t>(u) < g_len[b];
      fv[k] = *reinterpret_cast<const Vec<T, VW>*>(f + bt * H + hh * VW);
      gv[k] = *reinterpret_cast<const Vec<T, VW>*>(g + (int64_t{b} * U + u) * H + hh * VW);
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const uint32_t v = first + k * 256u;
      A o[VW];
#pragma unroll
      for (int j = 0; j < VW; ++j) o[j] = valid[k] ? static_cast<A>(fv[k].v[j]) + static_cast<A>(gv[k].v[j]) : A(-1);
      if (v < n_vec) store_acc<VW, kStreaming>(out + int64_t{v} * VW, o);
    }
  }
}

// An unsigned type of N bytes (a vector of words for 8 and 16): a vector's bits in registers.
template <int N>
struct Bits;
template <>
struct Bits<1> {
  using type = uint8_t;
};
template <>
struct Bits<2> {
  using type = uint16_t;
};
template <>
struct Bits<4> {
  using type = uint32_t;
};
template <>
struct Bits<8> {
  using type = uint2;
};
template <>
struct Bits<16> {
  using type = uint4;
};

// Sums v over the four rows of a warp (lanes differing in bits 3 and 4) and scatters the sum: each
// exchange sends the half of the values the partner keeps, so N values take N / 2 + N / 4 shuffles
// (an all-reduce takes 2 N) and every lane ends with N / 4 of the sums (in v[0 ..]), those of the
// positions warp_rows_place gives. With N < 4 a level that has one value left adds it whole. The order of the additions is
// fixed by the lane.
template <int N, typename A>
__device__ __forceinline__ void sum_warp_rows(A (&v)[N]) {
  const int l = threadIdx.x % 32;
  constexpr int c1 = N >= 2 ? N / 2 : 1;
  if constexpr (N >= 2) {
    const bool hi = (l & 16) != 0;
#pragma unroll
    for (int k = 0; k < c1; ++k) {
      const A send = hi ? v[k] : v[k + c1];
      const A keep = hi ? v[k + c1] : v[k];
      v[k] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
    }
  } else {
    v[0] += __shfl_xor_sync(0xffffffffu, v[0], 16);
  }
  if constexpr (c1 >= 2) {
    constexpr int c2 = c1 / 2;
    const bool hi = (l & 8) != 0;
#pragma unroll
    for (int k = 0; k < c2; ++k) {
      const A send = hi ? v[k] : v[k + c2];
      const A keep = hi ? v[k + c2] : v[k];
      v[k] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
    }
  } else {
    v[0] += __shfl_xor_sync(0xffffffffu, v[0], 8);
  }
}

// Where sum_warp_rows leaves this lane's sums: positions offset .. offset + max(N / 4, 1) - 1 of
// v; returns whether the lane stores them (with N < 4 lanes hold the same sums, and only those with
// the bit of the whole-value level clear store).
template <int N>
__device__ __forceinline__ bool warp_rows_place(int& offset) {
  const int l = threadIdx.x % 32;
  const bool hi1 = (l & 16) != 0, hi2 = (l & 8) != 0;
  if constexpr (N >= 4) {
    offset = (hi1 ? N / 2 : 0) + (hi2 ? N / 4 : 0);
    return true;
  } else if constexpr (N == 2) {
    offset = hi1 ? 1 : 0;
    return !hi2;
  } else {
    offset = 0;
    return !hi1 && !hi2;
  }
}

// The backward's block: 8 lanes along H by `rows` (blockDim.x / 8: 32, 64 or 128) rows along t; a
// thread sums kBackwardTs t's (rows apart) over kBackwardUs u's a step, so a t tile is kBackwardTs *
// rows t's and a thread has kBackwardTs * kBackwardUs vector loads in flight. Registers are bounded
// for 1024 threads an SM (two 512-thread blocks, or one of 1024 for 128 rows): the f accumulators
// (Ts x VW) are what registers cost, and more u's a step (not more t's) buy loads in flight without
// more of them. The loads run one step ahead of the sums (software pipelined), so they stay in
// flight across the shuffles, the barrier and the block's sums of a chunk. g's per-u sums of a
// warp (its four rows summed by sum_warp_rows) go to shared memory, kUChunk u's at a time, double
// buffered: after the one barrier a chunk the block adds the warps' sums (in warp order) while the
// next chunk fills the other buffer; the barrier after that chunk orders the buffer's reuse.
template <typename T, int VW, bool kMasked, int kMaxThreads>
__global__ void __launch_bounds__(kMaxThreads, 1024 / kMaxThreads)
    joint_backward_kernel(const T* __restrict__ grad, const uint8_t* __restrict__ mask, Layout l, double scale,
                          T* __restrict__ f_grad, T* __restrict__ g_grad, acc_t<T>* __restrict__ g_partial) {
  using A = acc_t<T>;
  constexpr int kChunk = kLanes * VW;  // H elements per block
  // u's a step: the mask's vectors take registers too, so the masked kernel loads one u ahead
  constexpr int kUs = kMasked ? 1 : kBackwardUs;
  constexpr int kSums = kUs * VW;            // g's sums of a step, u major
  constexpr int kKept = kSums >= 4 ? kSums / 4 : 1;  // those a lane holds after sum_warp_rows
  static_assert(VW % kKept == 0);                     // (so they lie in one u)
  extern __shared__ __align__(16) unsigned char backward_smem[];
  A* const stage = reinterpret_cast<A*>(backward_smem);  // [2][kUChunk][warps][kChunk]
  const int rows = static_cast<int>(blockDim.x) / kLanes;
  const int warps = static_cast<int>(blockDim.x) / 32;
  const int lane = threadIdx.x % kLanes;
  const int row = threadIdx.x / kLanes;
  const int warp = threadIdx.x / 32;
  const int64_t block = blockIdx.x;
  const int64_t hc = block % l.h_chunks;
  const int64_t tile = (block / l.h_chunks) % l.t_tiles;
  const Batch bt = batch_of(l, block / (l.h_chunks * l.t_tiles));
  const int64_t h0 = (hc * kLanes + lane) * VW;
  const bool active = h0 < l.H;  // every thread stays for the block's barriers and shuffles
  const int G = static_cast<int>(bt.G);  // g_len is int32, and so are full and part
  const A s = static_cast<A>(scale);

  const int64_t t0 = tile * (kBackwardTs * rows) + row;
  // The u's of t_i = t0 + i * rows that hold gradient are those below lim_i: below g_len, none past
  // f_len and (packed) only rows below the bound l.rows. lim_i does not grow with i (t grows), and
  // the rows bound lowers it by rows * stride_t >= G from one i to the next, so the i's are some
  // `full` with lim_i = G, then at most one with 0 < lim_i < G (`part`), then none: (t_i, u) holds
  // gradient exactly when u < G and i < full + (u < part). Two registers, not one a t.
  int full = 0, part = 0;
#pragma unroll
  for (int i = 0; i < kBackwardTs; ++i) {
    const int64_t t = t0 + int64_t{i} * rows;
    int64_t lim = 0;
    if (active && t < bt.F) lim = clamp64(l.rows - (bt.base + t * bt.stride_t), 0, bt.G);
    if (full == i && lim == bt.G) {
      ++full;
    } else if (full == i && lim > 0) {
      part = static_cast<int>(lim);
    }
  }
  auto valid_ts = [&](int64_t u) { return u < G ? full + (u < part ? 1 : 0) : 0; };  // t's i below hold u
  A f_acc[kBackwardTs][VW];
#pragma unroll
  for (int i = 0; i < kBackwardTs; ++i) {
#pragma unroll
    for (int j = 0; j < VW; ++j) f_acc[i][j] = A(0);
  }
  const int64_t ustep = l.H;                               // elements from u to u + 1
  const int64_t tstep = int64_t{rows} * bt.stride_t * l.H;  // elements from t_i to t_i+1
  // g's gradient for this tile: the final value with one tile, else this tile's partial sum.
  auto write_g = [&](int64_t u, int64_t h, A value) {
    if (g_partial == nullptr) {
      g_grad[(bt.b * l.U + u) * l.H + h] = static_cast<T>(value);
    } else {
      g_partial[((tile * l.B + bt.b) * l.U + u) * l.H + h] = value;
    }
  };

  // This lane's place in a chunk's buffer (position kept_at of a step's kSums), and whether it
  // stores there.
  int kept_at;
  const bool stores = warp_rows_place<kSums>(kept_at);
  const int buffer = kUChunk * warps * kChunk;
  const int lane_at = ((kept_at / VW) * warps + warp) * kChunk + lane * VW + kept_at % VW;

  // The vectors of a step: zeros where there is no gradient (adding +0 to sums that start at +0
  // changes nothing), so no load sits in a branch with its use, which would wait for it before
  // the next load is issued (the kernel as first written had one load in flight a thread).
  using W = typename Bits<sizeof(T) * VW>::type;  // a gradient vector's bits
  using MW = typename Bits<VW>::type;             // a mask vector's bits
  W raw[kUs][kBackwardTs];
  MW m[kUs][kBackwardTs];
  int64_t e = (bt.base + t0 * bt.stride_t) * l.H + h0;  // the element of (t0, u), u the next step's
  auto load = [&](int uu, int i, int valid) {
    const bool ok = i < valid;
    const int64_t at = e + uu * ustep + i * tstep;
    raw[uu][i] = W{};
    if (ok) raw[uu][i] = *reinterpret_cast<const W*>(grad + at);
    if constexpr (kMasked) {
      m[uu][i] = MW{};
      if (ok) m[uu][i] = *reinterpret_cast<const MW*>(mask + at);
    }
  };
#pragma unroll
  for (int uu = 0; uu < kUs; ++uu) {
    const int valid = valid_ts(uu);
#pragma unroll
    for (int i = 0; i < kBackwardTs; ++i) load(uu, i, valid);
  }
  e += kUs * ustep;

  int parity = 0;
  for (int64_t u0 = 0; u0 < G; u0 += kUChunk, parity ^= 1) {  // (64-bit: u0 + kUChunk may pass 2^31)
    const int n = G - u0 < kUChunk ? static_cast<int>(G - u0) : kUChunk;
    A* const buf = stage + parity * buffer;
#pragma unroll 1
    for (int k = 0; k < n; k += kUs) {
      const int64_t next = u0 + k + kUs;  // the first u of the next step
      A gsum[kSums];
#pragma unroll
      for (int j = 0; j < kSums; ++j) gsum[j] = A(0);
#pragma unroll
      for (int uu = 0; uu < kUs; ++uu) {
        const int valid = valid_ts(next + uu);
#pragma unroll
        for (int i = 0; i < kBackwardTs; ++i) {
          Vec<T, VW> v;
          memcpy(&v, &raw[uu][i], sizeof(v));
          Vec<uint8_t, VW> mv;
          if constexpr (kMasked) memcpy(&mv, &m[uu][i], sizeof(mv));
          load(uu, i, valid);  // the slot is free: the next step's vector
#pragma unroll
          for (int j = 0; j < VW; ++j) {
            A d = static_cast<A>(v.v[j]);
            if constexpr (kMasked) d *= static_cast<A>(mv.v[j]);
            d *= s;
            f_acc[i][j] += d;
            gsum[uu * VW + j] += d;
          }
        }
      }
      e += kUs * ustep;
      // u's of the step past G add zeros into buffer slots the block's sums skip (k + uu < kUChunk)
      sum_warp_rows<kSums>(gsum);
      if (stores) {
        A* const dst = buf + k * warps * kChunk + lane_at;
#pragma unroll
        for (int j = 0; j < kKept; ++j) dst[j] = gsum[j];
      }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < n * kChunk; idx += blockDim.x) {
      const int k = idx / kChunk;
      const int hh = idx % kChunk;
      const int64_t h = hc * kChunk + hh;
      if (h >= l.H) continue;
      const A* src = buf + k * warps * kChunk + hh;
      A sum = A(0);
      for (int w = 0; w < warps; ++w) sum += src[w * kChunk];
      write_g(u0 + k, h, sum);
    }
  }
  // u past g_len: zero gradient (and zero partial sums)
  for (int64_t idx = threadIdx.x; idx < (l.U - bt.G) * kChunk; idx += blockDim.x) {
    const int64_t u = bt.G + idx / kChunk;
    const int64_t h = hc * kChunk + idx % kChunk;
    if (h < l.H) write_g(u, h, A(0));
  }
  if (!active) return;
#pragma unroll
  for (int i = 0; i < kBackwardTs; ++i) {
    const int64_t t = t0 + int64_t{i} * rows;
    if (t < l.T) store_acc<VW>(f_grad + (bt.b * l.T + t) * l.H + h0, f_acc[i]);
  }
}

// g_grad[i] = sum over tiles of g_partial[tile][i], in tile order.
template <typename T>
__global__ void sum_partials_kernel(const acc_t<T>* __restrict__ partial, int64_t tiles, int64_t n, T* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    acc_t<T> s = 0;
    for (int64_t k = 0; k < tiles; ++k) s += partial[k * n + i];
    out[i] = static_cast<T>(s);
  }
}

// The widest vector (16 bytes) every row of `pointers` can use, else one element.
template <typename T>
int vector_width(int64_t H, std::initializer_list<const void*> pointers) {
  constexpr int kWidth = 16 / sizeof(T);
  if (H % kWidth != 0) return 1;
  for (const void* p : pointers) {
    if (p != nullptr && !apex::aligned_to(p, 16)) return 1;
  }
  return kWidth;
}

unsigned int grid_of(int64_t blocks) {
  TORCH_CHECK(blocks < (int64_t{1} << 31), "transducer: too many blocks (", blocks, ")");
  return static_cast<unsigned int>(blocks);
}

constexpr const char* kForward = "joint_forward";
constexpr const char* kBackward = "joint_backward";

}  // namespace

namespace apex_contrib_transducer {

std::tuple<at::Tensor, at::Tensor> joint_forward_cuda(const at::Tensor& f, const at::Tensor& g, const at::Tensor& f_len,
                                                      const at::Tensor& g_len,
                                                      const std::optional<at::Tensor>& batch_offset,
                                                      int64_t packed_batch, bool relu, double dropout_prob,
                                                      const std::optional<at::Tensor>& seed) {
  const char* op = kForward;
  float_tensor(op, "f", f, f.device());
  dims(op, "f", f, 3, "[B, T, H]");
  float_tensor(op, "g", g, f.device());
  dims(op, "g", g, 3, "[B, U, H]");
  TORCH_CHECK_TYPE(g.scalar_type() == f.scalar_type(), op, ": g has dtype ", apex::checks::torch_dtype(g.scalar_type()),
                   " but f has ", apex::checks::torch_dtype(f.scalar_type()));
  TORCH_CHECK_VALUE(g.size(0) == f.size(0) && g.size(2) == f.size(2), op, ": g has shape ",
                    apex::checks::shape_string(g.sizes()), "; expected [", f.size(0), ", U, ", f.size(2),
                    "] for f of shape ", apex::checks::shape_string(f.sizes()));
  const int64_t B = f.size(0), T = f.size(1), H = f.size(2), U = g.size(1);
  lengths(op, "f_len", f_len, "g_len", g_len, batch_offset, B, f.device());
  non_negative(op, "packed_batch", packed_batch);
  TORCH_CHECK_VALUE(dropout_prob >= 0.0 && dropout_prob <= 1.0, op, ": dropout_prob must lie in [0, 1], got ",
                    dropout_prob);
  if (seed.has_value()) index_tensor(op, "seed", *seed, c10::ScalarType::Long, {1}, f.device());

  const c10::cuda::CUDAGuard guard(f.device());
  const bool packed = batch_offset.has_value();
  const bool masked = relu || seed.has_value();
  std::vector<int64_t> shape = packed ? std::vector<int64_t>{packed_batch, H} : std::vector<int64_t>{B, T, U, H};
  at::Tensor out = at::empty(shape, f.options());
  at::Tensor mask = at::empty(masked ? shape : std::vector<int64_t>{0}, f.options().dtype(at::kByte));
  if (out.numel() == 0 || B == 0 || T == 0) return {out, mask};

  Layout l{f_len.const_data_ptr<int>(),
           g_len.const_data_ptr<int>(),
           packed ? batch_offset->const_data_ptr<int64_t>() : nullptr,
           B,
           T,
           U,
           H,
           packed ? packed_batch : B * T * U,
           apex::ceil_div(T, kForwardTs * kRows),
           0};
  const int64_t* seed_ptr = seed.has_value() ? seed->const_data_ptr<int64_t>() : nullptr;
  const uint64_t threshold = static_cast<uint64_t>(std::floor((1.0 - dropout_prob) * 4294967296.0));
  // In double: float64 input scales by the double 1 / (1 - p), the others by its float rounding.
  const double scale = seed.has_value() ? (dropout_prob < 1.0 ? 1.0 / (1.0 - dropout_prob) : 0.0) : 1.0;
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch(f.scalar_type(), op, "f", [&](auto tag) {
    using T_ = typename decltype(tag)::type;
    const int vw = vector_width<T_>(H, {f.const_data_ptr(), g.const_data_ptr(), out.const_data_ptr()});
    auto launch = [&](auto width, auto masked_tag) {
      constexpr int VW = decltype(width)::value;
      constexpr bool M = decltype(masked_tag)::value;
      const int64_t n_vec = out.numel() / VW;
      if (!M && !packed && n_vec < (int64_t{1} << 31)) {
        // One wave of resident blocks, each striding over the output; streaming stores when the
        // output is larger than the L2 cache (its lines would only push f's and g's out).
        const bool streaming = out.nbytes() > static_cast<size_t>(at::cuda::getCurrentDeviceProperties()->l2CacheSize);
        const auto kernel = streaming ? joint_forward_flat_kernel<T_, VW, true> : joint_forward_flat_kernel<T_, VW, false>;
        int resident = 0;
        C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, 256, 0));
        const int64_t blocks = std::min<int64_t>(apex::ceil_div(n_vec, int64_t{256} * 4),
                                                 int64_t{apex::sm_count()} * std::max(resident, 1));
        kernel<<<static_cast<unsigned int>(blocks), 256, 0, stream>>>(
            f.const_data_ptr<T_>(), g.const_data_ptr<T_>(), l.f_len, l.g_len, FastDiv(static_cast<uint32_t>(H / VW)),
            FastDiv(static_cast<uint32_t>(U)), FastDiv(static_cast<uint32_t>(T)), static_cast<uint32_t>(n_vec),
            out.mutable_data_ptr<T_>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return;
      }
      l.h_chunks = apex::ceil_div(H, kLanes * VW);
      const auto blocks = grid_of(B * l.t_tiles * l.h_chunks);
      joint_forward_kernel<T_, VW, M><<<blocks, kThreads, 0, stream>>>(
          f.const_data_ptr<T_>(), g.const_data_ptr<T_>(), l, relu, seed_ptr, threshold, scale,
          out.mutable_data_ptr<T_>(), M ? mask.mutable_data_ptr<uint8_t>() : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    constexpr int kWide = 16 / sizeof(T_);
    if (masked) {
      if (vw == kWide) launch(std::integral_constant<int, kWide>{}, std::true_type{});
      else launch(std::integral_constant<int, 1>{}, std::true_type{});
    } else {
      if (vw == kWide) launch(std::integral_constant<int, kWide>{}, std::false_type{});
      else launch(std::integral_constant<int, 1>{}, std::false_type{});
    }
  });
  return {out, mask};
}

std::tuple<at::Tensor, at::Tensor> joint_backward_cuda(const at::Tensor& grad, const std::optional<at::Tensor>& mask,
                                                       const at::Tensor& f_len, const at::Tensor& g_len,
                                                       const std::optional<at::Tensor>& batch_offset, int64_t max_f_len,
                                                       int64_t max_g_len, double scale) {
  const char* op = kBackward;
  float_tensor(op, "grad", grad, grad.device());
  const bool packed = batch_offset.has_value();
  if (packed) {
    dims(op, "grad", grad, 2, "[rows, H] (packed)");
  } else {
    dims(op, "grad", grad, 4, "[B, T, U, H]");
  }
  const int64_t B = f_len.dim() == 1 ? f_len.size(0) : -1;
  lengths(op, "f_len", f_len, "g_len", g_len, batch_offset, B, grad.device());
  non_negative(op, "max_f_len", max_f_len);
  non_negative(op, "max_g_len", max_g_len);
  if (!packed) {
    TORCH_CHECK_VALUE(grad.size(0) == B && grad.size(1) == max_f_len && grad.size(2) == max_g_len, op,
                      ": grad has shape ", apex::checks::shape_string(grad.sizes()), "; expected [", B,
                      ", max_f_len=", max_f_len, ", max_g_len=", max_g_len, ", H]");
  }
  if (mask.has_value()) {
    TORCH_CHECK_TYPE(mask->scalar_type() == at::kByte, op, ": mask has dtype ",
                     apex::checks::torch_dtype(mask->scalar_type()), "; expected torch.uint8");
    TORCH_CHECK_VALUE(mask->sizes() == grad.sizes(), op, ": mask has shape ", apex::checks::shape_string(mask->sizes()),
                      " but grad has ", apex::checks::shape_string(grad.sizes()));
    apex::checks::dense(op, "mask", *mask, grad.device());
  }
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);

  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t H = grad.size(-1), T = max_f_len, U = max_g_len;
  at::Tensor f_grad = at::empty({B, T, H}, grad.options());
  at::Tensor g_grad = at::empty({B, U, H}, grad.options());
  if (B == 0 || H == 0 || (T == 0 && U == 0)) return {f_grad, g_grad};
  if (T == 0) {
    g_grad.zero_();
    return {f_grad, g_grad};
  }
  Layout l{f_len.const_data_ptr<int>(),
           g_len.const_data_ptr<int>(),
           packed ? batch_offset->const_data_ptr<int64_t>() : nullptr,
           B,
           T,
           U,
           H,
           packed ? grad.size(0) : B * T * U,
           0,
           0};
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch(grad.scalar_type(), op, "grad", [&](auto tag) {
    using T_ = typename decltype(tag)::type;
    using A = acc_t<T_>;
    const uint8_t* mask_ptr = mask.has_value() ? mask->const_data_ptr<uint8_t>() : nullptr;
    const int vw = vector_width<T_>(H, {grad.const_data_ptr(), mask_ptr, f_grad.const_data_ptr()});
    const bool mask_aligned = mask_ptr == nullptr || apex::aligned_to(mask_ptr, 16 / sizeof(T_));
    auto launch = [&](auto width, auto masked_tag) {
      constexpr int VW = decltype(width)::value;
      constexpr bool M = decltype(masked_tag)::value;
      l.h_chunks = apex::ceil_div(H, kLanes * VW);
      // The plan: 64 rows a block (a tile of 128 t's, 512 threads, two blocks an SM) unless every t
      // fits in 32 rows (T <= 64: 256 threads, so fewer rows sit idle), or in 128 rows (T <= 256:
      // 1024 threads) with a block a batch element and H chunk still filling every SM: one tile,
      // so no partial sums (at (32, 256, 64, 512) fp16 the backward 0.169 -> 0.159 ms; on fewer
      // blocks than SMs the 64-row plan's two tiles are faster, see benchmarks/NOTES.md). Several
      // tiles add their float32 partial sums of g's gradient in tile order (a second kernel). The
      // 128-row tile's shared memory (128 KB for 16-bit H chunks) is more than some GPUs give a
      // block (99 KB on sm_86/sm_89): those keep the 64-row plan.
      auto smem_of = [](int rows) { return size_t{2} * kUChunk * (rows / 4) * (kLanes * VW) * sizeof(A); };
      const bool one_tile = T > kBackwardTs * 64 && T <= kBackwardTs * 128 && B * l.h_chunks >= apex::sm_count() &&
                            smem_of(128) <= apex::smem_per_block_optin();
      const int rows = T <= kBackwardTs * 32 ? 32 : one_tile ? 128 : 64;
      const int threads = kLanes * rows;
      l.t_tiles = apex::ceil_div(T, kBackwardTs * rows);
      at::Tensor partial;
      if (l.t_tiles > 1) partial = at::empty({l.t_tiles, B, U, H}, grad.options().dtype(compute_dtype(grad.scalar_type())));
      A* partial_ptr = l.t_tiles > 1 ? partial.mutable_data_ptr<A>() : nullptr;
      const auto blocks = grid_of(B * l.t_tiles * l.h_chunks);
      const size_t smem = smem_of(rows);
      const auto kernel = one_tile ? joint_backward_kernel<T_, VW, M, 1024> : joint_backward_kernel<T_, VW, M, 512>;
      apex::allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, true);
      kernel<<<blocks, threads, smem, stream>>>(
          grad.const_data_ptr<T_>(), mask_ptr, l, scale, f_grad.mutable_data_ptr<T_>(),
          g_grad.mutable_data_ptr<T_>(), partial_ptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (partial_ptr != nullptr) {
        const int64_t n = B * U * H;
        const auto sum_blocks = static_cast<unsigned int>(std::min<int64_t>(apex::ceil_div(n, 256), 4 * 1024));
        sum_partials_kernel<T_><<<sum_blocks, 256, 0, stream>>>(partial_ptr, l.t_tiles, n, g_grad.mutable_data_ptr<T_>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    };
    constexpr int kWide = 16 / sizeof(T_);
    const bool wide = vw == kWide && mask_aligned;
    if (mask_ptr != nullptr) {
      if (wide) launch(std::integral_constant<int, kWide>{}, std::true_type{});
      else launch(std::integral_constant<int, 1>{}, std::true_type{});
    } else {
      if (wide) launch(std::integral_constant<int, kWide>{}, std::false_type{});
      else launch(std::integral_constant<int, 1>{}, std::false_type{});
    }
  });
  return {f_grad, g_grad};
}

}  // namespace apex_contrib_transducer

