// update_scale_hysteresis: the dynamic loss scale update with hysteresis, on the device (one
// thread; the state never goes to the host). See apex/core/_ops.py for the reference:
// - an overflow (found_inf > 0) spends one unit of hysteresis; the scale backs off only once
//   none is left, and the growth count restarts;
// - growth_interval overflow-free steps in a row multiply the scale by growth_factor (unless
//   that is not finite) and restore the full hysteresis.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>

#include <apex/checks.h>

#include "cuda_ops.h"

namespace {

constexpr const char* kOp = "update_scale_hysteresis";

__global__ void update_scale_hysteresis_kernel(float* current_scale, int* growth_tracker, int* hysteresis_tracker,
                                               const float* found_inf, float growth_factor, float backoff_factor,
                                               int64_t growth_interval, int hysteresis) {
  const bool found = *found_inf > 0.0f;
  const int hysteresis_left = found ? *hysteresis_tracker - 1 : *hysteresis_tracker;
  const bool back_off = found && hysteresis_left <= 0;
  const int successes = *growth_tracker + 1;
  const bool grow = !found && successes == growth_interval;
  const float scale = *current_scale;
  const float grown = scale * growth_factor;
  *current_scale = back_off ? scale * backoff_factor : (grow && isfinite(grown) ? grown : scale);
  *growth_tracker = found || grow ? 0 : successes;
  *hysteresis_tracker = found ? hysteresis_left : hysteresis;
}

}  // namespace

namespace apex_core {

void update_scale_hysteresis_cuda(const at::Tensor& current_scale, const at::Tensor& growth_tracker,
                                  const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                                  double growth_factor, double backoff_factor, int64_t growth_interval,
                                  int64_t hysteresis) {
  namespace checks = apex::checks;
  const auto device = checks::scalar_tensor(kOp, "current_scale", current_scale, {at::kFloat});
  checks::scalar_tensor(kOp, "growth_tracker", growth_tracker, {at::kInt}, device);
  checks::scalar_tensor(kOp, "hysteresis_tracker", hysteresis_tracker, {at::kInt}, device);
  checks::scalar_tensor(kOp, "found_inf", found_inf, {at::kFloat}, device);
  TORCH_CHECK_VALUE(growth_interval > 0, kOp, ": growth_interval must be positive, got ", growth_interval);
  TORCH_CHECK_VALUE(hysteresis > 0, kOp, ": hysteresis must be positive, got ", hysteresis);
  // 1.0 is allowed (the scale then never grows); NaN fails the comparison
  TORCH_CHECK_VALUE(std::isfinite(growth_factor) && growth_factor >= 1.0, kOp,
                    ": growth_factor must be finite and >= 1, got ", growth_factor);
  TORCH_CHECK_VALUE(backoff_factor > 0.0 && backoff_factor < 1.0, kOp, ": backoff_factor must be in (0, 1), got ",
                    backoff_factor);

  const c10::cuda::CUDAGuard device_guard(device);
  update_scale_hysteresis_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(
      current_scale.data_ptr<float>(), growth_tracker.data_ptr<int>(), hysteresis_tracker.data_ptr<int>(),
      found_inf.data_ptr<float>(), static_cast<float>(growth_factor), static_cast<float>(backoff_factor),
      growth_interval, static_cast<int>(hysteresis));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace apex_core

