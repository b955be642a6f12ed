// The RNN-T loss: alpha/beta over the T x U lattice in log space and the gradient w.r.t. the logits
// (softmax backward folded in) or the log-probabilities. The math, the layouts and the wording of
// the checks are in _reference.py / _ops.py.
//
// Forward, two kernels: (1) one warp per lattice point reads its row of x once, computes the row's
// log-sum-exp when normalising, and stores log p(blank) and log p(label) in a small float32 table;
// (2) one block per batch element and direction sweeps the anti-diagonals of the lattice (alpha
// from (0, 0), beta from (f_len - 1, y_len)), one thread per u, the previous diagonal in shared
// memory and the next diagonal's table entries loaded before each barrier.
// Backward, one kernel: one warp per lattice point reads its row of x and writes its gradient row.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#include <apex/launch.cuh>

#include "transducer_common.cuh"
#include "cuda_ops.h"

namespace {

using namespace transducer;

constexpr int kRowWarps = 8;  // lattice points (warps) per block in the row kernels
constexpr int kMaxSweepThreads = 1024;
constexpr int kMaxPerThread = 8;  // u's per thread in the sweep: U <= 8192
constexpr int kUnroll = 4;        // row vectors in flight per lane

struct Lattice {
  const int* label;  // [B, U - 1]
  const int* f_len;
  const int* y_len;
  const int64_t* batch_offset;  // null: padded
  int64_t B, T, U, V;
  int64_t rows;  // rows of x
  int64_t blank;
};

struct Point {
  int64_t b, t, u, F, Y;
  int64_t row;  // x's row, -1 when (t, u) is outside the valid lattice
};

__device__ __forceinline__ int64_t valid_f_len(const Lattice& l, int64_t b) { return clamp64(l.f_len[b], 1, l.T); }
__device__ __forceinline__ int64_t valid_y_len(const Lattice& l, int64_t b) { return clamp64(l.y_len[b], 0, l.U - 1); }

__device__ __forceinline__ Point point_of(const Lattice& l, int64_t index) {
  Point p;
  p.u = index % l.U;
  p.t = (index / l.U) % l.T;
  p.b = index / (l.U * l.T);
  p.F = valid_f_len(l, p.b);
  p.Y = valid_y_len(l, p.b);
  const bool valid = p.t < p.F && p.u <= p.Y;
  if (l.batch_offset != nullptr) {
    const int64_t base = p.b == 0 ? 0 : l.batch_offset[p.b - 1];
    p.row = valid ? base + p.t * (p.Y + 1) + p.u : -1;
    if (p.row >= l.rows) p.row = -1;
  } else {
    p.row = valid ? index : -1;
  }
  return p;
}

__device__ __forceinline__ int64_t label_at(const Lattice& l, int64_t b, int64_t u) {
  return clamp64(l.label[b * (l.U - 1) + u], 0, l.V - 1);
}

// The log-sum-exp of one row of x, by one warp.
template <typename T, int VW>
__device__ acc_t<T> row_log_sum_exp(const T* x, int64_t V, int lane) {
  using A = acc_t<T>;
  A m = neg_inf<A>(), s = A(0);
  for (int64_t base = int64_t{lane} * VW; base < V; base += int64_t{32} * VW * kUnroll) {
    A v[kUnroll][VW];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + int64_t{k} * 32 * VW;
      if (i < V) {
        load_acc<VW>(v[k], x + i);
      } else {
#pragma unroll
        for (int j = 0; j < VW; ++j) v[k][j] = neg_inf<A>();
      }
    }
    A vmax = m;
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
#pragma unroll
      for (int j = 0; j < VW; ++j) vmax = v[k][j] > vmax ? v[k][j] : vmax;
    }
    if (vmax == neg_inf<A>()) continue;
    s *= exp(m - vmax);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
#pragma unroll
      for (int j = 0; j < VW; ++j) s += exp(v[k][j] - vmax);
    }
    m = vmax;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const A m2 = __shfl_xor_sync(0xffffffffu, m, offset);
    const A s2 = __shfl_xor_sync(0xffffffffu, s, offset);
    const A mm = m > m2 ? m : m2;
    s = (mm == neg_inf<A>()) ? A(0) : s * exp(m - mm) + s2 * exp(m2 - mm);
    m = mm;
  }
  return m + log(s);
}

// lp_blank/lp_label [B, T, U] (-inf outside the lattice / where no label is emitted); lse per row of x.
template <typename T, int VW, bool kNormalize>
__global__ void __launch_bounds__(kRowWarps * 32)
    lattice_log_probs_kernel(const T* __restrict__ x, Lattice l, acc_t<T>* __restrict__ lse,
                             acc_t<T>* __restrict__ lp_blank, acc_t<T>* __restrict__ lp_label) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % 32;
  const int64_t index = blockIdx.x * int64_t{kRowWarps} + threadIdx.x / 32;
  if (index >= l.B * l.T * l.U) return;
  const Point p = point_of(l, index);
  if (p.row < 0) {
    if (lane == 0) {
      lp_blank[index] = neg_inf<A>();
      lp_label[index] = neg_inf<A>();
      if (kNormalize && l.batch_offset == nullptr) lse[index] = A(0);
    }
    return;
  }
  const T* xr = x + p.row * l.V;
  A norm = A(0);
  if constexpr (kNormalize) norm = row_log_sum_exp<T, VW>(xr, l.V, lane);
  if (lane == 0) {
    if (kNormalize) lse[p.row] = norm;
    lp_blank[index] = static_cast<A>(xr[l.blank]) - norm;
    lp_label[index] = p.u < p.Y ? static_cast<A>(xr[label_at(l, p.b, p.u)]) - norm : neg_inf<A>();
  }
}

// blockIdx.y == 0: alpha, == 1: beta (and the loss). One diagonal per step, thread tid owns
// u = tid + j * blockDim.x.
template <typename T>
__global__ void __launch_bounds__(kMaxSweepThreads) sweep_kernel(Lattice l, const acc_t<T>* __restrict__ lp_blank, const acc_t<T>* __restrict__ lp_label,
                             acc_t<T>* __restrict__ alpha, acc_t<T>* __restrict__ beta, T* __restrict__ loss) {
  using A = acc_t<T>;
  extern __shared__ unsigned char smem_bytes[];
  A* diag[2] = {reinterpret_cast<A*>(smem_bytes), reinterpret_cast<A*>(smem_bytes) + l.U};
  const int64_t b = blockIdx.x;
  const bool backward = blockIdx.y == 1;
  const int64_t F = valid_f_len(l, b), Y = valid_y_len(l, b);
  const int64_t plane = b * l.T * l.U;
  const A* lpb = lp_blank + plane;
  const A* lpl = lp_label + plane;
  A* out = (backward ? beta : alpha) + plane;
  const int64_t steps = F + Y;  // diagonals 0 .. F + Y - 1

  // The two table entries point (t, u) of diagonal d needs, or -inf.
  auto operands = [&](int64_t d, int64_t u, A& from_t, A& from_u) {
    from_t = neg_inf<A>();
    from_u = neg_inf<A>();
    if (u > Y) return;
    if (!backward) {
      const int64_t t = d - u;
      if (t < 0 || t >= F) return;
      if (t >= 1) from_t = lpb[(t - 1) * l.U + u];
      if (u >= 1) from_u = lpl[t * l.U + u - 1];
    } else {
      const int64_t t = F - 1 - d + Y - u;
      if (t < 0 || t >= F) return;
      if (t + 1 < F) from_t = lpb[t * l.U + u];
      if (u + 1 <= Y) from_u = lpl[t * l.U + u];
    }
  };
  A next_t[kMaxPerThread], next_u[kMaxPerThread];
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) operands(1, threadIdx.x + int64_t{j} * blockDim.x, next_t[j], next_u[j]);
  if (threadIdx.x == 0) {
    const A first = backward ? lpb[(F - 1) * l.U + Y] : A(0);
    diag[0][backward ? Y : 0] = first;
    out[backward ? (F - 1) * l.U + Y : 0] = first;
    if (steps == 1 && backward) loss[b] = static_cast<T>(-first);
  }
  __syncthreads();
  for (int64_t d = 1; d < steps; ++d) {
    const A* prev = diag[(d - 1) & 1];
    A* cur = diag[d & 1];
#pragma unroll
    for (int j = 0; j < kMaxPerThread; ++j) {
      const int64_t u = threadIdx.x + int64_t{j} * blockDim.x;
      const A step_t = next_t[j], step_u = next_u[j];
      operands(d + 1, u, next_t[j], next_u[j]);  // issued before this diagonal's arithmetic
      if (u > Y) continue;
      const int64_t t = backward ? F - 1 - d + Y - u : d - u;
      if (t < 0 || t >= F) continue;
      A value;
      if (!backward) {
        value = log_add_exp(t >= 1 ? prev[u] + step_t : neg_inf<A>(), u >= 1 ? prev[u - 1] + step_u : neg_inf<A>());
      } else {
        value = log_add_exp(t + 1 < F ? prev[u] + step_t : neg_inf<A>(), u + 1 <= Y ? prev[u + 1] + step_u : neg_inf<A>());
      }
      cur[u] = value;
      out[t * l.U + u] = value;
      if (backward && d == steps - 1) loss[b] = static_cast<T>(-value);
    }
    __syncthreads();
  }
  // Outside the valid lattice alpha and beta are 0.
  for (int64_t i = threadIdx.x; i < l.T * l.U; i += blockDim.x) {
    if (i / l.U >= F || i % l.U > Y) out[i] = A(0);
  }
}

// One warp per lattice point: x_grad's row (zeros outside the lattice in the padded layout).
template <typename T, int VW, bool kFuse>
__global__ void __launch_bounds__(kRowWarps * 32)
    loss_backward_kernel(const T* __restrict__ x, const T* __restrict__ loss_grad, const acc_t<T>* __restrict__ alpha,
                         const acc_t<T>* __restrict__ beta, const acc_t<T>* __restrict__ lse, Lattice l,
                         T* __restrict__ x_grad) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % 32;
  const int64_t index = blockIdx.x * int64_t{kRowWarps} + threadIdx.x / 32;
  if (index >= l.B * l.T * l.U) return;
  const Point p = point_of(l, index);
  if (p.row < 0) {
    if (l.batch_offset == nullptr) {
      T* gr = x_grad + index * l.V;
      for (int64_t i = int64_t{lane} * VW; i < l.V; i += int64_t{32} * VW) {
        A zero[VW];
#pragma unroll
        for (int j = 0; j < VW; ++j) zero[j] = A(0);
        store_acc<VW>(gr + i, zero);
      }
    }
    return;
  }
  const T* xr = x + p.row * l.V;
  T* gr = x_grad + p.row * l.V;
  const int64_t plane = p.b * l.T * l.U;
  const A lg = static_cast<A>(loss_grad[p.b]);
  const A norm = lse != nullptr ? lse[p.row] : A(0);
  const A a = alpha[plane + p.t * l.U + p.u];
  const A total = beta[plane];  // log P(y | x) = beta(0, 0)
  const int64_t label = p.u < p.Y ? label_at(l, p.b, p.u) : -1;
  A blank_coef = A(0), label_coef = A(0);
  if (lane == 0) {
    const A lpb = static_cast<A>(xr[l.blank]) - norm;
    if (p.t + 1 < p.F) {
      blank_coef = exp(a + lpb + beta[plane + (p.t + 1) * l.U + p.u] - total) * lg;
    } else if (p.u == p.Y) {
      blank_coef = exp(a + lpb - total) * lg;
    }
    if (label >= 0) {
      const A lpl = static_cast<A>(xr[label]) - norm;
      label_coef = exp(a + lpl + beta[plane + p.t * l.U + p.u + 1] - total) * lg;
    }
  }
  blank_coef = __shfl_sync(0xffffffffu, blank_coef, 0);
  label_coef = __shfl_sync(0xffffffffu, label_coef, 0);
  const A occupancy = a + beta[plane + p.t * l.U + p.u] - total - norm;  // log of the occupancy, less the norm
  for (int64_t base = int64_t{lane} * VW; base < l.V; base += int64_t{32} * VW * kUnroll) {
    A v[kUnroll][VW];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + int64_t{k} * 32 * VW;
      if (kFuse && i < l.V) load_acc<VW>(v[k], xr + i);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + int64_t{k} * 32 * VW;
      if (i >= l.V) continue;
      A gv[VW];
#pragma unroll
      for (int j = 0; j < VW; ++j) {
        gv[j] = kFuse ? exp(v[k][j] + occupancy) * lg : A(0);
        if (i + j == l.blank) gv[j] -= blank_coef;
        if (i + j == label) gv[j] -= label_coef;
      }
      store_acc<VW>(gr + i, gv);
    }
  }
}

template <typename T>
int row_vector_width(int64_t V, std::initializer_list<const void*> pointers) {
  constexpr int kWidth = 16 / sizeof(T);
  if (V % kWidth != 0) return 1;
  for (const void* p : pointers) {
    if (p != nullptr && !apex::aligned_to(p, 16)) return 1;
  }
  return kWidth;
}

unsigned int row_blocks(int64_t points) {
  const int64_t blocks = apex::ceil_div(points, kRowWarps);
  TORCH_CHECK(blocks < (int64_t{1} << 31), "transducer loss: too many lattice points (", points, ")");
  return static_cast<unsigned int>(blocks);
}

// The checks of _ops._check_loss_input; returns U.
int64_t check_loss_input(const char* op, const at::Tensor& x, const at::Tensor& label, const at::Tensor& f_len,
                         const at::Tensor& y_len, const std::optional<at::Tensor>& batch_offset, int64_t max_f_len,
                         int64_t blank_idx) {
  float_tensor(op, "x", x, x.device());
  TORCH_CHECK_TYPE(label.scalar_type() == at::kInt, op, ": label has dtype ",
                   apex::checks::torch_dtype(label.scalar_type()), "; expected torch.int32");
  dims(op, "label", label, 2, "[B, max label length]");
  apex::checks::dense(op, "label", label, x.device());
  const int64_t B = label.size(0), U = label.size(1) + 1;
  if (batch_offset.has_value()) {
    dims(op, "x", x, 2, "[rows, V] (packed)");
  } else {
    dims(op, "x", x, 4, "[B, T, U, V]");
    TORCH_CHECK_VALUE(x.size(0) == B && x.size(1) == max_f_len && x.size(2) == U, op, ": x has shape ",
                      apex::checks::shape_string(x.sizes()), "; expected [B=", B, ", max_f_len=", max_f_len,
                      ", U=", U, " (label length + 1), V]");
  }
  lengths(op, "f_len", f_len, "y_len", y_len, batch_offset, B, x.device());
  const int64_t V = x.size(-1);
  TORCH_CHECK_VALUE(blank_idx >= 0 && blank_idx < V, op, ": blank_idx must lie in [0, ", V - 1, "], got ", blank_idx);
  return U;
}

Lattice lattice_of(const at::Tensor& x, const at::Tensor& label, const at::Tensor& f_len, const at::Tensor& y_len,
                   const std::optional<at::Tensor>& batch_offset, int64_t T, int64_t U, int64_t blank_idx) {
  const int64_t V = x.size(-1);
  return Lattice{label.const_data_ptr<int>(),
                 f_len.const_data_ptr<int>(),
                 y_len.const_data_ptr<int>(),
                 batch_offset.has_value() ? batch_offset->const_data_ptr<int64_t>() : nullptr,
                 label.size(0),
                 T,
                 U,
                 V,
                 V == 0 ? 0 : x.numel() / V,
                 blank_idx};
}

}  // namespace

namespace apex_contrib_transducer {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> loss_forward_cuda(
    const at::Tensor& x, const at::Tensor& label, const at::Tensor& f_len, const at::Tensor& y_len,
    const std::optional<at::Tensor>& batch_offset, int64_t max_f_len, int64_t blank_idx, bool normalize) {
  const char* op = "loss_forward";
  non_negative(op, "max_f_len", max_f_len);
  const int64_t U = check_loss_input(op, x, label, f_len, y_len, batch_offset, max_f_len, blank_idx);
  TORCH_CHECK_VALUE(U <= int64_t{kMaxSweepThreads} * kMaxPerThread, op, ": label length + 1 (", U,
                    ") exceeds the CUDA kernel's limit of ", kMaxSweepThreads * kMaxPerThread);
  const c10::cuda::CUDAGuard guard(x.device());
  // The sweep keeps two diagonals of U accumulator values in shared memory: float64 input near the
  // U limit needs 128 KB, more than sm_86 / sm_89 give a block (99 KB).
  const auto acc_bytes = static_cast<int64_t>(c10::elementSize(compute_dtype(x.scalar_type())));
  const auto smem_limit = static_cast<int64_t>(apex::smem_per_block_optin());
  TORCH_CHECK_VALUE(2 * U * acc_bytes <= smem_limit, op, ": label length + 1 (", U, ") needs ", 2 * U * acc_bytes,
                    " bytes of shared memory (two lattice diagonals of ", acc_bytes,
                    "-byte values), more than this GPU gives a block (", smem_limit, ")",
                    acc_bytes == 8 ? "; float32 input needs half as much" : "");
  const int64_t B = label.size(0), T = max_f_len;
  const auto acc_options = x.options().dtype(compute_dtype(x.scalar_type()));
  const Lattice l = lattice_of(x, label, f_len, y_len, batch_offset, T, U, blank_idx);
  at::Tensor alpha = at::empty({B, T, U}, acc_options);
  at::Tensor beta = at::empty({B, T, U}, acc_options);
  at::Tensor loss = at::empty({B}, x.options());
  at::Tensor lse = at::empty({normalize ? l.rows : 0}, acc_options);
  if (B == 0) return {alpha, beta, loss, lse};
  if (T == 0) {
    alpha.zero_();
    beta.zero_();
    loss.zero_();
    return {alpha, beta, loss, lse};
  }
  at::Tensor lp_blank = at::empty({B, T, U}, acc_options);
  at::Tensor lp_label = at::empty({B, T, U}, acc_options);
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch(x.scalar_type(), op, "x", [&](auto tag) {
    using T_ = typename decltype(tag)::type;
    using A = acc_t<T_>;
    const int vw = row_vector_width<T_>(l.V, {x.const_data_ptr()});
    const auto blocks = row_blocks(B * T * U);
    auto launch = [&](auto width, auto normalize_tag) {
      constexpr int VW = decltype(width)::value;
      lattice_log_probs_kernel<T_, VW, decltype(normalize_tag)::value><<<blocks, kRowWarps * 32, 0, stream>>>(
          x.const_data_ptr<T_>(), l, normalize ? lse.mutable_data_ptr<A>() : nullptr, lp_blank.mutable_data_ptr<A>(),
          lp_label.mutable_data_ptr<A>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    constexpr int kWide = 16 / sizeof(T_);
    if (normalize) {
      if (vw == kWide) launch(std::integral_constant<int, kWide>{}, std::true_type{});
      else launch(std::integral_constant<int, 1>{}, std::true_type{});
    } else {
      launch(std::integral_constant<int, 1>{}, std::false_type{});
    }
    const int threads = static_cast<int>(std::min<int64_t>(kMaxSweepThreads, apex::ceil_div(U, 32) * 32));
    const size_t smem = 2 * U * sizeof(A);
    apex::allow_dynamic_smem(reinterpret_cast<const void*>(&sweep_kernel<T_>), smem, false);
    sweep_kernel<T_><<<dim3(static_cast<unsigned int>(B), 2), threads, smem, stream>>>(
        l, lp_blank.const_data_ptr<A>(), lp_label.const_data_ptr<A>(), alpha.mutable_data_ptr<A>(),
        beta.mutable_data_ptr<A>(), loss.mutable_data_ptr<T_>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {alpha, beta, loss, lse};
}

at::Tensor loss_backward_cuda(const at::Tensor& x, const at::Tensor& loss_grad, const at::Tensor& alpha,
                              const at::Tensor& beta, const std::optional<at::Tensor>& lse, const at::Tensor& label,
                              const at::Tensor& f_len, const at::Tensor& y_len,
                              const std::optional<at::Tensor>& batch_offset, int64_t blank_idx, bool fuse_softmax) {
  const char* op = "loss_backward";
  float_tensor(op, "alpha", alpha, x.device());
  dims(op, "alpha", alpha, 3, "[B, max_f_len, U]");
  const int64_t U = check_loss_input(op, x, label, f_len, y_len, batch_offset, alpha.size(1), blank_idx);
  const auto compute = compute_dtype(x.scalar_type());
  const int64_t B = label.size(0), T = alpha.size(1);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"alpha", alpha}, {"beta", beta}}) {
    float_tensor(op, name, t, x.device());
    TORCH_CHECK_TYPE(t.scalar_type() == compute, op, ": ", name, " has dtype ", apex::checks::torch_dtype(t.scalar_type()),
                     "; expected ", apex::checks::torch_dtype(compute), " for x of dtype ",
                     apex::checks::torch_dtype(x.scalar_type()));
    TORCH_CHECK_VALUE(t.dim() == 3 && t.size(0) == B && t.size(1) == T && t.size(2) == U, op, ": ", name,
                      " has shape ", apex::checks::shape_string(t.sizes()), "; expected (", B, ", ", T, ", ", U, ")");
  }
  float_tensor(op, "loss_grad", loss_grad, x.device());
  TORCH_CHECK_TYPE(loss_grad.scalar_type() == x.scalar_type(), op, ": loss_grad has dtype ",
                   apex::checks::torch_dtype(loss_grad.scalar_type()), " but x has ",
                   apex::checks::torch_dtype(x.scalar_type()));
  TORCH_CHECK_VALUE(loss_grad.dim() == 1 && loss_grad.size(0) == B, op, ": loss_grad has shape ",
                    apex::checks::shape_string(loss_grad.sizes()), "; expected (", B, ",)");
  const int64_t V = x.size(-1);
  const int64_t rows = V == 0 ? 0 : x.numel() / V;
  if (lse.has_value()) {
    TORCH_CHECK_VALUE(fuse_softmax, op, ": lse is only used with fuse_softmax (the gradient w.r.t. the logits)");
    index_tensor(op, "lse", *lse, compute, {rows}, x.device());
  }
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor x_grad = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return x_grad;
  if (B == 0 || T == 0) return x_grad.zero_();
  const Lattice l = lattice_of(x, label, f_len, y_len, batch_offset, T, U, blank_idx);
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch(x.scalar_type(), op, "x", [&](auto tag) {
    using T_ = typename decltype(tag)::type;
    using A = acc_t<T_>;
    const int vw = row_vector_width<T_>(V, {x.const_data_ptr(), x_grad.const_data_ptr()});
    const auto blocks = row_blocks(B * T * U);
    auto launch = [&](auto width, auto fuse_tag) {
      constexpr int VW = decltype(width)::value;
      loss_backward_kernel<T_, VW, decltype(fuse_tag)::value><<<blocks, kRowWarps * 32, 0, stream>>>(
          x.const_data_ptr<T_>(), loss_grad.const_data_ptr<T_>(), alpha.const_data_ptr<A>(), beta.const_data_ptr<A>(),
          lse.has_value() ? lse->const_data_ptr<A>() : nullptr, l, x_grad.mutable_data_ptr<T_>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    constexpr int kWide = 16 / sizeof(T_);
    if (fuse_softmax) {
      if (vw == kWide) launch(std::integral_constant<int, kWide>{}, std::true_type{});
      else launch(std::integral_constant<int, 1>{}, std::true_type{});
    } else {
      if (vw == kWide) launch(std::integral_constant<int, kWide>{}, std::false_type{});
      else launch(std::integral_constant<int, 1>{}, std::false_type{});
    }
  });
  // Packed rows that no lattice point reaches (offsets past the batch's rows) are left unwritten by
  // the kernel; the reference rejects such offsets.
  return x_grad;
}

}  // namespace apex_contrib_transducer

