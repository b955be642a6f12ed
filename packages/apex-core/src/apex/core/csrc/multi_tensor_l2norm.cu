// multi_tensor_l2norm and multi_tensor_unscale_l2norm: the L2 norm of all inputs together and,
// with per_tensor, of each input, in fp32. The unscale variant first multiplies by *inv_scale,
// optionally writes the unscaled values to `outputs`, and sets noop_flag = 1 when an unscaled
// value is inf or NaN. See apex/core/_ops.py for the reference.
//
// Two passes, no atomics, so the result is the same bits on every run: every chunk's block
// stores its sum of squares at partials[block_index]; cleanup kernels then sum the partials of
// each tensor, and of all tensors, in a fixed order.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/multi_tensor_apply.cuh>
#include <apex/reductions.cuh>
#include <apex/vectorized.cuh>

#include "cuda_ops.h"

namespace {

constexpr int kAccessesInFlight = 4;
constexpr int kTotalBlockSize = 1024;
constexpr int kPerTensorBlockSize = 128;

// Pass 1: sum of squares of one chunk -> partials[chunk.block_index]. With Unscale the values
// are multiplied by *inv_scale first and checked for inf/NaN; with Out other than void they
// are also stored to list 1.
template <typename In, typename Out, bool Unscale>
struct SumSquaresFunctor {
  static constexpr bool kWrites = !std::is_void_v<Out>;
  using OutT = std::conditional_t<kWrites, Out, float>;

  float* partials;
  int* noop_flag;          // Unscale only
  const float* inv_scale;  // Unscale only

  __device__ void operator()(const apex::Chunk<kWrites ? 2 : 1>& chunk) const {
    __shared__ float shared[apex::kWarpSize];
    const In* in = chunk.template data<In>(0);
    OutT* out = nullptr;
    if constexpr (kWrites) out = chunk.template data<OutT>(1);
    float factor = 1.0f;
    if constexpr (Unscale) factor = *inv_scale;
    float sum = 0.0f;
    bool finite = true;
    auto body = [&](auto group) {
      typename decltype(group)::Values v;
      group.load(v, in);
      group.for_each_value([&](int i, int j) {
        if constexpr (Unscale) {
          v[i][j] *= factor;
          finite &= isfinite(v[i][j]);
        }
        sum += v[i][j] * v[i][j];
      });
      if constexpr (kWrites) group.store(out, v);
    };
    if constexpr (kWrites) {
      apex::for_each_element<apex::vector_width<In, OutT>(), kAccessesInFlight>(chunk.size, body, in, out);
    } else {
      apex::for_each_element<apex::vector_width<In>(), kAccessesInFlight>(chunk.size, body, in);
    }
    sum = apex::block_sum(sum, shared);
    if (threadIdx.x == 0) partials[chunk.block_index] = sum;
    if constexpr (Unscale) {
      if (!finite) *noop_flag = 1;
    }
  }
};

// Pass 2a: the norm of everything, from all partials.
__global__ void __launch_bounds__(kTotalBlockSize) total_norm_kernel(const float* partials, int64_t count,
                                                                      float* total) {
  __shared__ float shared[apex::kWarpSize];
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) sum += partials[i];
  sum = apex::block_sum(sum, shared);
  // __fsqrt_rn: correctly rounded even under --use_fast_math.
  if (threadIdx.x == 0) total[0] = __fsqrt_rn(sum);
}

// Pass 2b: per-tensor norms, one block per tensor; tensor first_tensor + i owns the partials
// [bounds[i], bounds[i + 1]). Passed by value, like multi_tensor_apply's tables.
struct TensorPartials {
  static constexpr int kMaxTensors = (apex::kMaxKernelParamBytes - 64) / 8 - 2;
  int64_t first_tensor;
  int64_t bounds[kMaxTensors + 1];
};
static_assert(sizeof(TensorPartials) + 2 * sizeof(void*) <= apex::kMaxKernelParamBytes);

__global__ void __launch_bounds__(kPerTensorBlockSize)
    per_tensor_norm_kernel(const __grid_constant__ TensorPartials tensors, const float* partials, float* norms) {
  __shared__ float shared[apex::kWarpSize];
  const int64_t begin = tensors.bounds[blockIdx.x];
  const int64_t end = tensors.bounds[blockIdx.x + 1];
  float sum = 0.0f;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) sum += partials[i];
  sum = apex::block_sum(sum, shared);
  if (threadIdx.x == 0) norms[tensors.first_tensor + blockIdx.x] = __fsqrt_rn(sum);
}

// Both ops: pass 1 over `inputs` (and `outputs` when given), then the cleanup kernels.
// inv_scale == nullptr means plain l2norm (no unscaling, no noop_flag).
std::tuple<at::Tensor, at::Tensor> l2norm(const char* op, int64_t chunk_size, c10::Device device,
                                          const at::Tensor& noop_flag, at::TensorList inputs,
                                          at::TensorList outputs, const float* inv_scale, bool per_tensor) {
  const c10::cuda::CUDAGuard device_guard(device);
  const auto options = at::TensorOptions().dtype(at::kFloat).device(device);
  const int64_t n_tensors = static_cast<int64_t>(inputs.size());

  // Chunk b of the multi_tensor_apply call is tensor i's when bounds[i] <= b < bounds[i + 1].
  std::vector<int64_t> bounds(n_tensors + 1, 0);
  for (int64_t i = 0; i < n_tensors; ++i) {
    bounds[i + 1] = bounds[i] + apex::num_chunks(inputs[i].numel(), chunk_size);
  }
  const int64_t n_chunks = bounds[n_tensors];
  at::Tensor partials = at::empty({n_chunks}, options);
  at::Tensor total = at::empty({1}, options);
  at::Tensor per = at::empty({per_tensor ? n_tensors : 0}, options);

  if (n_chunks > 0) {
    float* partials_ptr = partials.data_ptr<float>();
    int* flag_ptr = inv_scale != nullptr ? noop_flag.data_ptr<int>() : nullptr;
    const auto in_dtype = inputs[0].scalar_type();
    if (inv_scale == nullptr) {
      APEX_DISPATCH_FLOAT_TYPES(in_dtype, op, "inputs", in_t, {
        apex::multi_tensor_apply<1>(chunk_size, {inputs}, SumSquaresFunctor<in_t, void, false>{partials_ptr, nullptr, nullptr});
      });
    } else if (outputs.empty()) {
      APEX_DISPATCH_FLOAT_TYPES(in_dtype, op, "inputs", in_t, {
        apex::multi_tensor_apply<1>(chunk_size, {inputs}, SumSquaresFunctor<in_t, void, true>{partials_ptr, flag_ptr, inv_scale});
      });
    } else {
      APEX_DISPATCH_FLOAT_TYPES2(in_dtype, "inputs", in_t, outputs[0].scalar_type(), "outputs", out_t, op, {
        apex::multi_tensor_apply<2>(chunk_size, {inputs, outputs},
                                    SumSquaresFunctor<in_t, out_t, true>{partials_ptr, flag_ptr, inv_scale});
      });
    }
  }

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  total_norm_kernel<<<1, kTotalBlockSize, 0, stream>>>(partials.data_ptr<float>(), n_chunks,
                                                       total.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  for (int64_t first = 0; per_tensor && first < n_tensors; first += TensorPartials::kMaxTensors) {
    const int64_t count = std::min<int64_t>(TensorPartials::kMaxTensors, n_tensors - first);
    TensorPartials tensors{};
    tensors.first_tensor = first;
    std::copy(bounds.begin() + first, bounds.begin() + first + count + 1, tensors.bounds);
    per_tensor_norm_kernel<<<static_cast<unsigned>(count), kPerTensorBlockSize, 0, stream>>>(tensors, partials.data_ptr<float>(),
                                                                       per.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {total, per};
}

}  // namespace

namespace apex_core {

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_cuda(int64_t chunk_size, const at::Tensor& noop_flag,
                                                            at::TensorList inputs, bool per_tensor) {
  constexpr const char* op = "multi_tensor_l2norm";
  namespace checks = apex::checks;
  checks::positive_chunk_size(op, chunk_size);
  const auto device = checks::scalar_tensor(op, "noop_flag", noop_flag, {at::kInt});
  checks::tensor_list(op, "inputs", inputs, device);
  return l2norm(op, chunk_size, device, noop_flag, inputs, {}, nullptr, per_tensor);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm_cuda(int64_t chunk_size, const at::Tensor& noop_flag,
                                                                    at::TensorList inputs, at::TensorList outputs,
                                                                    const at::Tensor& inv_scale, bool per_tensor) {
  constexpr const char* op = "multi_tensor_unscale_l2norm";
  namespace checks = apex::checks;
  checks::positive_chunk_size(op, chunk_size);
  const auto device = checks::scalar_tensor(op, "noop_flag", noop_flag, {at::kInt});
  checks::tensor_list(op, "inputs", inputs, device);
  if (!outputs.empty()) {
    checks::same_lengths(op, {{"inputs", inputs.size()}, {"outputs", outputs.size()}});
    checks::tensor_list(op, "outputs", outputs, device);
    checks::same_layouts(op, {{"inputs", inputs}, {"outputs", outputs}});
    checks::same_numel(op, "outputs", outputs, "inputs", inputs);
  }
  checks::scalar_tensor(op, "inv_scale", inv_scale, {at::kFloat}, device);
  return l2norm(op, chunk_size, device, noop_flag, inputs, outputs, inv_scale.data_ptr<float>(), per_tensor);
}

}  // namespace apex_core

