// Host-side launch helpers shared by the kernel packages: grid arithmetic, and the device facts a
// launch decision needs (multiprocessors, occupancy, device attributes, the dynamic shared memory
// a kernel may use). The facts the driver would be asked for on every call are cached per device.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/macros/Macros.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

// Each kernel library keeps its own caches: with default visibility the dynamic linker merges
// the function-local statics of inline functions (GNU unique symbols) across every apex library
// loaded in the process, and those may have been built from other versions of this header.
#define APEX_LIBRARY_LOCAL __attribute__((visibility("hidden")))

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

// The most shared memory (static plus dynamic) a block may use on the current device once a
// kernel opts in (allow_dynamic_smem): 227 KiB on sm_90, 163 KiB on sm_80, 99 KiB on sm_86/sm_89.
inline size_t smem_per_block_optin() { return at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin; }

// A value per key and device. One lock per cache, held while an entry is read, computed or
// updated; an entry whose computation threw stays empty.
template <typename Key, typename Value>
class PerDeviceCache {
 public:
  // Returns f(entry, device) for key's entry on the current device (empty the first time).
  template <typename F>
  auto update(const Key& key, F&& f) {
    const int device = at::cuda::current_device();
    const std::lock_guard<std::mutex> lock(mutex_);
    return f(entries_[std::make_pair(key, device)], device);
  }

  // key's value on the current device, compute(device) the first time.
  template <typename Compute>
  Value get(const Key& key, Compute&& compute) {
    return update(key, [&](std::optional<Value>& entry, int device) {
      if (!entry) entry = compute(device);
      return *entry;
    });
  }

 private:
  std::mutex mutex_;
  std::map<std::pair<Key, int>, std::optional<Value>> entries_;
};

// An attribute of the current device (cudaDeviceGetAttribute).
APEX_LIBRARY_LOCAL inline int device_attribute(cudaDeviceAttr attribute) {
  static PerDeviceCache<cudaDeviceAttr, int> cache;
  return cache.get(attribute, [&](int device) {
    int value = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
    return value;
  });
}

// Blocks of `threads` threads (and `smem` bytes of dynamic shared memory) of `kernel` that fit on
// one multiprocessor of the current device at once; at least 1.
APEX_LIBRARY_LOCAL inline int resident_blocks(const void* kernel, int threads, size_t smem) {
  static PerDeviceCache<std::tuple<const void*, int, size_t>, int> cache;
  return cache.get({kernel, threads, smem}, [&](int) {
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem));
    return blocks > 0 ? blocks : 1;
  });
}

// Lets `kernel` use `bytes` of dynamic shared memory on the current device; the attribute is set
// when a kernel asks for more than it was last allowed there. Always set, not only past 48 KiB:
// the default limit counts the kernel's static shared memory too, so 48 KiB of dynamic memory
// alone can exceed it. max_shared_carveout asks for the largest shared-memory carveout, so that
// as many blocks fit as the occupancy calculation (resident_blocks) counts on; it also leaves
// the least L1 (28 KiB on the H200). Without it the driver chooses. Call it before
// resident_blocks for the same kernel: the carveout changes how many blocks fit.
APEX_LIBRARY_LOCAL inline void allow_dynamic_smem(const void* kernel, size_t bytes, bool max_shared_carveout) {
  if (bytes == 0) return;
  static PerDeviceCache<const void*, size_t> allowed;
  allowed.update(kernel, [&](std::optional<size_t>& current, int) {
    if (current.value_or(0) >= bytes) return;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
    if (max_shared_carveout) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          static_cast<int>(cudaSharedmemCarveoutMaxShared)));
    }
    current = bytes;
  });
}

}  // namespace apex
