// group_norm_backward: (dx, dweight, dbias) of group_norm_forward, from x and the saved mean and rstd.
// The math is _reference.backward: with xhat = (x - mean) * rstd and g = dy * act'(z) (SiLU's
// derivative recomputed from z = xhat * w + b),
//   dbias[c] = sum g,  dweight[c] = sum g * xhat                 (over samples and rows)
//   dx = rstd * (g * w - A / M - xhat * B / M),  A = sum g * w,  B = sum g * w * xhat  (per group)
// A and B are weighted sums of the per-(sample, channel) sums of g and g * xhat, so one reduction
// serves all four. Three kernels, on group_norm_common.cuh's plan():
//   1. channel_grad_sums: per block and channel, sums of g and g * xhat over the block's rows;
//   2. reduce_grad_sums: blocks [0, N*G) add up A/M and B/M per (sample, group); the blocks after
//      them add up dweight and dbias per channel (32 channels a block);
//   3. grad_input: dx, one pass over x and dy.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>

#include <tuple>

#include "group_norm_common.cuh"
#include "cuda_ops.h"

namespace apex_contrib_group_norm {
namespace {

constexpr const char* kOp = "group_norm_backward";
// Channels per block of the dweight/dbias reduction (a warp's lanes), and rows of them.
constexpr int kParamChannels = 32;
constexpr int kParamRows = kThreads / kParamChannels;
// Rows a thread loads before using them: x and dy, so half of kUnroll for 8-element vectors
// (64 floats in flight; 4 rows spilled registers).
template <int V>
constexpr int kGradUnroll = V >= 8 ? kUnroll / 2 : kUnroll;

// A thread's channels: their group's statistics and the affine parameters.
template <int V>
struct ChannelParams {
  float mean[V];
  float rstd[V];
  float w[V];
  float b[V];
};

template <typename W, int V>
__device__ __forceinline__ ChannelParams<V> channel_params(const Shape& s, const Tile& t, const W* weight,
                                                           const W* bias, const float* mean, const float* rstd) {
  ChannelParams<V> cp;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t c = t.c0 + j;
    const int64_t stat = t.n * s.groups + group_of(s, c);
    cp.mean[j] = mean[stat];
    cp.rstd[j] = rstd[stat];
    cp.w[j] = weight == nullptr ? 1.f : static_cast<float>(weight[c]);
    cp.b[j] = bias == nullptr ? 0.f : static_cast<float>(bias[c]);
  }
  return cp;
}

// g = dy * d act(z) / dz, z = xhat * w + b.
template <bool kSilu>
__device__ __forceinline__ float activation_grad(float dy, float xhat, float w, float b) {
  if constexpr (kSilu) {
    const float z = fmaf(xhat, w, b);
    const float sg = sigmoid(z);
    return dy * sg * fmaf(z, 1.f - sg, 1.f);
  } else {
    return dy;
  }
}

template <typename T, typename W, int V, bool kSilu>
__global__ void __launch_bounds__(kThreads, 2)
    channel_grad_sums(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
                      const W* __restrict__ bias, const float* __restrict__ mean, const float* __restrict__ rstd,
                      Shape s, Plan p, float* __restrict__ sum_g, float* __restrict__ sum_gx) {
  const Tile t = tile_of<V>(s, p);
  float sg[V], sgx[V];
#pragma unroll
  for (int j = 0; j < V; ++j) sg[j] = sgx[j] = 0.f;
  if (t.active) {
    const ChannelParams<V> cp = channel_params<W, V>(s, t, weight, bias, mean, rstd);
    const int64_t offset = t.n * s.hw * s.c + t.c0;
    const T* xs = x + offset;
    const T* dys = dy + offset;
    constexpr int kU = kGradUnroll<V>;
    const int64_t step = static_cast<int64_t>(p.ty) * kU;
    for (int64_t r = t.row_begin; r < t.row_end; r += step) {
      float xv[kU][V], dv[kU][V];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t row = r + u * p.ty;
        if (row < t.row_end) {
          apex::load_floats<V>(xv[u], xs + row * s.c);
          apex::load_floats<V>(dv[u], dys + row * s.c);
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (r + u * p.ty < t.row_end) {
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const float xhat = (xv[u][j] - cp.mean[j]) * cp.rstd[j];
            const float g = activation_grad<kSilu>(dv[u][j], xhat, cp.w[j], cp.b[j]);
            sg[j] += g;
            sgx[j] = fmaf(g, xhat, sgx[j]);
          }
        }
      }
    }
  }
  write_channel_partials<V>(s, p, t, sg, sgx, sum_g, sum_gx);
}

template <typename W>
__global__ void __launch_bounds__(kThreads)
    reduce_grad_sums(const float* __restrict__ sum_g, const float* __restrict__ sum_gx, const W* __restrict__ weight,
                     Shape s, Plan p, float* __restrict__ group_coefs, W* __restrict__ dweight,
                     W* __restrict__ dbias) {
  __shared__ float shared[2][kParamRows][kParamChannels];
  const int64_t group_blocks = s.n * s.groups;
  if (blockIdx.x < group_blocks) {  // A / M and B / M of one (sample, group)
    const int64_t n = blockIdx.x / s.groups;
    const int64_t g = blockIdx.x - n * s.groups;
    const int64_t first_c = g * s.group_channels;
    const int64_t first = n * p.hw_blocks * s.c + first_c;
    float a = 0.f, b = 0.f;
    for_each_group_entry(p.hw_blocks, s.group_channels, [&](int64_t hb, int64_t ci) {
      const float w = weight == nullptr ? 1.f : static_cast<float>(weight[first_c + ci]);
      a = fmaf(w, sum_g[first + hb * s.c + ci], a);
      b = fmaf(w, sum_gx[first + hb * s.c + ci], b);
    });
    a = apex::block_sum(a, shared[0][0]);
    b = apex::block_sum(b, shared[0][0]);
    if (threadIdx.x == 0) {
      const float count = static_cast<float>(s.hw * s.group_channels);
      group_coefs[2 * blockIdx.x] = a / count;
      group_coefs[2 * blockIdx.x + 1] = b / count;
    }
    return;
  }
  // dweight and dbias of kParamChannels channels: sums over every (sample, row block)
  const int lane = threadIdx.x % kParamChannels;
  const int row = threadIdx.x / kParamChannels;
  const int64_t c = (blockIdx.x - group_blocks) * kParamChannels + lane;
  const int64_t rows = s.n * p.hw_blocks;
  float g = 0.f, gx = 0.f;
  if (c < s.c) {
    for (int64_t r = row; r < rows; r += kParamRows) {
      g += sum_g[r * s.c + c];
      gx += sum_gx[r * s.c + c];
    }
  }
  shared[0][row][lane] = g;
  shared[1][row][lane] = gx;
  __syncthreads();
  if (row == 0 && c < s.c) {
    for (int i = 1; i < kParamRows; ++i) {
      g += shared[0][i][lane];
      gx += shared[1][i][lane];
    }
    if (dbias != nullptr) dbias[c] = static_cast<W>(g);
    if (dweight != nullptr) dweight[c] = static_cast<W>(gx);
  }
}

template <typename T, typename W, int V, bool kSilu>
__global__ void __launch_bounds__(kThreads)
    grad_input(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
               const W* __restrict__ bias, const float* __restrict__ mean, const float* __restrict__ rstd,
               const float* __restrict__ group_coefs, Shape s, Plan p, T* __restrict__ dx) {
  const Tile t = tile_of<V>(s, p);
  if (!t.active) return;
  const ChannelParams<V> cp = channel_params<W, V>(s, t, weight, bias, mean, rstd);
  // dx = g * (rstd * w) + xhat * (-rstd * B / M) + (-rstd * A / M)
  float gain[V], xhat_gain[V], offset_term[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t stat = t.n * s.groups + group_of(s, t.c0 + j);
    gain[j] = cp.rstd[j] * cp.w[j];
    xhat_gain[j] = -cp.rstd[j] * group_coefs[2 * stat + 1];
    offset_term[j] = -cp.rstd[j] * group_coefs[2 * stat];
  }
  const int64_t offset = t.n * s.hw * s.c + t.c0;
  const T* xs = x + offset;
  const T* dys = dy + offset;
  T* dxs = dx + offset;
  constexpr int kU = kGradUnroll<V>;
  const int64_t step = static_cast<int64_t>(p.ty) * kU;
  for (int64_t r = t.row_begin; r < t.row_end; r += step) {
    float xv[kU][V], dv[kU][V];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t row = r + u * p.ty;
      if (row < t.row_end) {
        apex::load_floats<V>(xv[u], xs + row * s.c);
        apex::load_floats<V>(dv[u], dys + row * s.c);
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t row = r + u * p.ty;
      if (row < t.row_end) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float xhat = (xv[u][j] - cp.mean[j]) * cp.rstd[j];
          const float g = activation_grad<kSilu>(dv[u][j], xhat, cp.w[j], cp.b[j]);
          xv[u][j] = fmaf(g, gain[j], fmaf(xhat, xhat_gain[j], offset_term[j]));
        }
        apex::store_floats<V>(dxs + row * s.c, xv[u]);
      }
    }
  }
}

template <typename T, typename W, int V, bool kSilu>
void launch(const at::Tensor& dy, const at::Tensor& x, const W* weight, const W* bias, const at::Tensor& mean,
            const at::Tensor& rstd, const Shape& s, const Plan& p, at::Tensor& dx, W* dweight, W* dbias) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t partials = s.n * p.hw_blocks * s.c;
  at::Tensor work = at::empty({2 * partials + 2 * s.n * s.groups}, x.options().dtype(at::kFloat));
  float* sum_g = work.mutable_data_ptr<float>();
  float* sum_gx = sum_g + partials;
  float* group_coefs = sum_gx + partials;
  const T* dy_data = dy.const_data_ptr<T>();
  const T* x_data = x.const_data_ptr<T>();
  const float* mean_data = mean.const_data_ptr<float>();
  const float* rstd_data = rstd.const_data_ptr<float>();
  channel_grad_sums<T, W, V, kSilu><<<p.grid(s), p.block(), 0, stream>>>(dy_data, x_data, weight, bias, mean_data,
                                                                          rstd_data, s, p, sum_g, sum_gx);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t blocks = s.n * s.groups + apex::ceil_div(s.c, kParamChannels);
  reduce_grad_sums<W><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(sum_g, sum_gx, weight, s, p,
                                                                              group_coefs, dweight, dbias);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  grad_input<T, W, V, kSilu><<<p.grid(s), p.block(), 0, stream>>>(dy_data, x_data, weight, bias, mean_data,
                                                                   rstd_data, group_coefs, s, p,
                                                                   dx.mutable_data_ptr<T>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A parameter's gradient: zeros when no kernel runs (an empty batch or empty groups), else uninitialized
// (reduce_grad_sums writes every channel; zeros would cost a fill kernel each, host time per call).
at::Tensor param_grad(const at::Tensor& x, const std::optional<at::Tensor>& param, bool kernels_run) {
  if (!param.has_value()) return at::empty({0}, x.options().dtype(at::kFloat));
  return kernels_run ? at::empty_like(*param) : at::zeros_like(*param);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_backward_cuda(
    const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd, int64_t num_groups,
    c10::string_view act) {
  namespace checks = apex::checks;
  const std::string_view act_view(act.data(), act.size());
  check_x(kOp, x, weight, bias, num_groups, act_view);
  TORCH_CHECK_TYPE(dy.scalar_type() == x.scalar_type(), kOp, ": dy has dtype ", checks::torch_dtype(dy.scalar_type()),
                   " but x has ", checks::torch_dtype(x.scalar_type()));
  TORCH_CHECK_VALUE(dy.sizes() == x.sizes(), kOp, ": dy has shape ", checks::shape_string(dy.sizes()), " but x has ",
                    checks::shape_string(x.sizes()));
  checks::dense(kOp, "dy", dy, x.device());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"mean", &mean},
                                std::pair<const char*, const at::Tensor*>{"rstd", &rstd}}) {
    TORCH_CHECK_TYPE(t->scalar_type() == c10::ScalarType::Float, kOp, ": ", name, " has dtype ",
                     checks::torch_dtype(t->scalar_type()), "; expected float32");
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == x.size(0) && t->size(1) == num_groups, kOp, ": ", name,
                      " has shape ", checks::shape_string(t->sizes()), ", expected (N, num_groups) = (", x.size(0),
                      ", ", num_groups, ")");
    checks::dense(kOp, name, *t, x.device());
  }
  const c10::cuda::CUDAGuard device_guard(x.device());
  const Shape s = shape_of(x, num_groups);
  at::Tensor dx = at::empty_like(x);
  const bool kernels_run = s.n != 0 && s.hw != 0;
  at::Tensor dweight = param_grad(x, weight, kernels_run);
  at::Tensor dbias = param_grad(x, bias, kernels_run);
  if (!kernels_run) return {dx, dweight, dbias};
  const bool silu = is_silu(act_view);
  const auto param_dtype = weight.has_value() ? weight->scalar_type()
                                              : (bias.has_value() ? bias->scalar_type() : c10::ScalarType::Float);
  APEX_DISPATCH_FLOAT_TYPES(x.scalar_type(), kOp, "x", scalar_t, {
    constexpr int kWidth = apex::vector_width<scalar_t>();
    const bool aligned = apex::aligned16(x.const_data_ptr()) && apex::aligned16(dy.const_data_ptr()) &&
                         apex::aligned16(dx.const_data_ptr());
    const Plan p = plan(s, kWidth, aligned);
    auto run = [&](auto weight_tag) {
      using W = typename decltype(weight_tag)::type;
      const W* w = weight.has_value() ? weight->const_data_ptr<W>() : nullptr;
      const W* b = bias.has_value() ? bias->const_data_ptr<W>() : nullptr;
      W* dw = weight.has_value() ? dweight.mutable_data_ptr<W>() : nullptr;
      W* db = bias.has_value() ? dbias.mutable_data_ptr<W>() : nullptr;
      if (p.vec == kWidth) {
        silu ? launch<scalar_t, W, kWidth, true>(dy, x, w, b, mean, rstd, s, p, dx, dw, db)
             : launch<scalar_t, W, kWidth, false>(dy, x, w, b, mean, rstd, s, p, dx, dw, db);
      } else {
        silu ? launch<scalar_t, W, 1, true>(dy, x, w, b, mean, rstd, s, p, dx, dw, db)
             : launch<scalar_t, W, 1, false>(dy, x, w, b, mean, rstd, s, p, dx, dw, db);
      }
    };
    if (param_dtype == c10::ScalarType::Float) {
      run(apex::TypeTag<float>{});
    } else {
      run(apex::TypeTag<scalar_t>{});
    }
  });
  return {dx, dweight, dbias};
}

}  // namespace apex_contrib_group_norm

