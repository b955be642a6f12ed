// 16-byte vectorized element-wise access to arrays in global memory (tensor data) for
// memory-bound kernels, with a scalar path for whatever cannot be vectorized (an unaligned
// start, a ragged end, pointers misaligned differently from one another).
//
// The usual shape of an element-wise block (e.g. one multi_tensor_apply chunk):
//
//   constexpr int kWidth = apex::vector_width<In, Out>();   // 16-byte accesses of the narrowest type
//   apex::for_each_element<kWidth, 4>(n, [&](auto group) {
//     using G = decltype(group);
//     float x[G::kCount][G::kWidth];
//     group.load(x, in);                       // every load in flight before the first use
//     for (...) x[i][j] = f(x[i][j]);
//     group.store(out, x);
//   }, in, out);
//
// The body is a generic lambda instantiated for vector and scalar groups alike, so the math is
// written once. Loads convert to float and stores convert from float (fp32 math for every
// storage type).
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstddef>
#include <cstdint>

namespace apex {

template <typename T, int N>
struct alignas(sizeof(T) * N) AlignedVector {
  T val[N];
};

// Elements per access so that the narrowest of the types moves 16 bytes (wider types then
// move 32 or 64 bytes, still as 16-byte instructions).
template <typename... Ts>
constexpr int vector_width() {
  size_t narrowest = 16;
  ((narrowest = sizeof(Ts) < narrowest ? sizeof(Ts) : narrowest), ...);
  return static_cast<int>(16 / narrowest);
}

// The element offset of p past the previous Width-element (vector) boundary, or -1 when p is
// not even aligned to its own element size.
template <int Width, typename T>
C10_DEVICE C10_ALWAYS_INLINE int misalignment(const T* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  if (address % sizeof(T) != 0) return -1;
  return static_cast<int>((address / sizeof(T)) % Width);
}

// Stores v to global memory with 16-byte instructions. A plain struct assignment is not enough:
// nvcc 13.0 split it into 2-, 4- and 8-byte stores inside the loops below, which halved the
// bandwidth of an fp16 scale kernel on an H200.
template <typename T, int N>
C10_DEVICE C10_ALWAYS_INLINE void store_vector(T* dst, const AlignedVector<T, N>& v) {
  static_assert(sizeof(v) % 16 == 0, "store_vector writes whole 16-byte pieces");
#pragma unroll
  for (int p = 0; p < static_cast<int>(sizeof(v) / 16); ++p) {
    const uint4 bits = reinterpret_cast<const uint4*>(&v)[p];
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(reinterpret_cast<uint4*>(dst) + p), "r"(bits.x),
                 "r"(bits.y), "r"(bits.z), "r"(bits.w)
                 : "memory");
  }
}

// Count accesses of Width consecutive elements each, at element offsets first + i * stride.
// Width == 1 is a scalar access, with no alignment requirement.
template <int Width, int Count>
struct ElementGroups {
  static constexpr int kWidth = Width;
  static constexpr int kCount = Count;
  int64_t first;
  int64_t stride;

  C10_DEVICE C10_ALWAYS_INLINE int64_t offset(int i) const { return first + i * stride; }

  template <typename T>
  C10_DEVICE C10_ALWAYS_INLINE void load(float (&dst)[Count][Width], const T* src) const {
    if constexpr (Width == 1) {
#pragma unroll
      for (int i = 0; i < Count; ++i) dst[i][0] = static_cast<float>(src[offset(i)]);
    } else {
      AlignedVector<T, Width> v[Count];
#pragma unroll
      for (int i = 0; i < Count; ++i) v[i] = *reinterpret_cast<const AlignedVector<T, Width>*>(src + offset(i));
#pragma unroll
      for (int i = 0; i < Count; ++i) {
#pragma unroll
        for (int j = 0; j < Width; ++j) dst[i][j] = static_cast<float>(v[i].val[j]);
      }
    }
  }

  template <typename T>
  C10_DEVICE C10_ALWAYS_INLINE void store(T* dst, const float (&src)[Count][Width]) const {
#pragma unroll
    for (int i = 0; i < Count; ++i) {
      if constexpr (Width == 1) {
        dst[offset(i)] = static_cast<T>(src[i][0]);
      } else {
        AlignedVector<T, Width> v;
#pragma unroll
        for (int j = 0; j < Width; ++j) v.val[j] = static_cast<T>(src[i][j]);
        store_vector(dst + offset(i), v);
      }
    }
  }
};

namespace detail {

// Groups 0..count-1 of Width elements starting at element `base`, spread over the block's
// threads so that each access instruction of a warp is coalesced; Count groups per thread per
// step while whole steps remain, then one at a time.
template <int Width, int Count, typename Body>
C10_DEVICE C10_ALWAYS_INLINE void for_each_group(int64_t base, int64_t count, Body& body) {
  const int64_t threads = blockDim.x;
  const int64_t step = threads * Count;
  const int64_t whole_steps_end = count / step * step;
  for (int64_t g = threadIdx.x; g < whole_steps_end; g += step) {
    body(ElementGroups<Width, Count>{base + g * Width, threads * Width});
  }
  for (int64_t g = whole_steps_end + threadIdx.x; g < count; g += threads) {
    body(ElementGroups<Width, 1>{base + g * Width, 0});
  }
}

template <typename Body>
C10_DEVICE C10_ALWAYS_INLINE void for_each_scalar(int64_t begin, int64_t end, Body& body) {
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    body(ElementGroups<1, 1>{i, 0});
  }
}

}  // namespace detail

// Visits elements [0, n) of the arrays `ptrs` with the calling block's threads, calling
// body(ElementGroups<W, C>) for groups that together cover every element exactly once.
//
// When all pointers share one misalignment (in elements) relative to Width-element vectors,
// which includes the common case of all being aligned, the elements from the first vector
// boundary on go through aligned Width-wide accesses, Count per thread per step; the few
// before it and after the last whole vector go one by one. Otherwise every element goes
// through scalar accesses, still Count per thread per step.
//
// Every thread of the block must call this (bodies may not synchronize: groups per thread
// differ).
template <int Width, int Count, typename Body, typename... Ts>
C10_DEVICE void for_each_element(int64_t n, Body&& body, const Ts*... ptrs) {
  static_assert(sizeof...(Ts) > 0, "for_each_element needs at least one array");
  const int misalignments[] = {misalignment<Width>(ptrs)...};
  bool common = misalignments[0] >= 0;
#pragma unroll
  for (int i = 1; i < static_cast<int>(sizeof...(Ts)); ++i) common = common && misalignments[i] == misalignments[0];
  if (!common) {
    detail::for_each_group<1, Count>(0, n, body);
    return;
  }
  const int64_t to_boundary = (Width - misalignments[0]) % Width;
  const int64_t head = to_boundary < n ? to_boundary : n;
  const int64_t vectors = (n - head) / Width;
  const int64_t tail = head + vectors * Width;
  detail::for_each_scalar(0, head, body);
  detail::for_each_group<Width, Count>(head, vectors, body);
  detail::for_each_scalar(tail, n, body);
}

}  // namespace apex
