// multi_tensor_axpby: out[i] = a * x[i] + b * y[i], in fp32; noop_flag = 1 when the checked
// argument (x, y or both, by arg_to_check) holds an inf or NaN. See apex/core/_ops.py.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/multi_tensor_apply.cuh>
#include <apex/vectorized.cuh>

#include "cuda_ops.h"

namespace {

constexpr const char* kOp = "multi_tensor_axpby";
// Two input streams, so half the accesses in flight per stream of multi_tensor_scale.
constexpr int kAccessesInFlight = 2;

template <typename X, typename Y, typename Out>
struct AxpbyFunctor {
  int* noop_flag;
  float a;
  float b;
  bool check_x;
  bool check_y;

  __device__ void operator()(const apex::Chunk<3>& chunk) const {
    const X* x = chunk.data<X>(0);
    const Y* y = chunk.data<Y>(1);
    Out* out = chunk.data<Out>(2);
    bool finite = true;
    apex::for_each_element<apex::vector_width<X, Y, Out>(), kAccessesInFlight>(
        chunk.size,
        [&](auto group) {
          using Group = decltype(group);
          float xv[Group::kCount][Group::kWidth];
          float yv[Group::kCount][Group::kWidth];
          group.load(xv, x);
          group.load(yv, y);
#pragma unroll
          for (int i = 0; i < Group::kCount; ++i) {
#pragma unroll
            for (int j = 0; j < Group::kWidth; ++j) {
              finite &= (!check_x || isfinite(xv[i][j])) && (!check_y || isfinite(yv[i][j]));
              xv[i][j] = a * xv[i][j] + b * yv[i][j];
            }
          }
          group.store(out, xv);
        },
        x, y, out);
    if (!finite) *noop_flag = 1;
  }
};

}  // namespace

namespace apex_core {

void multi_tensor_axpby_cuda(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList x, at::TensorList y,
                             at::TensorList out, double a, double b, int64_t arg_to_check) {
  namespace checks = apex::checks;
  checks::positive_chunk_size(kOp, chunk_size);
  const auto device = checks::scalar_tensor(kOp, "noop_flag", noop_flag, {at::kInt});
  checks::same_lengths(kOp, {{"x", x.size()}, {"y", y.size()}, {"out", out.size()}});
  const auto x_dtype = checks::tensor_list(kOp, "x", x, device);
  const auto y_dtype = checks::tensor_list(kOp, "y", y, device);
  const auto out_dtype = checks::tensor_list(kOp, "out", out, device);
  checks::same_layouts(kOp, {{"x", x}, {"y", y}, {"out", out}});
  for (size_t i = 0; i < x.size(); ++i) {
    TORCH_CHECK_VALUE(x[i].numel() == y[i].numel() && y[i].numel() == out[i].numel(), kOp, ": x[", i, "], y[", i,
                      "] and out[", i, "] must have the same number of elements (", x[i].numel(), ", ",
                      y[i].numel(), ", ", out[i].numel(), ")");
  }
  TORCH_CHECK_VALUE(arg_to_check >= -1 && arg_to_check <= 1, kOp,
                    ": arg_to_check must be -1 (both), 0 (x) or 1 (y), got ", arg_to_check);
  if (x.empty()) return;

  const c10::cuda::CUDAGuard device_guard(device);
  APEX_DISPATCH_FLOAT_TYPES2(*x_dtype, "x", x_t, *y_dtype, "y", y_t, kOp, {
    APEX_DISPATCH_FLOAT_TYPES(*out_dtype, kOp, "out", out_t, {
      apex::multi_tensor_apply<3>(chunk_size, {x, y, out},
                                  AxpbyFunctor<x_t, y_t, out_t>{noop_flag.data_ptr<int>(), static_cast<float>(a),
                                                                static_cast<float>(b), arg_to_check != 1,
                                                                arg_to_check != 0});
    });
  });
}

}  // namespace apex_core

