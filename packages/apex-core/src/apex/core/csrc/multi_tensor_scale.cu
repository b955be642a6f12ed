// multi_tensor_scale: outputs[i] = inputs[i] * scale (* scale_tensor), in fp32; noop_flag = 1
// when any input holds an inf or NaN. See apex/core/_ops.py for the reference.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/multi_tensor_apply.cuh>
#include <apex/vectorized.cuh>

#include "cuda_ops.h"

namespace {

constexpr const char* kOp = "multi_tensor_scale";
constexpr int kAccessesInFlight = 4;

template <typename In, typename Out>
struct ScaleFunctor {
  int* noop_flag;
  float scale;
  const float* scale_tensor;  // may be null

  __device__ void operator()(const apex::Chunk<2>& chunk) const {
    const In* in = chunk.data<In>(0);
    Out* out = chunk.data<Out>(1);
    const float factor = scale_tensor != nullptr ? *scale_tensor * scale : scale;
    bool finite = true;
    apex::for_each_element<apex::vector_width<In, Out>(), kAccessesInFlight>(
        chunk.size,
        [&](auto group) {
          typename decltype(group)::Values x;
          group.load(x, in);
          group.for_each_value([&](int i, int j) {
            finite &= isfinite(x[i][j]);
            x[i][j] *= factor;
          });
          group.store(out, x);
        },
        in, out);
    if (!finite) *noop_flag = 1;
  }
};

}  // namespace

namespace apex_core {

void multi_tensor_scale_cuda(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList inputs,
                             at::TensorList outputs, double scale, const std::optional<at::Tensor>& scale_tensor) {
  namespace checks = apex::checks;
  checks::positive_chunk_size(kOp, chunk_size);
  const auto device = checks::scalar_tensor(kOp, "noop_flag", noop_flag, {at::kInt});
  checks::same_lengths(kOp, {{"inputs", inputs.size()}, {"outputs", outputs.size()}});
  const auto in_dtype = checks::tensor_list(kOp, "inputs", inputs, device);
  const auto out_dtype = checks::tensor_list(kOp, "outputs", outputs, device);
  checks::same_layouts(kOp, {{"inputs", inputs}, {"outputs", outputs}});
  checks::same_numel(kOp, "outputs", outputs, "inputs", inputs);
  const float* scale_ptr = nullptr;
  if (scale_tensor.has_value() && scale_tensor->defined()) {
    checks::scalar_tensor(kOp, "scale_tensor", *scale_tensor, {at::kFloat}, device);
    scale_ptr = scale_tensor->data_ptr<float>();
  }
  if (inputs.empty()) return;

  const c10::cuda::CUDAGuard device_guard(device);
  APEX_DISPATCH_FLOAT_TYPES2(*in_dtype, "inputs", in_t, *out_dtype, "outputs", out_t, kOp, {
    apex::multi_tensor_apply<2>(
        chunk_size, {inputs, outputs},
        ScaleFunctor<in_t, out_t>{noop_flag.data_ptr<int>(), static_cast<float>(scale), scale_ptr});
  });
}

}  // namespace apex_core

