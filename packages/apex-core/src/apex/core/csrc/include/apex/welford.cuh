// Welford's running mean and sum of squared deviations (M2), and Chan et al.'s merge of two
// such states, for numerically stable mean/variance reductions (layer norm, batch norm).
//
//   apex::Welford<float> w{};                 // {} zeroes it
//   for (...) w.update(x);
//   w = apex::block_welford(w, shared);       // shared: apex::Welford<float>[32]
//   float var = w.variance(/*unbiased=*/false);
//
// The count is kept in T, like the mean: exact up to 2^24 for float, and beyond that only the
// merge weights round (relative error ~1e-7), which is harmless for statistics.
#pragma once

#include <c10/macros/Macros.h>

#include "reductions.cuh"

namespace apex {

// A plain aggregate (no default member initializers) so that arrays of it can live in
// __shared__ memory; value-initialize it ({}) for the empty state.
template <typename T>
struct Welford {
  T mean;
  T m2;
  T count;

  C10_HOST_DEVICE C10_ALWAYS_INLINE void update(T x) {
    count += T(1);
    const T delta = x - mean;
    mean += delta / count;
    m2 += delta * (x - mean);
  }

  // Population (biased) or sample (unbiased) variance; 0 for an empty state, NaN for an
  // unbiased variance of one value, as in torch.var.
  C10_HOST_DEVICE C10_ALWAYS_INLINE T variance(bool unbiased) const {
    const T n = unbiased ? count - T(1) : count;
    return count > T(0) ? m2 / n : T(0);
  }
};

// The state of the union of the two samples (Chan, Golub & LeVeque).
template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE Welford<T> welford_merge(const Welford<T>& a, const Welford<T>& b) {
  const T count = a.count + b.count;
  if (count == T(0)) return a;
  const T delta = b.mean - a.mean;
  const T b_weight = b.count / count;
  Welford<T> merged{};
  merged.mean = a.mean + delta * b_weight;
  merged.m2 = a.m2 + b.m2 + delta * delta * a.count * b_weight;
  merged.count = count;
  return merged;
}

// Merge over the 32 lanes of a full warp; every lane gets lane 0's result. (A butterfly would
// leave slightly different bits in different lanes: the merge is not symmetric in rounding.)
template <typename T>
C10_DEVICE C10_ALWAYS_INLINE Welford<T> warp_welford(Welford<T> w) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    Welford<T> other{};
    other.mean = __shfl_down_sync(0xffffffffu, w.mean, offset);
    other.m2 = __shfl_down_sync(0xffffffffu, w.m2, offset);
    other.count = __shfl_down_sync(0xffffffffu, w.count, offset);
    w = welford_merge(w, other);
  }
  w.mean = __shfl_sync(0xffffffffu, w.mean, 0);
  w.m2 = __shfl_sync(0xffffffffu, w.m2, 0);
  w.count = __shfl_sync(0xffffffffu, w.count, 0);
  return w;
}

// Merge over the whole block; every thread gets the result. blockDim.x must be a multiple of
// 32; `shared` holds at least 32 states. Starts with a barrier, so calls may share one buffer.
template <typename T>
C10_DEVICE C10_ALWAYS_INLINE Welford<T> block_welford(Welford<T> w, Welford<T>* shared) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  __syncthreads();
  w = warp_welford(w);
  if (lane == 0) shared[warp] = w;
  __syncthreads();
  return warp_welford(lane < warps ? shared[lane] : Welford<T>{});
}

}  // namespace apex
