// group_norm_forward: y = act((x - mean) * rstd * weight + bias) per (sample, group) of a (N, HW, C)
// tensor, with mean and rstd (float32, (N, G)). The math is _reference.forward; the launch geometry
// is group_norm_common.cuh's plan(). Three kernels:
//   1. channel_sums: per block and channel, sums of d = x - K and d * d over the block's rows, K
//      being the group's first element in the sample (a shift from inside the group keeps the
//      one-pass variance from cancelling when |mean| >> std);
//   2. group_statistics: one block per (sample, group) adds its channels' partial sums and
//      writes mean and rstd;
//   3. normalize: y = x * a + b' with a = rstd * w, b' = bias - mean * a per channel (computed
//      once per thread), then SiLU. x is read twice (the second time mostly from L2 at Stable
//      Diffusion's sizes) and y written once.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <tuple>

#include "group_norm_common.cuh"
#include "cuda_ops.h"

namespace apex_contrib_group_norm {
namespace {

constexpr const char* kOp = "group_norm_forward";

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) channel_sums(const T* __restrict__ x, Shape s, Plan p,
                                                         float* __restrict__ sum_d, float* __restrict__ sum_d2) {
  const Tile t = tile_of<V>(s, p);
  float s1[V], s2[V];
#pragma unroll
  for (int j = 0; j < V; ++j) s1[j] = s2[j] = 0.f;
  if (t.active) {
    const T* sample = x + t.n * s.hw * s.c;
    float shift[V];
#pragma unroll
    for (int j = 0; j < V; ++j) shift[j] = static_cast<float>(sample[group_of(s, t.c0 + j) * s.group_channels]);
    const int64_t step = static_cast<int64_t>(p.ty) * kUnroll;
    for (int64_t r = t.row_begin; r < t.row_end; r += step) {
      float v[kUnroll][V];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t row = r + u * p.ty;
        if (row < t.row_end) apex::load_floats<V>(v[u], sample + row * s.c + t.c0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (r + u * p.ty < t.row_end) {
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const float d = v[u][j] - shift[j];
            s1[j] += d;
            s2[j] = fmaf(d, d, s2[j]);
          }
        }
      }
    }
  }
  write_channel_partials<V>(s, p, t, s1, s2, sum_d, sum_d2);
}

// One block of kThreads per (sample, group).
template <typename T>
__global__ void __launch_bounds__(kThreads) group_statistics(const T* __restrict__ x, Shape s, Plan p,
                                                             const float* __restrict__ sum_d,
                                                             const float* __restrict__ sum_d2, float eps,
                                                             float* __restrict__ mean, float* __restrict__ rstd) {
  __shared__ float shared[32];
  const int64_t n = blockIdx.x / s.groups;
  const int64_t g = blockIdx.x - n * s.groups;
  const int64_t first = n * p.hw_blocks * s.c + g * s.group_channels;
  float s1 = 0.f, s2 = 0.f;
  for_each_group_entry(p.hw_blocks, s.group_channels, [&](int64_t hb, int64_t ci) {
    s1 += sum_d[first + hb * s.c + ci];
    s2 += sum_d2[first + hb * s.c + ci];
  });
  s1 = apex::block_sum(s1, shared);
  s2 = apex::block_sum(s2, shared);
  if (threadIdx.x == 0) {
    const float count = static_cast<float>(s.hw * s.group_channels);
    const float d = s1 / count;
    const float var = fmaxf(s2 / count - d * d, 0.f);
    mean[blockIdx.x] = static_cast<float>(x[n * s.hw * s.c + g * s.group_channels]) + d;
    rstd[blockIdx.x] = rsqrtf(var + eps);
  }
}

template <typename T, typename W, int V, bool kSilu>
__global__ void __launch_bounds__(kThreads) normalize(const T* __restrict__ x, const W* __restrict__ weight,
                                                      const W* __restrict__ bias, const float* __restrict__ mean,
                                                      const float* __restrict__ rstd, Shape s, Plan p,
                                                      T* __restrict__ y) {
  const Tile t = tile_of<V>(s, p);
  if (!t.active) return;
  float scale[V], shift[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t c = t.c0 + j;
    const int64_t stat = t.n * s.groups + group_of(s, c);
    const float w = weight == nullptr ? 1.f : static_cast<float>(weight[c]);
    const float b = bias == nullptr ? 0.f : static_cast<float>(bias[c]);
    scale[j] = rstd[stat] * w;
    shift[j] = b - mean[stat] * scale[j];
  }
  const int64_t offset = t.n * s.hw * s.c + t.c0;
  const T* in = x + offset;
  T* out = y + offset;
  const int64_t step = static_cast<int64_t>(p.ty) * kUnroll;
  for (int64_t r = t.row_begin; r < t.row_end; r += step) {
    float v[kUnroll][V];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t row = r + u * p.ty;
      if (row < t.row_end) apex::load_floats<V>(v[u], in + row * s.c);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t row = r + u * p.ty;
      if (row < t.row_end) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float z = fmaf(v[u][j], scale[j], shift[j]);
          v[u][j] = kSilu ? z * sigmoid(z) : z;
        }
        apex::store_floats<V>(out + row * s.c, v[u]);
      }
    }
  }
}

template <typename T, typename W, int V>
void launch(const at::Tensor& x, const W* weight, const W* bias, const Shape& s, const Plan& p, double eps,
            bool silu, at::Tensor& y, at::Tensor& mean, at::Tensor& rstd) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor sums = at::empty({2, s.n * p.hw_blocks * s.c}, x.options().dtype(at::kFloat));
  float* sum_d = sums.mutable_data_ptr<float>();
  float* sum_d2 = sum_d + s.n * p.hw_blocks * s.c;
  const T* in = x.const_data_ptr<T>();
  channel_sums<T, V><<<p.grid(s), p.block(), 0, stream>>>(in, s, p, sum_d, sum_d2);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  group_statistics<T><<<static_cast<unsigned>(s.n * s.groups), kThreads, 0, stream>>>(
      in, s, p, sum_d, sum_d2, static_cast<float>(eps), mean.mutable_data_ptr<float>(), rstd.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto normalize_kernel = silu ? normalize<T, W, V, true> : normalize<T, W, V, false>;
  normalize_kernel<<<p.grid(s), p.block(), 0, stream>>>(in, weight, bias, mean.const_data_ptr<float>(),
                                                        rstd.const_data_ptr<float>(), s, p, y.mutable_data_ptr<T>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename W>
const W* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<W>() : nullptr;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_forward_cuda(const at::Tensor& x,
                                                                        const std::optional<at::Tensor>& weight,
                                                                        const std::optional<at::Tensor>& bias,
                                                                        int64_t num_groups, double eps,
                                                                        c10::string_view act) {
  const std::string_view act_view(act.data(), act.size());
  check_x(kOp, x, weight, bias, num_groups, act_view);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, kOp, ": eps must be finite and non-negative, got ", eps);
  const c10::cuda::CUDAGuard device_guard(x.device());
  const Shape s = shape_of(x, num_groups);
  at::Tensor y = at::empty_like(x);
  at::Tensor mean = at::empty({s.n, s.groups}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({s.n, s.groups}, x.options().dtype(at::kFloat));
  if (s.n == 0) return {y, mean, rstd};
  if (s.hw == 0) {  // empty groups: mean 0, variance 0 (as the reference)
    mean.zero_();
    rstd.fill_(1.0 / std::sqrt(eps));
    return {y, mean, rstd};
  }
  const bool silu = is_silu(act_view);
  const auto param_dtype = weight.has_value() ? weight->scalar_type()
                                              : (bias.has_value() ? bias->scalar_type() : c10::ScalarType::Float);
  APEX_DISPATCH_FLOAT_TYPES(x.scalar_type(), kOp, "x", scalar_t, {
    constexpr int kWidth = apex::vector_width<scalar_t>();
    const bool aligned = apex::aligned16(x.const_data_ptr()) && apex::aligned16(y.const_data_ptr());
    const Plan p = plan(s, kWidth, aligned);
    auto run = [&](auto weight_tag) {
      using W = typename decltype(weight_tag)::type;
      const W* w = data_or_null<W>(weight);
      const W* b = data_or_null<W>(bias);
      if (p.vec == kWidth) {
        launch<scalar_t, W, kWidth>(x, w, b, s, p, eps, silu, y, mean, rstd);
      } else {
        launch<scalar_t, W, 1>(x, w, b, s, p, eps, silu, y, mean, rstd);
      }
    };
    if (param_dtype == c10::ScalarType::Float) {
      run(apex::TypeTag<float>{});
    } else {
      run(apex::TypeTag<scalar_t>{});
    }
  });
  return {y, mean, rstd};
}

}  // namespace apex_contrib_group_norm

