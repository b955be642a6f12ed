// Asynchronous copies from global into shared memory (cp.async, sm_80 and later), 16 bytes each:
// a kernel fetches the next tile's data while it works on the current one, so that loads stay in
// flight through its reductions. A thread that copies exactly the vectors it will read back
// itself needs no barrier: waiting for its own copies is enough.
//
//   stage<V>(buffer + i, src);       // issue the copies of one vector V
//   copy_async_commit();             // close this thread's group of copies
//   ...
//   copy_async_wait<0>();            // every group committed so far has landed
//   unstage(v, buffer + i);
#pragma once

#include <c10/macros/Macros.h>

namespace apex {

C10_DEVICE C10_ALWAYS_INLINE void copy_async16(void* smem, const void* gmem) {
  const auto address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(gmem) : "memory");
}

C10_DEVICE C10_ALWAYS_INLINE void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `kPending` of this thread's committed copy groups are still in flight.
template <int kPending>
C10_DEVICE C10_ALWAYS_INLINE void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Copies a vector V (whole 16-byte pieces) from gmem into shared memory at smem.
template <typename V>
C10_DEVICE C10_ALWAYS_INLINE void stage(uint4* smem, const void* gmem) {
  static_assert(sizeof(V) % 16 == 0, "whole 16-byte pieces");
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(V) / 16); ++i) {
    copy_async16(smem + i, reinterpret_cast<const uint4*>(gmem) + i);
  }
}

// Reads back a vector V that stage put at smem (once its copies have landed).
template <typename V>
C10_DEVICE C10_ALWAYS_INLINE void unstage(V& dst, const uint4* smem) {
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(V) / 16); ++i) reinterpret_cast<uint4*>(&dst)[i] = smem[i];
}

}  // namespace apex
