// norm_forward and add_norm_forward: layer norm or RMS norm of each row, optionally of
// input + residual, in one pass over memory. See _reference.norm_forward for the math.
//
// Two kernels, chosen by plan_forward (beside launch_forward):
// - forward_in_registers, when every row is 16-byte aligned and holds whole vectors (hidden a
//   multiple of the vector width) and fits in registers (at most 1024 threads x kForwardVecs
//   vectors: 32768 elements of 16-bit types, 16384 of float32). A row group (see
//   norm_common.cuh) loads its row once into registers with 16-byte loads, reduces, and writes
//   the output: 4 bytes of traffic per 16-bit element (6 with a residual, plus 2 for the sum).
//   Layer norm statistics in two passes over the registers: the mean, then the sum of squared
//   deviations from it (exact, no cancellation; two plain sums cost less than one Welford merge,
//   benchmarks/NOTES.md); RMS norm: one sum of squares. Four variants of it (see the kernel):
//   plain, kSmallRows, kPrefetch, and kPrefetch with kHold.
// - forward_streaming, for anything else (odd sizes, misaligned rows, longer rows): one block
//   per row, a Welford pass over the row, then a pass that normalizes, re-reading the row
//   (from L2 at these sizes).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>

#include "norm_common.cuh"
#include "norm_float64.h"
#include "cuda_ops.h"

namespace apex_normalization {
namespace {

// Vectors per thread of a row held in registers (16 bytes each of the narrowest type).
constexpr int kForwardVecs = 4;
// Threads per block when a row needs at most a warp (several rows per block).
constexpr int kSmallRowBlock = 256;
// Most threads per block of the kernel that holds the weights in registers.
constexpr int kHoldBlock = 512;

template <typename T, typename W, typename O>
struct ForwardParams {
  const T* input;
  const T* residual;  // may be null
  const W* weight;    // may be null
  const W* bias;      // may be null
  O* output;
  T* residual_out;  // input + residual, when residual is given
  float* mean;      // null for RMS norm
  float* rstd;
  int64_t rows;
  int64_t hidden;
  float eps;
  bool rms;
  int group_threads;
  int64_t tiles;     // forward_in_registers: ceil(rows / groups per block), computed on the host
  float inv_hidden;  // 1 / hidden
};

// y = (x - mean) * rstd * weight + bias for the vectors of a row that a thread holds. The
// restrict-qualified pointers let the weight loads of later vectors move above earlier stores.
//
// kLoaded: the weight and bias vectors are already in registers (w, b): the small-row kernel
// copies them into shared memory at its start, while its input loads are in flight, and reads
// them from there after the row's statistics; the holding kernel loads them once for all its
// rows. In the per-vector loop below (neither kernel) each load sits in its own `valid[k]`
// branch after the previous vector's store, and the compiler does not hoist loads out of
// branches: the SASS shows one dependent weight load per vector, four L2 round trips per row,
// which is what a latency-bound small problem pays. Holding them needs registers that only the
// small-row kernel and the holding kernel (kHold, at most kHoldBlock threads per block) have.
template <int kVecs, int kV, bool kLoaded, typename T, typename W, typename O>
__device__ __forceinline__ void write_row(O* __restrict__ out, const W* __restrict__ weight,
                                          const W* __restrict__ bias, const Vec<T, kV> (&x)[kVecs],
                                          const bool (&valid)[kVecs], int lane, int threads, float mean, float rstd,
                                          const Vec<W, kV> (&w)[kLoaded ? kVecs : 1],
                                          const Vec<W, kV> (&b)[kLoaded ? kVecs : 1]) {
  if constexpr (kLoaded) {
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      if (!valid[k]) continue;
      float y[kV];
      to_floats(y, x[k]);
#pragma unroll
      for (int j = 0; j < kV; ++j) y[j] = (y[j] - mean) * rstd;
      float wf[kV], bf[kV];
      to_floats(wf, w[k]);
      to_floats(bf, b[k]);
      if (weight != nullptr && bias != nullptr) {
#pragma unroll
        for (int j = 0; j < kV; ++j) y[j] = fmaf(y[j], wf[j], bf[j]);
      } else if (weight != nullptr) {
#pragma unroll
        for (int j = 0; j < kV; ++j) y[j] *= wf[j];
      }
      store_floats(out + (lane + k * threads) * kV, y);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      if (!valid[k]) continue;
      const int col = (lane + k * threads) * kV;
      float y[kV];
      to_floats(y, x[k]);
#pragma unroll
      for (int j = 0; j < kV; ++j) y[j] = (y[j] - mean) * rstd;
      if (weight != nullptr && bias != nullptr) {  // one fused multiply-add per element
        float w[kV], b[kV];
        load_floats(w, weight + col);
        load_floats(b, bias + col);
#pragma unroll
        for (int j = 0; j < kV; ++j) y[j] = fmaf(y[j], w[j], b[j]);
        store_floats(out + col, y);
        continue;
      }
      if (weight != nullptr) {
        float w[kV];
        load_floats(w, weight + col);
#pragma unroll
        for (int j = 0; j < kV; ++j) y[j] *= w[j];
      }
      if (bias != nullptr) {
        float b[kV];
        load_floats(b, bias + col);
#pragma unroll
        for (int j = 0; j < kV; ++j) y[j] += b[j];
      }
      store_floats(out + col, y);
    }
  }
}

// Sum of (x - mean)^2 over the valid vectors a thread holds.
template <int kVecs, typename T, int kV>
__device__ __forceinline__ float squared_deviations(const Vec<T, kV> (&x)[kVecs], const bool (&valid)[kVecs],
                                                    float mean) {
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    if (!valid[k]) continue;
    float f[kV];
    to_floats(f, x[k]);
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      const float d = f[j] - mean;
      sum += d * d;
    }
  }
  return sum;
}

// kPrefetch: the rows of the next tile are copied into shared memory (two buffers of
// [groups][vectors] 16-byte vectors per source tensor: the input, and the residual if any)
// while this tile is processed, so that loads stay in flight through the reductions.
// kSmallRows: the one-wave kernel for rows of at most a warp's worth of vectors (blocks of
// kSmallRowBlock threads, one tile each), compiled for that block size so that it has the
// registers to hold the weight and bias before its stores (write_row): the 1024-thread kernel
// issues each vector's weight load after the previous store, which a latency-bound problem pays
// for. It stages them once per block in shared memory rather than loading them per row group,
// which costs most when the weight is cold in L2 (as the benchmark has it).
// kHold: the weight and bias vectors of a thread's columns are loaded once, at the start, and held
// in registers for every row (blocks of at most kHoldBlock threads, for the registers; see
// plan_forward for when).
template <typename T, typename W, typename O, int kVecs, bool kPrefetch, bool kSmallRows = false, bool kHold = false>
__global__ void __launch_bounds__(kSmallRows ? kSmallRowBlock : (kHold ? kHoldBlock : kMaxThreads))
    forward_in_registers(const ForwardParams<T, W, O> p) {
  constexpr int kV = apex::vector_width<T, W, O>();
  static_assert(sizeof(Vec<T, kV>) == 16, "T is the narrowest type: one 16-byte vector");
  __shared__ float sum_scratch[2 * 2 * (kMaxThreads / kWarp)];  // two buffers of up to two floats per warp
  int turn = 0;
  extern __shared__ uint4 staged[];
  const BlockRowGroup g(p.group_threads);  // a multi-warp group is the whole block
  const int vectors = static_cast<int>(p.hidden / kV);
  const int64_t tiles = p.tiles;
  const float inv_hidden = p.inv_hidden;
  const int sources = p.residual != nullptr ? 2 : 1;
  // The small-row kernel's blocks take one tile each: its weight and bias are loaded here, with
  // the input still to come, rather than after the row's reductions. It copies them once per
  // block into shared memory (dynamic, [2][vectors] vectors of W) and every group reads them from
  // there after the row's statistics: each of its groups loading the whole weight from global
  // memory asks L2 for each line once per group, which costs most when the weight is not in L2.
  constexpr bool kLoaded = kSmallRows || kHold;
  Vec<W, kV> weights[kLoaded ? kVecs : 1];
  Vec<W, kV> biases[kLoaded ? kVecs : 1];
  constexpr int kPiecesW = sizeof(Vec<W, kV>) / 16;
  uint4* staged_weight = staged;
  uint4* staged_bias = staged + static_cast<int64_t>(vectors) * kPiecesW;
  if constexpr (kSmallRows) {
    const int pieces = vectors * kPiecesW;
    for (int i = static_cast<int>(threadIdx.x); i < pieces; i += static_cast<int>(blockDim.x)) {
      if (p.weight != nullptr) copy_async16(staged_weight + i, reinterpret_cast<const uint4*>(p.weight) + i);
      if (p.bias != nullptr) copy_async16(staged_bias + i, reinterpret_cast<const uint4*>(p.bias) + i);
    }
    copy_async_commit();
  } else if constexpr (kLoaded) {
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int v = g.lane + k * g.threads;
      if (v < vectors && p.weight != nullptr) weights[k] = load_vector<W, kV>(p.weight + v * kV);
      if (v < vectors && p.bias != nullptr) biases[k] = load_vector<W, kV>(p.bias + v * kV);
    }
  }
  // Buffer b of source s for this group: staged + ((b * sources + s) * g.count + g.index) * vectors.
  auto buffer = [&](int b, int s) { return staged + (static_cast<int64_t>(b * sources + s) * g.count + g.index) * vectors; };
  auto prefetch = [&](int64_t tile, int b) {
    const int64_t row = tile * g.count + g.index;
    if (tile < tiles && row < p.rows) {
      const int64_t offset = row * p.hidden;
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        const int v = g.lane + k * g.threads;
        if (v < vectors) {
          copy_async16(buffer(b, 0) + v, p.input + offset + v * kV);
          if (p.residual != nullptr) copy_async16(buffer(b, 1) + v, p.residual + offset + v * kV);
        }
      }
    }
    copy_async_commit();  // possibly empty: every iteration commits one group
  };
  if constexpr (kPrefetch) prefetch(blockIdx.x, 0);

  int b = 0;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x, b ^= 1) {
    if constexpr (kPrefetch) {
      // Buffer b ^ 1 was read in the previous iteration, into registers that have been used since.
      prefetch(tile + gridDim.x, b ^ 1);
      copy_async_wait<1>();  // this tile's group has landed
    }
    const int64_t row = tile * g.count + g.index;
    const bool row_valid = row < p.rows;
    const int64_t offset = row * p.hidden;
    Vec<T, kV> x[kVecs];
    bool valid[kVecs];
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int v = g.lane + k * g.threads;
      valid[k] = row_valid && v < vectors;
#pragma unroll
      for (int j = 0; j < kV; ++j) x[k].val[j] = T(0.0f);
      if (valid[k]) {
        if constexpr (kPrefetch) {
          *reinterpret_cast<uint4*>(&x[k]) = buffer(b, 0)[v];
        } else {
          x[k] = load_vector<T, kV>(p.input + offset + v * kV);
        }
      }
    }
    if (p.residual != nullptr) {
      // The sum is rounded to T and stored; the norm is taken of the stored value.
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        if (!valid[k]) continue;
        const int v = g.lane + k * g.threads;
        const int64_t at = offset + v * kV;
        Vec<T, kV> r;
        if constexpr (kPrefetch) {
          *reinterpret_cast<uint4*>(&r) = buffer(b, 1)[v];
        } else {
          r = load_vector<T, kV>(p.residual + at);
        }
#pragma unroll
        for (int j = 0; j < kV; ++j) {
          x[k].val[j] = static_cast<T>(static_cast<float>(x[k].val[j]) + static_cast<float>(r.val[j]));
        }
        store_vector_plain(p.residual_out + at, x[k]);
      }
    }

    float mean = 0.0f;
    float rstd;
    if (p.rms) {
      float squares[1] = {0.0f};
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        float f[kV];
        to_floats(f, x[k]);
#pragma unroll
        for (int j = 0; j < kV; ++j) squares[0] += f[j] * f[j];
      }
      group_sum(squares, g, sum_scratch, turn);
      rstd = rsqrtf(squares[0] * inv_hidden + p.eps);
    } else {
      // Exact two-pass statistics of the row held in registers: the mean, then the sum of
      // squared deviations from it (two plain sums instead of one Welford merge).
      float sums[1] = {0.0f};
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        float f[kV];
        to_floats(f, x[k]);
#pragma unroll
        for (int j = 0; j < kV; ++j) sums[0] += f[j];
      }
      group_sum(sums, g, sum_scratch, turn);
      mean = sums[0] * inv_hidden;
      float squares[1] = {squared_deviations(x, valid, mean)};
      group_sum(squares, g, sum_scratch, turn);
      rstd = rsqrtf(squares[0] * inv_hidden + p.eps);
    }
    if (row_valid && g.lane == 0) {
      if (p.mean != nullptr) p.mean[row] = mean;
      p.rstd[row] = rstd;
    }

    if constexpr (kSmallRows) {
      // The one tile of every block: all its threads come here once.
      copy_async_wait<0>();
      __syncthreads();
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        const int v = g.lane + k * g.threads;
        if (v >= vectors) continue;
        if (p.weight != nullptr) unstage(weights[k], staged_weight + v * kPiecesW);
        if (p.bias != nullptr) unstage(biases[k], staged_bias + v * kPiecesW);
      }
    }
    write_row<kVecs, kV, kLoaded>(p.output + offset, p.weight, p.bias, x, valid, g.lane, g.threads, mean, rstd,
                                     weights, biases);
  }
}

template <typename T, typename W, typename O>
__global__ void __launch_bounds__(kStreamingThreads) forward_streaming(const ForwardParams<T, W, O> p) {
  constexpr int kV = apex::vector_width<T, W, O>();
  constexpr int kInFlight = 2;
  __shared__ float sum_scratch[kWarp];
  __shared__ apex::Welford<float> welford_scratch[kWarp];

  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t offset = row * p.hidden;
    const T* x = p.input + offset;
    apex::Welford<float> w{};
    float squares = 0.0f;
    auto accumulate = [&](float v) {
      if (p.rms) {
        squares += v * v;
      } else {
        w.update(v);
      }
    };
    const T* source = x;
    if (p.residual != nullptr) {
      const T* r = p.residual + offset;
      T* sum = p.residual_out + offset;
      apex::for_each_element<kV, kInFlight>(
          p.hidden,
          [&](auto group) {
            using G = decltype(group);
            float a[G::kCount][G::kWidth];
            float b[G::kCount][G::kWidth];
            group.load(a, x);
            group.load(b, r);
#pragma unroll
            for (int i = 0; i < G::kCount; ++i) {
#pragma unroll
              for (int j = 0; j < G::kWidth; ++j) {
                a[i][j] = static_cast<float>(static_cast<T>(a[i][j] + b[i][j]));
                accumulate(a[i][j]);
              }
            }
            group.store(sum, a);
          },
          x, r, sum);
      source = sum;
    } else {
      apex::for_each_element<kV, kInFlight>(
          p.hidden,
          [&](auto group) {
            using G = decltype(group);
            float a[G::kCount][G::kWidth];
            group.load(a, x);
#pragma unroll
            for (int i = 0; i < G::kCount; ++i) {
#pragma unroll
              for (int j = 0; j < G::kWidth; ++j) accumulate(a[i][j]);
            }
          },
          x);
    }

    // The block reductions start with a barrier: the sum written above is then visible to all.
    float mean = 0.0f;
    float rstd;
    if (p.rms) {
      rstd = rsqrtf(apex::block_sum(squares, sum_scratch) / static_cast<float>(p.hidden) + p.eps);
    } else {
      w = apex::block_welford(w, welford_scratch);
      mean = w.mean;
      rstd = rsqrtf(w.m2 / static_cast<float>(p.hidden) + p.eps);
    }
    if (threadIdx.x == 0) {
      if (p.mean != nullptr) p.mean[row] = mean;
      p.rstd[row] = rstd;
    }

    O* y = p.output + offset;
    apex::for_each_element<kV, kInFlight>(
        p.hidden,
        [&](auto group) {
          using G = decltype(group);
          float a[G::kCount][G::kWidth];
          float wt[G::kCount][G::kWidth];
          float bs[G::kCount][G::kWidth];
          group.load(a, source);
          if (p.weight != nullptr) group.load(wt, p.weight);
          if (p.bias != nullptr) group.load(bs, p.bias);
#pragma unroll
          for (int i = 0; i < G::kCount; ++i) {
#pragma unroll
            for (int j = 0; j < G::kWidth; ++j) {
              float v = (a[i][j] - mean) * rstd;
              if (p.weight != nullptr) v *= wt[i][j];
              if (p.bias != nullptr) v += bs[i][j];
              a[i][j] = v;
            }
          }
          group.store(y, a);
        },
        source, y, p.weight, p.bias);
  }
}

enum class ForwardKernel { kStreaming, kPlain, kSmallRows, kPrefetch, kHold };

template <typename T, typename W, typename O>
using ForwardKernelFn = void (*)(ForwardParams<T, W, O>);

template <typename T, typename W, typename O>
ForwardKernelFn<T, W, O> forward_kernel(ForwardKernel kernel) {
  switch (kernel) {
    case ForwardKernel::kPlain:
      return forward_in_registers<T, W, O, kForwardVecs, false>;
    case ForwardKernel::kSmallRows:
      return forward_in_registers<T, W, O, kForwardVecs, false, true>;
    case ForwardKernel::kPrefetch:
      return forward_in_registers<T, W, O, kForwardVecs, true>;
    case ForwardKernel::kHold:
      return forward_in_registers<T, W, O, kForwardVecs, true, false, true>;
    case ForwardKernel::kStreaming:
      break;
  }
  return forward_streaming<T, W, O>;
}

struct ForwardPlan {
  ForwardKernel kernel;
  int group_threads;  // forward_in_registers: threads per row
  int block;
  int64_t tiles;  // forward_in_registers: tiles of block / group_threads rows
  int64_t grid;
  size_t smem;  // dynamic shared memory per block
};

// Which kernel, and how it is launched, for the problem p describes on the current device. It
// sets the dynamic shared memory attributes of the kernels it weighs (occupancy depends on them).
// - Rows that fit in registers take forward_in_registers, a row group of group_threads per row.
// - kPrefetch once blocks walk over several tiles (more tiles than the grid holds at once) and
//   the two buffers per source fit in shared memory.
// - kHold among those, where there are a weight and a bias and blocks of at most kHoldBlock
//   threads: a row re-reads twice its own bytes of parameters from L2 otherwise. With a weight
//   alone (RMS norm) the halved occupancy costs as much as holding saves (benchmarks/NOTES.md).
// - kSmallRows for a one-wave problem (every tile resident at once) of rows of at most a warp's
//   worth of vectors. Blocks of 64 or 128 threads instead of kSmallRowBlock (more blocks over
//   the multiprocessors) measured the same.
// - Otherwise the plain kernel, as many blocks as are resident at once.
template <typename T, typename W, typename O>
ForwardPlan plan_forward(const ForwardParams<T, W, O>& p) {
  constexpr int kV = apex::vector_width<T, W, O>();
  const int sms = sm_count();
  ForwardPlan plan{};
  auto resident = [&](ForwardKernel kernel, size_t smem) {
    return static_cast<int64_t>(sms) *
           resident_blocks(reinterpret_cast<const void*>(forward_kernel<T, W, O>(kernel)), plan.block, smem);
  };
  auto allow = [&](ForwardKernel kernel, size_t smem, bool max_shared_carveout) {
    allow_dynamic_smem(reinterpret_cast<const void*>(forward_kernel<T, W, O>(kernel)), smem, max_shared_carveout);
  };

  const bool aligned = aligned16(p.input) && aligned16(p.output) && aligned16(p.residual) &&
                       aligned16(p.residual_out) && aligned16(p.weight) && aligned16(p.bias);
  const int64_t vectors = p.hidden / kV;
  if (!aligned || p.hidden % kV != 0 || vectors > static_cast<int64_t>(kMaxThreads) * kForwardVecs) {
    plan.kernel = ForwardKernel::kStreaming;
    plan.block = streaming_threads_for(p.hidden, kV);
    plan.grid = std::min<int64_t>(p.rows, resident(ForwardKernel::kStreaming, 0));
    return plan;
  }

  plan.group_threads = group_threads_for(vectors, kForwardVecs);
  plan.block = plan.group_threads <= kWarp ? kSmallRowBlock : plan.group_threads;
  const int groups = plan.block / plan.group_threads;
  plan.tiles = ceil_div(p.rows, groups);
  const size_t staged = 2 * static_cast<size_t>(p.residual != nullptr ? 2 : 1) * groups * vectors * 16;
  const size_t budget = apex::smem_per_block_optin() - 2048;
  if (staged <= budget) {
    allow(ForwardKernel::kPrefetch, staged, /*max_shared_carveout=*/true);
    const int64_t prefetching = resident(ForwardKernel::kPrefetch, staged);
    if (plan.tiles > prefetching) {
      plan.smem = staged;
      if (plan.block <= kHoldBlock && p.weight != nullptr && p.bias != nullptr) {
        plan.kernel = ForwardKernel::kHold;
        allow(plan.kernel, staged, /*max_shared_carveout=*/true);
        plan.grid = std::min<int64_t>(plan.tiles, resident(plan.kernel, staged));
      } else {
        plan.kernel = ForwardKernel::kPrefetch;
        plan.grid = std::min<int64_t>(plan.tiles, prefetching);
      }
      return plan;
    }
  }
  const size_t weights = 2 * static_cast<size_t>(vectors) * sizeof(Vec<W, kV>);  // weight, bias
  if (plan.group_threads <= kWarp && plan.tiles <= resident(ForwardKernel::kSmallRows, weights)) {
    plan.kernel = ForwardKernel::kSmallRows;
    allow(plan.kernel, weights, /*max_shared_carveout=*/false);
    plan.grid = plan.tiles;
    plan.smem = weights;
    return plan;
  }
  plan.kernel = ForwardKernel::kPlain;
  plan.grid = std::min<int64_t>(plan.tiles, resident(plan.kernel, 0));
  return plan;
}

template <typename T, typename W, typename O>
void launch_forward(ForwardParams<T, W, O> p) {
  const ForwardPlan plan = plan_forward(p);
  p.group_threads = plan.group_threads;
  p.tiles = plan.tiles;
  p.inv_hidden = 1.0f / static_cast<float>(p.hidden);
  forward_kernel<T, W, O>(plan.kernel)<<<static_cast<unsigned>(plan.grid), plan.block, plan.smem,
                                         at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    const char* op, const at::Tensor& input, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, c10::SymIntArrayRef sym_shape,
    double eps, bool rms, std::optional<c10::ScalarType> output_dtype) {
  const c10::IntArrayRef shape = C10_AS_INTARRAYREF_SLOW(sym_shape);
  const auto input_dtype = input.scalar_type();
  checks::float_dtype(op, "input has dtype", input_dtype);
  const int64_t hidden = checks::normalized(op, "input", input, shape);
  checks::dense(op, "input", input, input.device());
  const at::Tensor* res = optional_tensor(residual);
  if (res != nullptr) {
    TORCH_CHECK_TYPE(res->scalar_type() == input_dtype, op, ": residual has dtype ",
                     checks::torch_dtype(res->scalar_type()), " but input has ", checks::torch_dtype(input_dtype));
    TORCH_CHECK_VALUE(res->sizes().equals(input.sizes()), op, ": residual has shape ",
                      apex::checks::shape_string(res->sizes()), " but input has ",
                      apex::checks::shape_string(input.sizes()));
    checks::dense(op, "residual", *res, input.device());
  }
  checks::affine(op, input_dtype, input.device(), weight, bias, shape, rms);
  const at::Tensor* w = optional_tensor(weight);
  const auto weight_dtype = w != nullptr ? w->scalar_type() : input_dtype;
  const auto out_dtype = output_dtype.value_or(input_dtype);
  if (out_dtype != input_dtype && out_dtype != weight_dtype) {
    std::string weight_part = w != nullptr ? " (" + checks::torch_dtype(weight_dtype) + ")" : "";
    TORCH_CHECK_TYPE(false, op, ": output_dtype ", checks::torch_dtype(out_dtype),
                     " is neither the input's dtype (", checks::torch_dtype(input_dtype), ") nor the weight's",
                     weight_part);
  }

  if (input_dtype == at::kDouble) return forward_float64(input, res, w, optional_tensor(bias), shape, eps, rms, out_dtype);

  const c10::cuda::CUDAGuard device_guard(input.device());
  const auto lead = input.sizes().slice(0, input.dim() - static_cast<int64_t>(shape.size()));
  const auto f32 = input.options().dtype(at::kFloat);
  at::Tensor output = at::empty(input.sizes(), input.options().dtype(out_dtype));
  at::Tensor mean = rms ? at::empty({0}, f32) : at::empty(lead, f32);
  at::Tensor rstd = at::empty(lead, f32);
  at::Tensor residual_out = res != nullptr ? at::empty_like(input) : at::Tensor();
  const int64_t rows = input.numel() / hidden;
  if (rows == 0) return {output, residual_out, mean, rstd};

  dispatch_norm_types(op, input_dtype, weight_dtype, out_dtype, input_dtype, [&](auto t, auto wt, auto o, auto) {
    using T = typename decltype(t)::type;
    using W = typename decltype(wt)::type;
    using O = typename decltype(o)::type;
    ForwardParams<T, W, O> p{};
    p.input = static_cast<const T*>(input.const_data_ptr());
    p.residual = res != nullptr ? static_cast<const T*>(res->const_data_ptr()) : nullptr;
    p.weight = optional_ptr<W>(weight);
    p.bias = optional_ptr<W>(bias);
    p.output = static_cast<O*>(output.data_ptr());
    p.residual_out = res != nullptr ? static_cast<T*>(residual_out.data_ptr()) : nullptr;
    p.mean = rms ? nullptr : mean.data_ptr<float>();
    p.rstd = rstd.data_ptr<float>();
    p.rows = rows;
    p.hidden = hidden;
    p.eps = static_cast<float>(eps);
    p.rms = rms;
    launch_forward(p);
  });
  return {output, residual_out, mean, rstd};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_forward_cuda(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    c10::SymIntArrayRef normalized_shape, double eps, bool rms, bool /*memory_efficient: autograd's*/,
    std::optional<c10::ScalarType> output_dtype) {
  auto outputs = forward("norm_forward", input, std::nullopt, weight, bias, normalized_shape, eps, rms, output_dtype);
  return {std::get<0>(outputs), std::get<2>(outputs), std::get<3>(outputs)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_norm_forward_cuda(
    const at::Tensor& input, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, c10::SymIntArrayRef normalized_shape, double eps, bool rms,
    bool /*memory_efficient: autograd's*/, std::optional<c10::ScalarType> output_dtype) {
  return forward("add_norm_forward", input, residual, weight, bias, normalized_shape, eps, rms, output_dtype);
}

}  // namespace apex_normalization

