// Host-side launch arithmetic shared by the kernel packages: grid sizes and the device's
// multiprocessor count.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/macros/Macros.h>

#include <cstdint>

namespace apex {

// ceil(a / b) for a >= 0, b > 0.
C10_HOST_DEVICE inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The least power of two >= n (1 for n <= 1).
inline int next_power_of_two(int64_t n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// Multiprocessors of the current device.
inline int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

}  // namespace apex
