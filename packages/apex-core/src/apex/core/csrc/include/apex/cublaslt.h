// The cuBLASLt GEMM runner of the packages that multiply matrices (apex-mlp, apex-fused-dense):
// one GEMM per call with its fused epilogue, on PyTorch's cuBLASLt handle for the current device,
// the current stream and a workspace from PyTorch's caching allocator, or a refusal the caller
// answers with ATen (apex::lt::Runner::run returns false, having written nothing).
//
// apex::lt::epilogue_enabled(e): whether to ask cuBLASLt for the fused epilogue e; when not, the
// runner declines and the caller computes the same result with a plain GEMM and ATen ops (or its
// own kernels) instead.
// A fused epilogue can cost more than it saves: on the H200 with CUDA 13.0's cuBLASLt, DRELU_BGRAD
// and DGELU_BGRAD run as a GEMM followed by a separate generic epilogue kernel (0.3-0.4 ms per
// call at 8192 x 4096 bf16, where PyTorch's gelu_backward plus a column sum take 0.1 ms and
// apex/bias_grad.cuh's one pass 0.05 ms), and BGRADB as the GEMM plus a separate bias-gradient
// kernel (31 us for a [8192, 4096] bf16 gradient, where apex/bias_grad.cuh's column sum takes
// 21 us), so those three are off by default (measured by benchmarks/profile_epilogues.py of
// apex-fused-dense; the callers then use apex/bias_grad.cuh).
// DGELU alone (no bias gradient) is fused into the GEMM, but as an older sm90_xmma kernel where the
// plain GEMM gets a faster nvjet one: on the H100 with CUDA 13.0 FusedDenseGeluDense's forward and
// backward measured -2.6% to +32% with it, so it is off by default too (apex-fused-dense's NOTES).
// Environment, comma-separated names, read on every call (parsed again only when changed):
// APEX_CUBLASLT_ENABLE turns default-off epilogues on, APEX_CUBLASLT_DISABLE turns any off.
// Names: bias, relu (RELU, RELU_BIAS), relu_aux (RELU_AUX, RELU_AUX_BIAS), drelu (DRELU,
// DRELU_BGRAD), gelu_aux (GELU_AUX_BIAS), dgelu (DGELU_BGRAD), dgelu_only (DGELU), bgradb (BGRADB);
// "all" names every one.
// (apex-mlp's _ops.py reads the same variables to know whether the DRELU epilogues are on.)
//
// Measured choice of algorithm (no host sync; off unless APEX_CUBLASLT_TUNE names epilogues, e.g.
// gelu_aux): for those epilogues and problems of at least kTuneMinVolume = m * n * k, the runner asks the
// heuristic for up to kTuneCandidates algorithms, launches each in turn kTuneSamples times in the
// process's first calls of that problem with CUDA events around it, reads the events once they have
// completed (cudaEventQuery at later calls, never waiting) and from then on runs the candidate with the
// lowest median, the heuristic's first unless another is at least 2% faster. Timed in the calls of the
// real workload, not alone, as apex-fused-dense's NOTES found necessary. The candidates compute the
// same product; results may differ in the last bits between them (the order of the accumulation),
// so no tuning under torch.use_deterministic_algorithms, and none while the stream is being captured
// (the graph gets the best choice so far). APEX_CUBLASLT_TUNE_LOG=1 prints each decision to stderr.
// Aimed at GELU_AUX_BIAS, whose heuristic first choice timed 147-162 us at m=4096 n=8192 k=1024 where
// another candidate took 120-130 (apex-fused-dense's NOTES); off by default until whole steps on a GPU
// show it pays (profile_epilogues.py's "tune" variant, bench_e2e.py's apex-eager+APEX_CUBLASLT_TUNE=gelu_aux).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace apex::lt {
// Internal linkage (an unnamed namespace): each package's library keeps its own copy of the runner
// and its caches. With external linkage the loader would merge the function-local statics (the
// heuristic cache, the parsed environment) of every library that includes this header into one,
// whatever version of the header each library was built against.
namespace {

namespace detail {

enum : unsigned {
  kBias = 1u << 0,
  kRelu = 1u << 1,
  kReluAux = 1u << 2,
  kDRelu = 1u << 3,
  kGeluAux = 1u << 4,
  kDGelu = 1u << 5,
  kBGradB = 1u << 6,
  kDGeluOnly = 1u << 7,
  kAll = (1u << 8) - 1,
  kDefaultOff = kDRelu | kDGelu | kBGradB | kDGeluOnly,
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
    if (name == "dgelu_only") mask |= kDGeluOnly;
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

// The epilogues whose algorithm is chosen by timing (APEX_CUBLASLT_TUNE; unset: none).
inline unsigned tuned_epilogues() { return named<2>("APEX_CUBLASLT_TUNE"); }

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
    case CUBLASLT_EPILOGUE_DGELU:
      return kDGeluOnly;
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

constexpr int64_t kTuneMinVolume = int64_t{1} << 34;  // m * n * k: ~50 us of bf16 GEMM on an H100
constexpr int kTuneCandidates = 6;
constexpr int kTuneSamples = 5;

inline bool epilogue_tuned(cublasLtEpilogue_t epilogue) {
  const unsigned b = detail::bit(epilogue);
  return b != 0 && (detail::tuned_epilogues() & b) != 0;
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

namespace detail {

// One timed launch of a candidate: events recorded around it on the launch's stream (null: untimed).
struct Sample {
  int candidate = 0;
  cudaEvent_t start = nullptr;
  cudaEvent_t end = nullptr;
};

inline void destroy(Sample& s) {
  if (s.start != nullptr) cudaEventDestroy(s.start);
  if (s.end != nullptr) cudaEventDestroy(s.end);
  s.start = s.end = nullptr;
}

// The measurement of one problem's candidates (the heuristic's order; candidate 0 its first).
struct Tuning {
  // (cublasLtMatmulAlgo_t is a typedef of an unnamed struct: a std::vector of it crashes nvcc 13.0's
  // front end, a vector of a named struct holding it does not)
  std::vector<CachedAlgo> candidates;
  std::vector<std::vector<float>> ms;  // completed samples per candidate; a refused launch: infinity
  std::vector<Sample> pending;         // launched, in launch order
  int launched = 0;
  int chosen = -1;  // -1 while measuring
  bool asked = false;
};

inline float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

inline bool tune_log() {
  const char* text = std::getenv("APEX_CUBLASLT_TUNE_LOG");
  return text != nullptr && text[0] != '\0' && text[0] != '0';
}

// Moves the completed samples' times into t.ms (never waits) and decides once every candidate has
// kTuneSamples of them.
inline void collect(Tuning& t, const AlgoKey& key) {
  size_t done = 0;
  for (; done < t.pending.size(); ++done) {
    Sample& s = t.pending[done];
    const cudaError_t status = cudaEventQuery(s.end);
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: clear it, as ATen's CUDAEvent::query does
      break;
    }
    float ms = std::numeric_limits<float>::infinity();
    if (status != cudaSuccess || cudaEventElapsedTime(&ms, s.start, s.end) != cudaSuccess) {
      (void)cudaGetLastError();
      ms = std::numeric_limits<float>::infinity();
    }
    t.ms[s.candidate].push_back(ms);
    destroy(s);
  }
  t.pending.erase(t.pending.begin(), t.pending.begin() + static_cast<std::ptrdiff_t>(done));
  for (const auto& v : t.ms) {
    if (static_cast<int>(v.size()) < kTuneSamples) return;
  }
  std::vector<float> medians;
  for (const auto& v : t.ms) medians.push_back(median(v));
  int best = static_cast<int>(std::min_element(medians.begin(), medians.end()) - medians.begin());
  if (!(medians[best] < 0.98f * medians[0])) best = 0;
  t.chosen = best;
  if (tune_log()) {
    std::fprintf(stderr, "apex cublaslt tune: epilogue %lld m %lld n %lld k %lld, median us:",
                 static_cast<long long>(key[8]), static_cast<long long>(key[2]), static_cast<long long>(key[3]),
                 static_cast<long long>(key[4]));
    for (const float m : medians) std::fprintf(stderr, " %.1f", 1000.0 * m);
    std::fprintf(stderr, " -> candidate %d\n", best);
  }
}

struct TuningTable {
  std::mutex mutex;
  std::unordered_map<AlgoKey, Tuning, AlgoKeyHash> map;
};

// Never destroyed: its events must not outlive the CUDA context at the process's exit.
inline TuningTable& tuning_table() {
  static TuningTable* table = new TuningTable;
  return *table;
}

}  // namespace detail

// The candidate to launch for a tuned problem and, while measuring, the sample (its events created)
// to time it with. `query(algos, max)` asks the heuristic for up to max algorithms (returns how many
// it gave). Returns false where there is none.
template <typename Query>
bool tuned_algo(const AlgoKey& key, bool capturing, cublasLtMatmulAlgo_t* algo, detail::Sample* sample,
                Query&& query) {
  detail::TuningTable& table = detail::tuning_table();
  const std::lock_guard<std::mutex> lock(table.mutex);
  detail::Tuning& t = table.map[key];
  if (!t.asked) {
    t.asked = true;
    cublasLtMatmulAlgo_t found[kTuneCandidates] = {};
    const int count = query(found, kTuneCandidates);
    for (int i = 0; i < count; ++i) t.candidates.push_back(CachedAlgo{true, found[i]});
    t.ms.resize(t.candidates.size());
    if (t.candidates.size() <= 1) t.chosen = 0;
    if (detail::tune_log()) {
      std::fprintf(stderr, "apex cublaslt tune: epilogue %lld m %lld n %lld k %lld, %d candidates\n",
                   static_cast<long long>(key[8]), static_cast<long long>(key[2]), static_cast<long long>(key[3]),
                   static_cast<long long>(key[4]), static_cast<int>(t.candidates.size()));
    }
  }
  if (t.candidates.empty()) return false;
  int index = t.chosen >= 0 ? t.chosen : 0;
  if (t.chosen < 0 && !capturing) {
    detail::collect(t, key);
    const int n = static_cast<int>(t.candidates.size());
    if (t.chosen >= 0) {
      index = t.chosen;
    } else if (t.launched < kTuneSamples * n) {
      index = t.launched % n;
      if (cudaEventCreate(&sample->start) == cudaSuccess && cudaEventCreate(&sample->end) == cudaSuccess) {
        ++t.launched;
      } else {
        (void)cudaGetLastError();
        detail::destroy(*sample);
        index = 0;
      }
    }
  }
  sample->candidate = index;
  *algo = t.candidates[index].algo;
  return true;
}

// The heuristic's first algorithm of a tuned problem met before.
inline bool tuned_first(const AlgoKey& key, cublasLtMatmulAlgo_t* algo) {
  detail::TuningTable& table = detail::tuning_table();
  const std::lock_guard<std::mutex> lock(table.mutex);
  const auto it = table.map.find(key);
  if (it == table.map.end() || it->second.candidates.empty()) return false;
  *algo = it->second.candidates.front().algo;
  return true;
}

// Hands a timed launch back: queued for reading (ok) or, where cuBLASLt refused the candidate, counted
// as never the fastest.
inline void tuned_launched(const AlgoKey& key, detail::Sample sample, bool ok) {
  detail::TuningTable& table = detail::tuning_table();
  const std::lock_guard<std::mutex> lock(table.mutex);
  const auto it = table.map.find(key);
  if (it == table.map.end()) {
    detail::destroy(sample);
    return;
  }
  detail::Tuning& t = it->second;
  if (ok) {
    t.pending.push_back(sample);
  } else {
    t.ms[sample.candidate].assign(kTuneSamples, std::numeric_limits<float>::infinity());
    detail::destroy(sample);
  }
}


// ---------------------------------------------------------------------------------------------
// The runner

// One GEMM, column-major: D (m x n, leading dimension ldd) = op(A) (m x k) op(B) (k x n) + beta D,
// with `epilogue` reading or writing `bias` (the bias vector; where a BGRAD epilogue writes the bias
// gradient) and `aux` (RELU_AUX's bit mask, read by DRELU; GELU_AUX's pre-activation, read by
// DGELU; aux_ld its leading dimension: in bits for a bit mask, in elements otherwise). A and B are
// of the runner's dtype; D too unless d_dtype names another (a float32 accumulator of 16-bit
// products). A row-major [rows, cols] tensor is a column-major [cols, rows] matrix.
struct Gemm {
  bool transpose_a = false;
  bool transpose_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  c10::ScalarType d_dtype = c10::ScalarType::Undefined;  // Undefined: the runner's dtype
  float beta = 0.0f;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  void* aux = nullptr;
  int64_t aux_ld = 0;
};

// The three GEMMs of a linear layer y[rows, out] = x[rows, in] @ w[out, in]^T, every operand row-major
// and contiguous: the forward; the input gradient dx[rows, in] = dy[rows, out] @ w; the weight
// gradient dw[out, in] = dy^T @ x. The caller adds the epilogue, beta and an accumulator's dtype.
inline Gemm linear_forward(const void* x, const void* w, void* y, int64_t rows, int64_t in, int64_t out) {
  Gemm g;
  g.transpose_a = true;
  g.m = out, g.n = rows, g.k = in;
  g.a = w, g.lda = in;
  g.b = x, g.ldb = in;
  g.d = y, g.ldd = out;
  return g;
}

inline Gemm linear_input_grad(const void* dy, const void* w, void* dx, int64_t rows, int64_t in, int64_t out) {
  Gemm g;
  g.m = in, g.n = rows, g.k = out;
  g.a = w, g.lda = in;
  g.b = dy, g.ldb = out;
  g.d = dx, g.ldd = in;
  return g;
}

inline Gemm linear_weight_grad(const void* x, const void* dy, void* dw, int64_t rows, int64_t in, int64_t out) {
  Gemm g;
  g.transpose_b = true;
  g.m = in, g.n = out, g.k = rows;
  g.a = x, g.lda = in;
  g.b = dy, g.ldb = out;
  g.d = dw, g.ldd = in;
  return g;
}

// The largest power of two, up to 256, dividing the address (null: 256, an absent operand).
inline uint32_t alignment(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 1;
  while (a < 256 && address % (2 * a) == 0) a *= 2;
  return a;
}

namespace detail {

template <typename T, cublasStatus_t (*destroy)(T)>
struct Deleter {
  void operator()(T p) const { destroy(p); }
};
using MatmulDesc = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>,
                                   Deleter<cublasLtMatmulDesc_t, &cublasLtMatmulDescDestroy>>;
using Layout = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>,
                               Deleter<cublasLtMatrixLayout_t, &cublasLtMatrixLayoutDestroy>>;
using Preference = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                                   Deleter<cublasLtMatmulPreference_t, &cublasLtMatmulPreferenceDestroy>>;

// float32, float16, bfloat16; anything else (float64): none (the runner declines).
inline bool cuda_type(c10::ScalarType dtype, cudaDataType_t* type) {
  switch (dtype) {
    case c10::ScalarType::Float:
      *type = CUDA_R_32F;
      return true;
    case c10::ScalarType::Half:
      *type = CUDA_R_16F;
      return true;
    case c10::ScalarType::BFloat16:
      *type = CUDA_R_16BF;
      return true;
    default:
      return false;
  }
}

template <typename T>
bool set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  return cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)) == CUBLAS_STATUS_SUCCESS;
}

template <typename T>
bool set(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attribute, const T& value) {
  return cublasLtMatmulPreferenceSetAttribute(pref, attribute, &value, sizeof(value)) == CUBLAS_STATUS_SUCCESS;
}

inline Layout layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t raw = nullptr;
  if (cublasLtMatrixLayoutCreate(&raw, type, rows, cols, ld) != CUBLAS_STATUS_SUCCESS) return Layout();
  return Layout(raw);
}

}  // namespace detail

// Runs GEMMs of one dtype (`like`'s) on `like`'s device, which must be the current one (a
// CUDAGuard), on the current stream. One per op call: the 32 MiB workspace (what NVIDIA
// recommends for Hopper) is taken from the caching allocator at the first GEMM that runs and kept
// for the runner's other GEMMs. float32 uses TF32 where torch allows it for cuBLAS.
//
// run() returns false, having written nothing, wherever cuBLASLt does not take the GEMM: an empty
// dimension or one past 2^31 - 1 (documented and tested sizes; ATen splits larger ones), float64, an
// epilogue switched off (epilogue_enabled), a bias or aux pointer not 16-byte aligned or an aux
// leading dimension not a multiple of 8, a descriptor cuBLASLt will not build, no algorithm from the
// heuristic, or a refusal at launch (cuBLASLt checks its arguments before queuing any work).
//
// Alignment: with `required_alignment` 0, cuBLASLt is told each of A's, B's and D's own alignment
// (up to 256 bytes) and decides what it can take (apex-fused-dense: Megatron's views at any
// offset keep cuBLASLt). With it N (apex-mlp: 16), a GEMM whose A, B or D pointer or leading
// dimension in bytes is not a multiple of N is declined without asking, and cuBLASLt is told N
// for every operand (one algorithm per shape, wherever the tensors sit).
class Runner {
 public:
  static constexpr int64_t kWorkspaceBytes = int64_t{32} << 20;

  explicit Runner(const at::Tensor& like, uint32_t required_alignment = 0)
      : dtype_(like.scalar_type()), device_(like.device()), required_alignment_(required_alignment) {}

  bool run(const Gemm& g) {
    constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
    if (g.m <= 0 || g.n <= 0 || g.k <= 0) return false;
    if (g.m > kIntMax || g.n > kIntMax || g.k > kIntMax) return false;
    if (!epilogue_enabled(g.epilogue)) return false;  // APEX_CUBLASLT_DISABLE (benchmarks)
    const c10::ScalarType d_dtype = g.d_dtype == c10::ScalarType::Undefined ? dtype_ : g.d_dtype;
    cudaDataType_t ab_type = CUDA_R_32F;
    cudaDataType_t d_type = CUDA_R_32F;
    if (!detail::cuda_type(dtype_, &ab_type) || !detail::cuda_type(d_dtype, &d_type)) return false;
    // Epilogue vectors must be 16-byte aligned, the auxiliary matrix's leading dimension a multiple of 8.
    if (g.bias != nullptr && alignment(g.bias) < 16) return false;
    if (g.aux != nullptr && (alignment(g.aux) < 16 || g.aux_ld % 8 != 0)) return false;
    uint32_t align_a = alignment(g.a);
    uint32_t align_b = alignment(g.b);
    uint32_t align_d = alignment(g.d);
    if (required_alignment_ != 0) {
      const auto required = static_cast<int64_t>(required_alignment_);
      const auto ab_bytes = static_cast<int64_t>(c10::elementSize(dtype_));
      const auto d_bytes = static_cast<int64_t>(c10::elementSize(d_dtype));
      if (g.lda * ab_bytes % required != 0 || g.ldb * ab_bytes % required != 0 || g.ldd * d_bytes % required != 0) {
        return false;
      }
      if (align_a < required_alignment_ || align_b < required_alignment_ || align_d < required_alignment_) {
        return false;
      }
      align_a = align_b = align_d = required_alignment_;
    }
    cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
    if (dtype_ == c10::ScalarType::Float && at::globalContext().allowTF32CuBLAS()) {
      compute = CUBLAS_COMPUTE_32F_FAST_TF32;
    }

    cublasLtMatmulDesc_t raw_desc = nullptr;
    if (cublasLtMatmulDescCreate(&raw_desc, compute, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return false;
    const detail::MatmulDesc desc(raw_desc);
    const cublasOperation_t op_a = g.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = g.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    bool ok = detail::set(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, op_a) &&
              detail::set(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, op_b) &&
              detail::set(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, g.epilogue);
    if (ok && g.bias != nullptr) ok = detail::set(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
    if (ok && g.aux != nullptr) {
      ok = detail::set(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux) &&
           detail::set(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.aux_ld);
    }
    if (!ok) return false;

    // Stored shapes: op(A) is m x k, so A is k x m when transposed; likewise B.
    const detail::Layout layout_a =
        detail::layout(ab_type, g.transpose_a ? g.k : g.m, g.transpose_a ? g.m : g.k, g.lda);
    const detail::Layout layout_b =
        detail::layout(ab_type, g.transpose_b ? g.n : g.k, g.transpose_b ? g.k : g.n, g.ldb);
    const detail::Layout layout_d = detail::layout(d_type, g.m, g.n, g.ldd);
    if (!layout_a || !layout_b || !layout_d) return false;

    cublasLtMatmulPreference_t raw_pref = nullptr;
    if (cublasLtMatmulPreferenceCreate(&raw_pref) != CUBLAS_STATUS_SUCCESS) return false;
    const detail::Preference pref(raw_pref);
    const uint64_t workspace_bytes = kWorkspaceBytes;
    ok = detail::set(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_bytes) &&
         detail::set(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a) &&
         detail::set(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b) &&
         detail::set(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d) &&
         detail::set(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d);
    if (!ok) return false;

    cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
    const bool tune = epilogue_tuned(g.epilogue) && static_cast<double>(g.m) * g.n * g.k >= kTuneMinVolume &&
                      !at::globalContext().deterministicAlgorithms();
    const AlgoKey key = {g.transpose_a, g.transpose_b, g.m,       g.n,       g.k,
                         g.lda,         g.ldb,         g.ldd,     g.epilogue, ab_type,
                         d_type,        compute,       align_a,   align_b,   align_d,
                         g.aux_ld,      g.beta != 0.0f, kWorkspaceBytes, device_.index(), tune};
    // Up to `max` algorithms from the heuristic, best first; how many it gave.
    auto ask = [&](cublasLtMatmulAlgo_t* out, int max) {
      cublasLtMatmulHeuristicResult_t heuristic[kTuneCandidates] = {};
      int count = 0;
      if (cublasLtMatmulAlgoGetHeuristic(handle, desc.get(), layout_a.get(), layout_b.get(), layout_d.get(),
                                         layout_d.get(), pref.get(), std::min(max, kTuneCandidates), heuristic,
                                         &count) != CUBLAS_STATUS_SUCCESS) {
        return 0;
      }
      int kept = 0;
      for (int i = 0; i < count; ++i) {
        if (heuristic[i].state == CUBLAS_STATUS_SUCCESS) out[kept++] = heuristic[i].algo;
      }
      return kept;
    };
    const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
    auto launch = [&](const cublasLtMatmulAlgo_t& algo) {
      if (!workspace_.defined()) {
        workspace_ = at::empty({kWorkspaceBytes}, at::TensorOptions().dtype(at::kByte).device(device_));
      }
      const float alpha = 1.0f;
      return cublasLtMatmul(handle, desc.get(), &alpha, g.a, layout_a.get(), g.b, layout_b.get(), &g.beta, g.d,
                            layout_d.get(), g.d, layout_d.get(), &algo, workspace_.data_ptr(), kWorkspaceBytes,
                            stream) == CUBLAS_STATUS_SUCCESS;
    };

    if (tune) {
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      const bool capturing = cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
                             capture != cudaStreamCaptureStatusNone;
      cublasLtMatmulAlgo_t algo = {};
      detail::Sample sample;
      if (!tuned_algo(key, capturing, &algo, &sample, ask)) return false;
      const bool timed = sample.start != nullptr;
      if (timed) cudaEventRecord(sample.start, stream);
      const bool ok = launch(algo);
      if (timed) {
        if (ok) cudaEventRecord(sample.end, stream);
        tuned_launched(key, sample, ok);
      }
      if (ok || sample.candidate == 0) return ok;
      // cuBLASLt refused another candidate (before queuing any work): the heuristic's first instead.
      cublasLtMatmulAlgo_t first = {};
      return tuned_first(key, &first) && launch(first);
    }

    cublasLtMatmulAlgo_t algo = {};
    const bool found = cached_algo(key, &algo, [&](cublasLtMatmulAlgo_t* out) { return ask(out, 1) > 0; });
    return found && launch(algo);
  }

 private:
  c10::ScalarType dtype_;
  c10::Device device_;
  uint32_t required_alignment_;
  at::Tensor workspace_;
};

}  // namespace
}  // namespace apex::lt
