// 16-byte vectorized element-wise access to arrays in global memory (tensor data) for
// memory-bound kernels, with a scalar path for whatever cannot be vectorized (an unaligned
// start, a ragged end, pointers misaligned differently from one another).
//
// The usual shape of an element-wise block (e.g. one multi_tensor_apply chunk):
//
//   constexpr int kWidth = apex::vector_width<In, Out>();   // 16-byte accesses of the narrowest type
//   apex::for_each_element<kWidth, 4>(n, [&](auto group) {
//     typename decltype(group)::Values x;
//     group.load(x, in);                       // every load in flight before the first use
//     group.for_each_value([&](int i, int j) { x[i][j] = f(x[i][j]); });
//     group.store(out, x);
//   }, in, out);
//
// The body is a generic lambda instantiated for vector and scalar groups alike, so the math is
// written once. Loads convert to float and stores convert from float (fp32 math for every
// storage type).
//
// Kernels that place their own vectors (a row held in registers, a tile of channels) use
// load_floats / store_floats on one vector at a time, and aligned16 on the host to decide
// whether a launch may use them.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

// Elements per thread per array loaded before the first use, for element-wise kernels that stream
// several arrays (the fused optimizers): 16-byte accesses of every array in flight together (16
// independent 16-byte loads per thread for fp32 Adam). Measured on an H200 (apex-optimizers'
// fused_adam, 354M fp32 parameters, chunk_size 65536): 16 elements reach 95% of the device copy
// bandwidth with one 512-thread block per multiprocessor (100-128 registers, no spills); 8
// elements (two blocks per multiprocessor) were 1% slower in fp32 and 6% slower for bf16 params
// with fp32 masters, 4 elements slower still.
constexpr int kElementsInFlight = 16;

// Accesses of Width elements per array in flight: kElementsInFlight's worth, at least one.
template <int Width>
constexpr int accesses_in_flight() {
  return kElementsInFlight / Width > 0 ? kElementsInFlight / Width : 1;
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
// bandwidth of an fp16 scale kernel on an H200. kStreaming adds the streaming cache hint
// (st.global.cs: evict first), for a write stream larger than the L2 cache whose lines nobody reads
// back from L2, so that they do not push out lines that are read again (on the H200 a 537 MB fp16
// stream that also reads two small cached tensors ran at 3.5 TB/s with plain stores and 4.0 TB/s
// with these).
template <typename T, int N, bool kStreaming = false>
C10_DEVICE C10_ALWAYS_INLINE void store_vector(T* dst, const AlignedVector<T, N>& v) {
  static_assert(sizeof(v) % 16 == 0, "store_vector writes whole 16-byte pieces");
#pragma unroll
  for (int p = 0; p < static_cast<int>(sizeof(v) / 16); ++p) {
    const uint4 bits = reinterpret_cast<const uint4*>(&v)[p];
    uint4* const at = reinterpret_cast<uint4*>(dst) + p;
    if constexpr (kStreaming) {
      asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(at), "r"(bits.x), "r"(bits.y), "r"(bits.z),
                   "r"(bits.w)
                   : "memory");
    } else {
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(at), "r"(bits.x), "r"(bits.y), "r"(bits.z),
                   "r"(bits.w)
                   : "memory");
    }
  }
}

// Whether p is a multiple of `bytes`; null is (an absent tensor does not stop a vectorized launch).
C10_HOST_DEVICE inline bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Whether p may be accessed with 16-byte instructions.
C10_HOST_DEVICE inline bool aligned16(const void* p) { return aligned_to(p, 16); }

// One vector of N elements from p (aligned to the vector's size).
template <typename T, int N>
C10_DEVICE C10_ALWAYS_INLINE AlignedVector<T, N> load_vector(const T* p) {
  return *reinterpret_cast<const AlignedVector<T, N>*>(p);
}

// As load_vector, but whole 16-byte pieces read as uint4, a native vector type (one 16-byte load
// each): in the softmax backward's streaming loop nvcc 13.0 compiled the plain AlignedVector copy
// of a 16-byte vector into four 4-byte loads (LDG.E). A narrower vector is one load of its size.
template <typename T, int N>
C10_DEVICE C10_ALWAYS_INLINE AlignedVector<T, N> load_vector_whole(const T* p) {
  if constexpr (sizeof(AlignedVector<T, N>) % 16 == 0) {
    AlignedVector<T, N> v;
#pragma unroll
    for (int piece = 0; piece < static_cast<int>(sizeof(v) / 16); ++piece) {
      const uint4 bits = reinterpret_cast<const uint4*>(p)[piece];
      memcpy(reinterpret_cast<uint4*>(&v) + piece, &bits, sizeof(bits));
    }
    return v;
  } else {
    return load_vector<T, N>(p);
  }
}

// As store_vector, but ordinary stores of uint4, a native vector type (one 16-byte store each)
// rather than an asm statement with a memory clobber: loads of other (restrict-qualified) arrays
// may then move above it.
template <typename T, int N>
C10_DEVICE C10_ALWAYS_INLINE void store_vector_plain(T* dst, const AlignedVector<T, N>& v) {
  static_assert(sizeof(v) % 16 == 0, "store_vector_plain writes whole 16-byte pieces");
#pragma unroll
  for (int p = 0; p < static_cast<int>(sizeof(v) / 16); ++p) {
    reinterpret_cast<uint4*>(dst)[p] = reinterpret_cast<const uint4*>(&v)[p];
  }
}

// The elements of v as floats. bfloat16 pairs: the low element is the 32-bit word shifted up, the
// high one the word with its low half cleared, one instruction each (the generic conversion
// spends two on the high element); the values are the same.
template <int N, typename T>
C10_DEVICE C10_ALWAYS_INLINE void to_floats(float (&dst)[N], const AlignedVector<T, N>& v) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && N % 2 == 0) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(&v);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      dst[2 * i] = __uint_as_float(words[i] << 16);
      dst[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) dst[j] = static_cast<float>(v.val[j]);
  }
}

// N elements from p (aligned to N elements) as floats, in one access.
template <int N, typename T>
C10_DEVICE C10_ALWAYS_INLINE void load_floats(float (&dst)[N], const T* p) {
  to_floats(dst, load_vector<T, N>(p));
}

// N floats to p (aligned to N elements) as T, in one access: whole 16-byte pieces through
// store_vector_plain, a narrower vector as one store of its size.
template <int N, typename T>
C10_DEVICE C10_ALWAYS_INLINE void store_floats(T* p, const float (&src)[N]) {
  AlignedVector<T, N> v;
#pragma unroll
  for (int j = 0; j < N; ++j) v.val[j] = static_cast<T>(src[j]);
  if constexpr (sizeof(v) % 16 == 0) {
    store_vector_plain(p, v);
  } else {
    *reinterpret_cast<AlignedVector<T, N>*>(p) = v;
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

  // The registers of one array's elements: load fills, store writes back.
  using Values = float[Count][Width];

  C10_DEVICE C10_ALWAYS_INLINE int64_t offset(int i) const { return first + i * stride; }

  // The element-wise step between a body's loads and stores: f(i, j) for every element, fully
  // unrolled so that the register arrays stay in registers.
  template <typename F>
  C10_DEVICE C10_ALWAYS_INLINE void for_each_value(F&& f) const {
#pragma unroll
    for (int i = 0; i < Count; ++i) {
#pragma unroll
      for (int j = 0; j < Width; ++j) f(i, j);
    }
  }

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
