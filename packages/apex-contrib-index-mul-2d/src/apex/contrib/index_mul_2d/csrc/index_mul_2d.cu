// index_mul_2d and its two backwards: out[i] = in1[idx1[i]] * in2[i] on rows of F features.
// The math, the references and the wording of the checks are in apex.contrib.index_mul_2d's _ops.py.
//
// Layout of the work: a row of F features is split into vectors of W elements (16 bytes when
// every pointer is 16-byte aligned and W divides F, else W = 1); `lanes` threads (a power of
// two) share a row, so a block of kThreads threads covers kThreads / lanes rows at a time, and
// each thread takes kRows such rows, whose loads are all issued before the first use (the
// gather from in1 waits on idx1, so several rows in flight hide that second round trip).
//
// The gradient of in1 is a sum over the rows of in2 that share an index: atomics (red.global)
// into a zeroed float32 (float64 for float64) buffer, 16 bytes at a time on sm_90, which is
// grad_in1 itself for float32 and float64 and a float32 buffer rounded once to float16 or
// bfloat16 at the end (float16 atomics would round after every addition). Atomics make the
// order of additions, and so the last bits of grad_in1, vary between runs: the backward calls
// alertNotDeterministic, as PyTorch's index_add does on CUDA.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <type_traits>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/launch.cuh>
#include <apex/vectorized.cuh>

#include "cuda_ops.h"

namespace {

constexpr int kThreads = 256;
// Rows per thread, their loads in flight together; fewer for the backward's backward, whose five
// operands per row would otherwise spill registers.
constexpr int kRows = 4;
constexpr int kRowsBackwardBackward = 2;
// The forward holds 8 16-byte vectors per thread in flight: 64 registers let four blocks (1024
// threads) share an SM.
constexpr int kForwardBlocksPerSM = 4;

// float32 math for the 16-bit types, float64 for float64.
template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

struct Geometry {
  int64_t rows;      // N2
  int64_t features;  // F
  int64_t in1_rows;  // N1
  int64_t vectors;   // per row: F / W
  int lanes;         // threads per row, a power of two
  int lanes_log2;
};

// Operands walked row by row (in2, the gradients of the output) are read once and the outputs
// written once: they go through L2 as evict-first (ld.global.cs / st.global.cs), so that they do
// not push out the rows of in1 (each gathered about N2 / N1 times) or the sums of grad_in1.
enum class Reuse { kStreamed, kGathered };

// Operands stay in registers as loaded, 16 bytes as a uint4 (or one element where W is 1), until
// their one use: with every row's loads in flight at once, holding them as floats doubled a 16-bit
// kernel's registers (ptxas sm_90: float16 forward 96 against float32's 59) and halved its
// occupancy. The conversions work on the raw 32-bit words (c10's element types in an array kept
// bfloat16's kernels at 95-140 registers, spilling under a 64-register bound).
template <typename T, int W>
using Raw = std::conditional_t<W == 1, T, uint4>;

template <int W, Reuse kReuse, typename T>
C10_DEVICE C10_ALWAYS_INLINE Raw<T, W> load(const T* p) {
  if constexpr (W == 1) {
    return *p;
  } else {
    static_assert(W * sizeof(T) == sizeof(uint4), "a vector is one 16-byte access");
    if constexpr (kReuse == Reuse::kStreamed) {
      return __ldcs(reinterpret_cast<const uint4*>(p));
    } else {
      return *reinterpret_cast<const uint4*>(p);
    }
  }
}

C10_DEVICE C10_ALWAYS_INLINE uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// A vector's elements in the accumulation type (element 2i is word i's low half).
template <int W, typename T>
C10_DEVICE C10_ALWAYS_INLINE void widen(Acc<T> (&dst)[W], const Raw<T, W>& v) {
  if constexpr (W == 1) {
    dst[0] = static_cast<Acc<T>>(v);
  } else if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[i] = __uint_as_float(word(v, i));
  } else if constexpr (std::is_same_v<T, double>) {
    dst[0] = __hiloint2double(static_cast<int>(v.y), static_cast<int>(v.x));
    dst[1] = __hiloint2double(static_cast<int>(v.w), static_cast<int>(v.z));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      dst[2 * i] = __uint_as_float(word(v, i) << 16);
      dst[2 * i + 1] = __uint_as_float(word(v, i) & 0xffff0000u);
    }
  } else {
    static_assert(std::is_same_v<T, c10::Half>);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t w = word(v, i);
      __half2 h;
      __builtin_memcpy(&h, &w, sizeof(w));
      const float2 f = __half22float2(h);
      dst[2 * i] = f.x;
      dst[2 * i + 1] = f.y;
    }
  }
}

// Two floats rounded to nearest even into one word of two 16-bit elements (x the low half).
template <typename T>
C10_DEVICE C10_ALWAYS_INLINE uint32_t narrow2(float x, float y) {
  uint32_t w;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    __builtin_memcpy(&w, &h, sizeof(w));
  } else {
    const __half2 h = __floats2half2_rn(x, y);
    __builtin_memcpy(&w, &h, sizeof(w));
  }
  return w;
}

template <int W, typename T>
C10_DEVICE C10_ALWAYS_INLINE void store_streamed(T* p, const Acc<T> (&src)[W]) {
  if constexpr (W == 1) {
    *p = static_cast<T>(src[0]);
  } else {
    uint4 v;
    if constexpr (std::is_same_v<T, float>) {
      v = make_uint4(__float_as_uint(src[0]), __float_as_uint(src[1]), __float_as_uint(src[2]), __float_as_uint(src[3]));
    } else if constexpr (std::is_same_v<T, double>) {
      v = make_uint4(__double2loint(src[0]), __double2hiint(src[0]), __double2loint(src[1]), __double2hiint(src[1]));
    } else {
      v = make_uint4(narrow2<T>(src[0], src[1]), narrow2<T>(src[2], src[3]), narrow2<T>(src[4], src[5]),
                     narrow2<T>(src[6], src[7]));
    }
    __stcs(reinterpret_cast<uint4*>(p), v);
  }
}

// dst[0..W) += src, as reductions (no value returned, so the compiler emits red.global).
template <int W, typename A>
C10_DEVICE C10_ALWAYS_INLINE void atomic_add(A* dst, const A (&src)[W]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (std::is_same_v<A, float> && W % 4 == 0) {
#pragma unroll
    for (int j = 0; j < W; j += 4) {
      atomicAdd(reinterpret_cast<float4*>(dst + j), make_float4(src[j], src[j + 1], src[j + 2], src[j + 3]));
    }
    return;
  }
#endif
#pragma unroll
  for (int j = 0; j < W; ++j) atomicAdd(dst + j, src[j]);
}

// The rows this thread takes (R of them, -1 past the end) and their in1 rows, asserted to be in
// range on the device (a host-side check would wait for the device).
template <int R>
struct ThreadRows {
  int64_t row[R];
  int64_t src[R];
  int lane;
};

template <int R>
C10_DEVICE C10_ALWAYS_INLINE ThreadRows<R> thread_rows(const int64_t* __restrict__ idx1, const Geometry& g) {
  ThreadRows<R> t;
  t.lane = threadIdx.x & (g.lanes - 1);
  const int64_t slots = kThreads >> g.lanes_log2;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * slots * R + (threadIdx.x >> g.lanes_log2);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t row = first + r * slots;
    t.row[r] = row < g.rows ? row : -1;
    t.src[r] = row < g.rows ? idx1[row] : -1;
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (t.row[r] >= 0) {
      CUDA_KERNEL_ASSERT_MSG(t.src[r] >= 0 && t.src[r] < g.in1_rows,
                             "index_mul_2d: idx1 has a value out of range [0, in1.size(0))");
    }
  }
  return t;
}

template <typename T, int W>
__global__ void __launch_bounds__(kThreads, kForwardBlocksPerSM)
    forward_kernel(T* __restrict__ out, const T* __restrict__ in1, const T* __restrict__ in2,
                   const int64_t* __restrict__ idx1, Geometry g) {
  using A = Acc<T>;
  const auto t = thread_rows<kRows>(idx1, g);
  for (int64_t v = t.lane; v < g.vectors; v += g.lanes) {
    const int64_t col = v * W;
    Raw<T, W> a[kRows], b[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (t.row[r] < 0) continue;
      b[r] = load<W, Reuse::kStreamed>(in2 + t.row[r] * g.features + col);
      a[r] = load<W, Reuse::kGathered>(in1 + t.src[r] * g.features + col);
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (t.row[r] < 0) continue;
      A y[W], z[W];
      widen<W, T>(y, a[r]);
      widen<W, T>(z, b[r]);
#pragma unroll
      for (int j = 0; j < W; ++j) y[j] *= z[j];
      store_streamed<W>(out + t.row[r] * g.features + col, y);
    }
  }
}

template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(Acc<T>* __restrict__ grad_in1, T* __restrict__ grad_in2, const T* __restrict__ grad_out,
                    const T* __restrict__ in1, const T* __restrict__ in2, const int64_t* __restrict__ idx1,
                    Geometry g) {
  using A = Acc<T>;
  const auto t = thread_rows<kRows>(idx1, g);
  for (int64_t v = t.lane; v < g.vectors; v += g.lanes) {
    const int64_t col = v * W;
    Raw<T, W> go[kRows], a[kRows], b[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (t.row[r] < 0) continue;
      const int64_t at = t.row[r] * g.features + col;
      go[r] = load<W, Reuse::kStreamed>(grad_out + at);
      b[r] = load<W, Reuse::kStreamed>(in2 + at);
      a[r] = load<W, Reuse::kGathered>(in1 + t.src[r] * g.features + col);
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (t.row[r] < 0) continue;
      A grad[W], d2[W], d1[W];
      widen<W, T>(grad, go[r]);
      widen<W, T>(d2, a[r]);
      widen<W, T>(d1, b[r]);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        d2[j] *= grad[j];
        d1[j] *= grad[j];
      }
      store_streamed<W>(grad_in2 + t.row[r] * g.features + col, d2);
      atomic_add<W>(grad_in1 + t.src[r] * g.features + col, d1);
    }
  }
}

template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    backward_backward_kernel(T* __restrict__ grad_grad_out, Acc<T>* __restrict__ grad_in1, T* __restrict__ grad_in2,
                             const T* __restrict__ grad_grad_in1, const T* __restrict__ grad_grad_in2,
                             const T* __restrict__ grad_out, const T* __restrict__ in1, const T* __restrict__ in2,
                             const int64_t* __restrict__ idx1, Geometry g) {
  using A = Acc<T>;
  constexpr int R = kRowsBackwardBackward;
  const auto t = thread_rows<R>(idx1, g);
  for (int64_t v = t.lane; v < g.vectors; v += g.lanes) {
    const int64_t col = v * W;
    Raw<T, W> gg1[R], gg2[R], go[R], a[R], b[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (t.row[r] < 0) continue;
      const int64_t at = t.row[r] * g.features + col;
      const int64_t from = t.src[r] * g.features + col;
      gg2[r] = load<W, Reuse::kStreamed>(grad_grad_in2 + at);
      go[r] = load<W, Reuse::kStreamed>(grad_out + at);
      b[r] = load<W, Reuse::kStreamed>(in2 + at);
      gg1[r] = load<W, Reuse::kGathered>(grad_grad_in1 + from);
      a[r] = load<W, Reuse::kGathered>(in1 + from);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (t.row[r] < 0) continue;
      const int64_t at = t.row[r] * g.features + col;
      A x1[W], x2[W], grad[W], ggo[W], d2[W], d1[W];
      widen<W, T>(x1, gg1[r]);
      widen<W, T>(x2, gg2[r]);
      widen<W, T>(grad, go[r]);
      widen<W, T>(ggo, b[r]);
      widen<W, T>(d1, a[r]);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        ggo[j] = x1[j] * ggo[j] + x2[j] * d1[j];  // grad_grad_out
        d2[j] = x1[j] * grad[j];                  // grad_in2
        d1[j] = x2[j] * grad[j];                  // into grad_in1
      }
      store_streamed<W>(grad_grad_out + at, ggo);
      store_streamed<W>(grad_in2 + at, d2);
      atomic_add<W>(grad_in1 + t.src[r] * g.features + col, d1);
    }
  }
}

// checks, worded as _ops.py's ------------------------------------------------------------------

bool supported_dtype(c10::ScalarType dtype) {
  return apex::checks::contains(apex::checks::kFloatDtypes, dtype) || dtype == c10::ScalarType::Double;
}

void check_rows(const char* op, const char* name, const at::Tensor& t, c10::Device device,
                const at::Tensor* dtype_of) {
  namespace checks = apex::checks;
  if (dtype_of == nullptr) {
    TORCH_CHECK_TYPE(supported_dtype(t.scalar_type()), op, ": ", name, " has dtype ", checks::torch_dtype(t.scalar_type()),
                     "; expected one of float32, float16, bfloat16, float64");
  } else {
    TORCH_CHECK_TYPE(t.scalar_type() == dtype_of->scalar_type(), op, ": ", name, " has dtype ",
                     checks::torch_dtype(t.scalar_type()), " but in1 has dtype ",
                     checks::torch_dtype(dtype_of->scalar_type()));
  }
  TORCH_CHECK_VALUE(t.dim() == 2, op, ": ", name, " must be 2-D, got shape ", checks::shape_string(t.sizes()));
  checks::dense(op, name, t, device);
}

void check_operands(const char* op, const at::Tensor& in1, const at::Tensor& in2, const at::Tensor& idx1) {
  namespace checks = apex::checks;
  check_rows(op, "in1", in1, in1.device(), nullptr);
  check_rows(op, "in2", in2, in1.device(), &in1);
  TORCH_CHECK_VALUE(in2.size(1) == in1.size(1), op, ": in2 has ", in2.size(1), " features (shape ",
                    checks::shape_string(in2.sizes()), ") but in1 has ", in1.size(1), " (shape ",
                    checks::shape_string(in1.sizes()), ")");
  TORCH_CHECK_TYPE(idx1.scalar_type() == c10::ScalarType::Long, op, ": idx1 has dtype ",
                   checks::torch_dtype(idx1.scalar_type()), "; expected int64");
  TORCH_CHECK_VALUE(idx1.dim() == 1 && idx1.size(0) == in2.size(0), op, ": idx1 must have shape (", in2.size(0),
                    ",) (one index per row of in2), got ", checks::shape_string(idx1.sizes()));
  checks::dense(op, "idx1", idx1, in1.device());
}

void check_like(const char* op, const char* name, const at::Tensor& t, const char* like_name, const at::Tensor& like,
                const at::Tensor& in1) {
  check_rows(op, name, t, like.device(), &in1);
  TORCH_CHECK_VALUE(t.sizes() == like.sizes(), op, ": ", name, " has shape ", apex::checks::shape_string(t.sizes()),
                    " but ", like_name, " has shape ", apex::checks::shape_string(like.sizes()));
}

// launch -----------------------------------------------------------------------------------------

// Calls f(TypeTag<T>{}) for float32, float16, bfloat16 and float64.
template <typename F>
void dispatch(c10::ScalarType dtype, const char* op, F&& f) {
  if (dtype == c10::ScalarType::Double) {
    f(apex::TypeTag<double>{});
  } else {
    apex::dispatch_float_types(dtype, op, "in1", f);
  }
}

// The vector width for these pointers: 16 bytes when all are aligned and it divides F, else 1.
template <typename T>
int plan_width(int64_t features, std::initializer_list<const void*> pointers) {
  constexpr int kWide = static_cast<int>(16 / sizeof(T));
  bool aligned = features % kWide == 0;
  for (const void* p : pointers) aligned = aligned && apex::aligned16(p);
  return aligned ? kWide : 1;
}

Geometry plan_geometry(int64_t rows, int64_t features, int64_t in1_rows, int width) {
  Geometry g{rows, features, in1_rows, features / width, 1, 0};
  while (g.lanes < g.vectors && g.lanes < kThreads) {
    g.lanes *= 2;
    ++g.lanes_log2;
  }
  return g;
}

unsigned int blocks_for(const Geometry& g, int rows_per_thread) {
  const int64_t rows_per_block = static_cast<int64_t>(kThreads / g.lanes) * rows_per_thread;
  return static_cast<unsigned int>(apex::ceil_div(g.rows, rows_per_block));
}

// Runs launch(std::integral_constant<int, W>) for the planned width.
template <typename T, typename Launch>
void with_width(int width, Launch&& launch) {
  constexpr int kWide = static_cast<int>(16 / sizeof(T));
  if (width == kWide) {
    launch(std::integral_constant<int, kWide>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

// The float32 (float64) buffer the atomics add into: grad_in1 itself, or a buffer for 16-bit types.
at::Tensor accumulator(const at::Tensor& in1) {
  const auto dtype = in1.scalar_type() == c10::ScalarType::Double ? at::kDouble : at::kFloat;
  return at::zeros(in1.sizes(), in1.options().dtype(dtype));
}

}  // namespace

namespace apex_contrib_index_mul_2d {

at::Tensor index_mul_2d_cuda(const at::Tensor& in1, const at::Tensor& in2, const at::Tensor& idx1) {
  constexpr const char* kOp = "index_mul_2d";
  check_operands(kOp, in1, in2, idx1);
  const c10::cuda::CUDAGuard device_guard(in1.device());
  at::Tensor out = at::empty_like(in2);
  if (in2.numel() == 0) return out;
  dispatch(in1.scalar_type(), kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int width = plan_width<T>(in2.size(1), {in1.const_data_ptr(), in2.const_data_ptr(), out.const_data_ptr()});
    const Geometry g = plan_geometry(in2.size(0), in2.size(1), in1.size(0), width);
    with_width<T>(width, [&](auto w) {
      forward_kernel<T, decltype(w)::value><<<blocks_for(g, kRows), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          out.mutable_data_ptr<T>(), in1.const_data_ptr<T>(), in2.const_data_ptr<T>(), idx1.const_data_ptr<int64_t>(),
          g);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> index_mul_2d_backward_cuda(const at::Tensor& grad_out, const at::Tensor& in1,
                                                              const at::Tensor& in2, const at::Tensor& idx1) {
  constexpr const char* kOp = "index_mul_2d_backward";
  check_operands(kOp, in1, in2, idx1);
  check_like(kOp, "grad_out", grad_out, "in2", in2, in1);
  const c10::cuda::CUDAGuard device_guard(in1.device());
  at::Tensor acc = accumulator(in1);
  at::Tensor grad_in2 = at::empty_like(in2);
  if (in2.numel() > 0) {
    at::globalContext().alertNotDeterministic("index_mul_2d_backward (CUDA)");
    dispatch(in1.scalar_type(), kOp, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const int width = plan_width<T>(in2.size(1), {in1.const_data_ptr(), in2.const_data_ptr(),
                                                    grad_out.const_data_ptr(), grad_in2.const_data_ptr()});
      const Geometry g = plan_geometry(in2.size(0), in2.size(1), in1.size(0), width);
      with_width<T>(width, [&](auto w) {
        backward_kernel<T, decltype(w)::value><<<blocks_for(g, kRows), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
            acc.mutable_data_ptr<Acc<T>>(), grad_in2.mutable_data_ptr<T>(), grad_out.const_data_ptr<T>(),
            in1.const_data_ptr<T>(), in2.const_data_ptr<T>(), idx1.const_data_ptr<int64_t>(), g);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  }
  at::Tensor grad_in1 = acc.scalar_type() == in1.scalar_type() ? acc : acc.to(in1.scalar_type());
  return {grad_in1, grad_in2};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> index_mul_2d_backward_backward_cuda(
    const at::Tensor& grad_grad_in1, const at::Tensor& grad_grad_in2, const at::Tensor& grad_out,
    const at::Tensor& in1, const at::Tensor& in2, const at::Tensor& idx1) {
  constexpr const char* kOp = "index_mul_2d_backward_backward";
  check_operands(kOp, in1, in2, idx1);
  check_like(kOp, "grad_out", grad_out, "in2", in2, in1);
  check_like(kOp, "grad_grad_in1", grad_grad_in1, "in1", in1, in1);
  check_like(kOp, "grad_grad_in2", grad_grad_in2, "in2", in2, in1);
  const c10::cuda::CUDAGuard device_guard(in1.device());
  at::Tensor acc = accumulator(in1);
  at::Tensor grad_grad_out = at::empty_like(grad_out);
  at::Tensor grad_in2 = at::empty_like(in2);
  if (in2.numel() > 0) {
    at::globalContext().alertNotDeterministic("index_mul_2d_backward_backward (CUDA)");
    dispatch(in1.scalar_type(), kOp, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const int width = plan_width<T>(
          in2.size(1), {in1.const_data_ptr(), in2.const_data_ptr(), grad_out.const_data_ptr(),
                        grad_grad_in1.const_data_ptr(), grad_grad_in2.const_data_ptr(),
                        grad_grad_out.const_data_ptr(), grad_in2.const_data_ptr()});
      const Geometry g = plan_geometry(in2.size(0), in2.size(1), in1.size(0), width);
      with_width<T>(width, [&](auto w) {
        backward_backward_kernel<T, decltype(w)::value>
            <<<blocks_for(g, kRowsBackwardBackward), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
                grad_grad_out.mutable_data_ptr<T>(), acc.mutable_data_ptr<Acc<T>>(), grad_in2.mutable_data_ptr<T>(),
                grad_grad_in1.const_data_ptr<T>(), grad_grad_in2.const_data_ptr<T>(), grad_out.const_data_ptr<T>(),
                in1.const_data_ptr<T>(), in2.const_data_ptr<T>(), idx1.const_data_ptr<int64_t>(), g);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  }
  at::Tensor grad_in1 = acc.scalar_type() == in1.scalar_type() ? acc : acc.to(in1.scalar_type());
  return {grad_grad_out, grad_in1, grad_in2};
}

}  // namespace apex_contrib_index_mul_2d

