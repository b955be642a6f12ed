// batch_norm_forward (channels-first) and batch_norm_forward_c_last (with optional z and ReLU):
// y = (x - mean) * invstd * weight + bias [+ z] [relu], one read of x (and z), one write of y.
// See _reference.batch_norm_forward.
//
// Channels-first: a grid-stride walk over all units with a cursor that tracks the channel
// (no division per element); per-channel values come through the L1 cache. Channels-last:
// each thread owns V channels for all its rows and keeps their scale and shift in registers.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>

#include "syncbn_common.cuh"
#include "cuda_ops.h"

namespace apex_parallel {
namespace {

template <typename T, typename W, typename A = acc_t<T>>
struct ForwardParams {
  const T* input;
  const T* z;  // may be null (channels-last only)
  const A* mean;
  const A* invstd;
  const W* weight;  // may be null
  const W* bias;    // may be null
  T* output;
  bool relu;
};

template <typename T, typename W, int V, typename A = acc_t<T>>
__global__ void __launch_bounds__(kThreads)
    forward_channels_first(ForwardParams<T, W> p, int64_t channels, int64_t plane_units, int64_t units,
                           ChannelStep step) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  ChannelCursor cursor{(j / plane_units) % channels, j % plane_units};
  for (; j < units; j += kUnroll * stride) {
    A x[kUnroll][V];
    int64_t c[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      c[u] = cursor.c;
      if (j + u * stride < units) load_values<V>(x[u], p.input + (j + u * stride) * V);
      cursor.advance(step, plane_units, channels);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (j + u * stride >= units) continue;
      const A mean = p.mean[c[u]];
      const A scale = p.invstd[c[u]] * load_or(p.weight, c[u], A(1));
      const A shift = load_or(p.bias, c[u], A(0));
      A y[V];
#pragma unroll
      for (int k = 0; k < V; ++k) y[k] = (x[u][k] - mean) * scale + shift;
      store_values<V>(p.output + (j + u * stride) * V, y);
    }
  }
}

template <typename T, typename W, int V, typename A = acc_t<T>>
__global__ void __launch_bounds__(kThreads) forward_channels_last(ForwardParams<T, W> p, int64_t rows,
                                                                  int64_t channels) {
  const int64_t cu = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (cu * V >= channels) return;
  A mean[V], scale[V], shift[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t c = cu * V + k;
    mean[k] = p.mean[c];
    scale[k] = p.invstd[c] * load_or(p.weight, c, A(1));
    shift[k] = load_or(p.bias, c, A(0));
  }
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t r = blockIdx.y * static_cast<int64_t>(blockDim.y) + threadIdx.y; r < rows; r += kUnroll * row_step) {
    Packed<T, V> px[kUnroll];
    Packed<T, V> pz[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const bool ok = r + u * row_step < rows;
      const int64_t offset = (r + u * row_step) * channels + cu * V;
      px[u] = load_packed<V>(p.input, offset, ok);
      pz[u] = load_packed<V>(p.z, offset, ok && p.z != nullptr);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (r + u * row_step >= rows) continue;
      A x[V];
      A z[V];
      unpack(x, px[u]);
      unpack(z, pz[u]);
      A y[V];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        A v = (x[k] - mean[k]) * scale[k] + shift[k];
        if (p.z != nullptr) v += z[k];
        y[k] = p.relu && v <= A(0) ? A(0) : v;
      }
      store_values<V>(p.output + (r + u * row_step) * channels + cu * V, y);
    }
  }
}

at::Tensor forward(const char* op, const at::Tensor& input, const std::optional<at::Tensor>& z,
                   const at::Tensor& mean, const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                   const std::optional<at::Tensor>& bias, bool fuse_relu, bool channel_last) {
  const int64_t channels = checks::stats(op, input, mean, invstd, weight, bias, channel_last);
  const at::Tensor* zt = optional_tensor(z);
  if (zt != nullptr) checks::like_input(op, "z", *zt, input);
  const c10::cuda::CUDAGuard device_guard(input.device());
  at::Tensor output = at::empty(input.sizes(), input.options());
  const int64_t numel = input.numel();
  if (numel == 0) return output;
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_input_weight(op, input.scalar_type(), weight, [&](auto t, auto wt) {
    using T = typename decltype(t)::type;
    using W = typename decltype(wt)::type;
    using A = acc_t<T>;
    ForwardParams<T, W> p{};
    p.input = static_cast<const T*>(input.const_data_ptr());
    p.z = zt != nullptr ? static_cast<const T*>(zt->const_data_ptr()) : nullptr;
    p.mean = mean.const_data_ptr<A>();
    p.invstd = invstd.const_data_ptr<A>();
    p.weight = optional_ptr<W>(weight);
    p.bias = optional_ptr<W>(bias);
    p.output = static_cast<T*>(output.data_ptr());
    p.relu = fuse_relu;
    if (!channel_last) {
      const int64_t plane = numel / (input.size(0) * channels);
      dispatch_vector<T>(pick_vector<T>(plane, {p.input, p.output}), [&](auto v) {
        constexpr int V = decltype(v)::value;
        const int64_t plane_units = plane / V;
        const int64_t units = numel / V;
        const FlatLaunch launch = channels_first_launch(units, plane_units, channels);
        forward_channels_first<T, W, V><<<static_cast<unsigned>(launch.grid), kThreads, 0, stream>>>(
            p, channels, plane_units, units, launch.step);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    } else {
      dispatch_vector<T>(pick_vector<T>(channels, {p.input, p.z, p.output}), [&](auto v) {
        constexpr int V = decltype(v)::value;
        const int64_t rows = numel / channels;
        const TileLaunch launch = channels_last_launch(channels / V, rows, kUnroll);
        forward_channels_last<T, W, V><<<launch.grid, launch.block, 0, stream>>>(p, rows, channels);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
  });
  return output;
}

}  // namespace

at::Tensor batch_norm_forward_cuda(const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
                                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias) {
  return forward("batch_norm_forward", input, std::nullopt, mean, invstd, weight, bias, false, false);
}

at::Tensor batch_norm_forward_c_last_cuda(const at::Tensor& input, const std::optional<at::Tensor>& z,
                                          const at::Tensor& mean, const at::Tensor& invstd,
                                          const std::optional<at::Tensor>& weight,
                                          const std::optional<at::Tensor>& bias, bool fuse_relu) {
  return forward("batch_norm_forward_c_last", input, z, mean, invstd, weight, bias, fuse_relu, true);
}

}  // namespace apex_parallel

