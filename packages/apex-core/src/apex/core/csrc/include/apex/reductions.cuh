// Warp and block reductions (sum, max, or any associative op) through register shuffles.
//
// The combination order is fixed by the lane and warp layout, so a reduction gives the same
// bits on every run for the same inputs (no atomics). Block reductions need blockDim.x to be
// a multiple of 32 (at most 1024) and a caller-provided shared buffer of 32 values.
#pragma once

#include <c10/macros/Macros.h>

#include <limits>

namespace apex {

constexpr int kWarpSize = 32;

struct SumOp {
  template <typename T>
  C10_DEVICE C10_ALWAYS_INLINE T operator()(T a, T b) const { return a + b; }
  template <typename T>
  static constexpr T identity() { return T(0); }
};

// Propagates NaN, like torch.max (fmaxf would drop it).
struct MaxOp {
  template <typename T>
  C10_DEVICE C10_ALWAYS_INLINE T operator()(T a, T b) const { return (a != a || a > b) ? a : b; }
  template <typename T>
  static constexpr T identity() {
    return std::numeric_limits<T>::has_infinity ? -std::numeric_limits<T>::infinity()
                                                : std::numeric_limits<T>::lowest();
  }
};

// Butterfly reduction over the 32 lanes of a full warp; every lane gets the result (the same
// bits in every lane, since each step adds the same two values in either order).
template <typename T, typename Op>
C10_DEVICE C10_ALWAYS_INLINE T warp_reduce(T value, Op op) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

template <typename T>
C10_DEVICE C10_ALWAYS_INLINE T warp_sum(T value) { return warp_reduce(value, SumOp{}); }

template <typename T>
C10_DEVICE C10_ALWAYS_INLINE T warp_max(T value) { return warp_reduce(value, MaxOp{}); }

// Reduction over the whole block; every thread gets the result. `shared` holds at least 32
// values. The call starts with a barrier, so back-to-back calls may share one buffer.
template <typename T, typename Op>
C10_DEVICE C10_ALWAYS_INLINE T block_reduce(T value, Op op, T* shared) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  __syncthreads();
  value = warp_reduce(value, op);
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  // Every warp reduces the per-warp results itself, which saves a broadcast round trip.
  value = lane < warps ? shared[lane] : Op::template identity<T>();
  return warp_reduce(value, op);
}

template <typename T>
C10_DEVICE C10_ALWAYS_INLINE T block_sum(T value, T* shared) { return block_reduce(value, SumOp{}, shared); }

template <typename T>
C10_DEVICE C10_ALWAYS_INLINE T block_max(T value, T* shared) { return block_reduce(value, MaxOp{}, shared); }

}  // namespace apex
