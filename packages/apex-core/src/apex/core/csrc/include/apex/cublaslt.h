// What the packages that call cuBLASLt (apex-mlp, apex-fused-dense) share.
//
// apex::lt::epilogue_enabled(e): whether to ask cuBLASLt for the fused epilogue e; when not, the
// caller computes the same result with a plain GEMM and ATen ops (or its own kernels) instead.
// A fused epilogue can cost more than it saves: on the H200 with CUDA 13.0's cuBLASLt, DRELU_BGRAD
// and DGELU_BGRAD run as a GEMM followed by a separate generic epilogue kernel (0.3-0.4 ms per
// call at 8192 x 4096 bf16, where PyTorch's gelu_backward plus a column sum take 0.1 ms), so
// those two are off by default (measured by benchmarks/profile_epilogues.py of apex-fused-dense).
// Environment, comma-separated names, read on every call (parsed again only when changed):
// APEX_CUBLASLT_ENABLE turns default-off epilogues on, APEX_CUBLASLT_DISABLE turns any off.
// Names: bias, relu (RELU, RELU_BIAS), relu_aux (RELU_AUX, RELU_AUX_BIAS), drelu (DRELU,
// DRELU_BGRAD), gelu_aux (GELU_AUX_BIAS), dgelu (DGELU_BGRAD), bgradb (BGRADB); "all" names every one.
#pragma once

#include <cublasLt.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

namespace apex::lt {

namespace detail {

enum : unsigned {
  kBias = 1u << 0,
  kRelu = 1u << 1,
  kReluAux = 1u << 2,
  kDRelu = 1u << 3,
  kGeluAux = 1u << 4,
  kDGelu = 1u << 5,
  kBGradB = 1u << 6,
  kAll = (1u << 7) - 1,
  kDefaultOff = kDRelu | kDGelu,
};

inline unsigned parse_names(const char* text) {
  unsigned mask = 0;
  std::string list = text == nullptr ? "" : text;
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    const std::string name = list.substr(start, end - start);
    if (name == "all") mask |= kAll;
    if (name == "bias") mask |= kBias;
    if (name == "relu") mask |= kRelu;
    if (name == "relu_aux") mask |= kReluAux;
    if (name == "drelu") mask |= kDRelu;
    if (name == "gelu_aux") mask |= kGeluAux;
    if (name == "dgelu") mask |= kDGelu;
    if (name == "bgradb") mask |= kBGradB;
    start = end + 1;
  }
  return mask;
}

// The epilogues named by an environment variable (cached per thread and variable).
template <int kVariable>
unsigned named(const char* variable) {
  thread_local std::string last;
  thread_local unsigned mask = 0;
  const char* text = std::getenv(variable);
  const char* current = text == nullptr ? "" : text;
  if (last != current) {
    last = current;
    mask = parse_names(current);
  }
  return mask;
}

inline unsigned disabled() {
  return (kDefaultOff & ~named<0>("APEX_CUBLASLT_ENABLE")) | named<1>("APEX_CUBLASLT_DISABLE");
}

inline unsigned bit(cublasLtEpilogue_t epilogue) {
  switch (epilogue) {
    case CUBLASLT_EPILOGUE_BIAS:
      return kBias;
    case CUBLASLT_EPILOGUE_RELU:
    case CUBLASLT_EPILOGUE_RELU_BIAS:
      return kRelu;
    case CUBLASLT_EPILOGUE_RELU_AUX:
    case CUBLASLT_EPILOGUE_RELU_AUX_BIAS:
      return kReluAux;
    case CUBLASLT_EPILOGUE_DRELU:
    case CUBLASLT_EPILOGUE_DRELU_BGRAD:
      return kDRelu;
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
      return kGeluAux;
    case CUBLASLT_EPILOGUE_DGELU_BGRAD:
      return kDGelu;
    case CUBLASLT_EPILOGUE_BGRADB:
      return kBGradB;
    default:
      return 0;
  }
}

}  // namespace detail

inline bool epilogue_enabled(cublasLtEpilogue_t epilogue) {
  const unsigned b = detail::bit(epilogue);
  return b == 0 || (detail::disabled() & b) == 0;
}

// The heuristic's algorithm for a problem, remembered per process: cublasLtMatmulAlgoGetHeuristic
// costs host time on every call (tens of microseconds), more than a small GEMM takes on the GPU.
// The key is everything the answer depends on (operations, sizes, leading dimensions, types,
// epilogue, alignments, workspace, device); the caller fills it. A problem cuBLASLt has no
// algorithm for is remembered too (found = false), so its fallback does not ask again.
using AlgoKey = std::array<int64_t, 20>;

struct AlgoKeyHash {
  size_t operator()(const AlgoKey& key) const {
    uint64_t h = 1469598103934665603ull;
    for (const int64_t v : key) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

struct CachedAlgo {
  bool found = false;
  cublasLtMatmulAlgo_t algo = {};
};

// Returns whether an algorithm exists; `query(algo)` asks the heuristic (returns found) on a miss.
template <typename Query>
bool cached_algo(const AlgoKey& key, cublasLtMatmulAlgo_t* algo, Query&& query) {
  static std::mutex mutex;
  static std::unordered_map<AlgoKey, CachedAlgo, AlgoKeyHash> cache;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto it = cache.find(key);
    if (it != cache.end()) {
      *algo = it->second.algo;
      return it->second.found;
    }
  }
  CachedAlgo entry;
  entry.found = query(&entry.algo);
  const std::lock_guard<std::mutex> lock(mutex);
  cache.emplace(key, entry);
  *algo = entry.algo;
  return entry.found;
}

}  // namespace apex::lt
