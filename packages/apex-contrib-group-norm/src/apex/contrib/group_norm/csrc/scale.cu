// scale: out = x * alpha in float32, rounded once to x's dtype. The reference, and the wording of
// the checks below, are in apex.contrib.group_norm's _ops.py.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/launch.cuh>
#include <apex/vectorized.cuh>

namespace {

constexpr const char* kOp = "scale";
constexpr int kThreads = 256;
// 16-byte loads in flight per thread: a memory-bound kernel needs several to hide the latency.
constexpr int kAccessesInFlight = 4;
// Each block takes a few full steps of its threads. A whole number of 16-byte vectors, so every
// block starts at the alignment of the first and takes the vector path when it does.
template <typename T>
constexpr int64_t kPerBlock = int64_t{kThreads} * apex::vector_width<T>() * kAccessesInFlight * 4;

template <typename T>
__global__ void __launch_bounds__(kThreads) scale_kernel(const T* x, T* out, float alpha, int64_t n) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kPerBlock<T>;
  const int64_t count = n - begin < kPerBlock<T> ? n - begin : kPerBlock<T>;
  const T* block_x = x + begin;
  T* block_out = out + begin;
  apex::for_each_element<apex::vector_width<T>(), kAccessesInFlight>(
      count,
      [&](auto group) {
        using Group = decltype(group);
        float v[Group::kCount][Group::kWidth];
        group.load(v, block_x);
#pragma unroll
        for (int i = 0; i < Group::kCount; ++i) {
#pragma unroll
          for (int j = 0; j < Group::kWidth; ++j) v[i][j] *= alpha;
        }
        group.store(block_out, v);
      },
      block_x, block_out);
}

at::Tensor scale_cuda(const at::Tensor& x, double alpha) {
  namespace checks = apex::checks;
  TORCH_CHECK_TYPE(checks::contains(checks::kFloatDtypes, x.scalar_type()), kOp, ": x has dtype ",
                   checks::torch_dtype(x.scalar_type()), "; expected one of float32, float16, bfloat16");
  checks::dense(kOp, "x", x, x.device());
  TORCH_CHECK_VALUE(std::isfinite(alpha), kOp, ": alpha must be finite, got ", alpha);

  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return out;
  APEX_DISPATCH_FLOAT_TYPES(x.scalar_type(), kOp, "x", scalar_t, {
    const auto blocks = static_cast<unsigned int>(apex::ceil_div(n, kPerBlock<scalar_t>));
    scale_kernel<scalar_t><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), static_cast<float>(alpha), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_contrib_group_norm, CUDA, m) {
  m.impl("scale", &scale_cuda);
}
