// apex_fused_dense's CUDA kernels: GEMMs through cuBLASLt with fused epilogues (bias, GELU with
// its pre-activation kept, the GELU gradient, the bias gradient), and the in-place weight-gradient
// accumulation of Megatron's gradient-accumulation fusion. The PyTorch references, and the
// wording of the checks below, are in apex.fused_dense's _ops.py.
//
// Row-major tensors are column-major transposes: out[M, N] = x[M, K] @ w[N, K]^T is, read
// column-major, out^T[N, M] = w^T[N, K] (w is K x N column-major, transposed) times x^T[K, M].
// So every GEMM below is written in cuBLAS's column-major terms with m and n swapped.
//
// Whenever cuBLASLt declines a problem (no algorithm for the alignment, the epilogue, or the
// dtypes; an empty dimension) the op computes the same result with ATen ops instead: the
// fallback is part of the contract, never an error.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/accumulate.h>
#include <cublasLt.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>

#include <apex/checks.h>
#include <apex/cublaslt.h>

namespace {

namespace checks = apex::checks;

// The cuBLASLt workspace, taken from PyTorch's caching allocator on each call (a cached block of
// one size, so no cudaMalloc after the first call). 32 MiB is what NVIDIA recommends for Hopper.
constexpr int64_t kWorkspaceBytes = int64_t{32} << 20;

// ---------------------------------------------------------------- checks (as _ops.py words them)

const std::array<c10::ScalarType, 4> kMatmulDtypes = {c10::ScalarType::Float, c10::ScalarType::Half,
                                                      c10::ScalarType::BFloat16, c10::ScalarType::Double};

std::string torch_dtype(c10::ScalarType dtype) { return "torch." + checks::dtype_name(dtype); }

// The first tensor of an op: a dtype it supports, contiguous, ndim-D.
void check_first(const char* op, const char* name, const at::Tensor& t, c10::ArrayRef<c10::ScalarType> dtypes,
                 bool contiguous = true) {
  TORCH_CHECK_TYPE(checks::contains(dtypes, t.scalar_type()), op, ": ", name, " has dtype ",
                   torch_dtype(t.scalar_type()), "; expected one of ", checks::dtype_names(dtypes));
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided, op, ": ", name, " has layout ", t.layout(),
                    "; only dense (strided) tensors are supported");
  TORCH_CHECK_VALUE(!contiguous || t.is_contiguous(), op, ": ", name, " is not contiguous");
}

// Another tensor of the op: the first's dtype and device, contiguous.
void check_like(const char* op, const char* name, const at::Tensor& t, const char* first_name,
                const at::Tensor& first, bool contiguous = true) {
  TORCH_CHECK_TYPE(t.scalar_type() == first.scalar_type(), op, ": ", name, " has dtype ",
                   torch_dtype(t.scalar_type()), " but ", first_name, " has ", torch_dtype(first.scalar_type()));
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided, op, ": ", name, " has layout ", t.layout(),
                    "; only dense (strided) tensors are supported");
  TORCH_CHECK_VALUE(t.device() == first.device(), op, ": ", name, " is on ", t.device(), ", expected ",
                    first.device());
  TORCH_CHECK_VALUE(!contiguous || t.is_contiguous(), op, ": ", name, " is not contiguous");
}

void check_ndim(const char* op, const char* name, const at::Tensor& t, int64_t ndim) {
  TORCH_CHECK_VALUE(t.dim() == ndim, op, ": ", name, " must be ", ndim, "-D, got shape ",
                    checks::shape_string(t.sizes()));
}

void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim, int64_t expected,
                const char* what) {
  TORCH_CHECK_VALUE(t.size(dim) == expected, op, ": ", name, ".size(", dim, ") is ", t.size(dim), ", expected ",
                    expected, " (", what, ")");
}

// ---------------------------------------------------------------- cuBLASLt

template <typename T, cublasStatus_t (*destroy)(T)>
struct LtDeleter {
  void operator()(T p) const { destroy(p); }
};
using MatmulDesc = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>,
                                   LtDeleter<cublasLtMatmulDesc_t, &cublasLtMatmulDescDestroy>>;
using Layout = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>,
                               LtDeleter<cublasLtMatrixLayout_t, &cublasLtMatrixLayoutDestroy>>;
using Preference = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                                   LtDeleter<cublasLtMatmulPreference_t, &cublasLtMatmulPreferenceDestroy>>;

cudaDataType_t cuda_type(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Half:
      return CUDA_R_16F;
    case c10::ScalarType::BFloat16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_32F;
  }
}

// The largest power of two (up to 256) dividing the address: what the heuristic must assume.
uint32_t alignment(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 1;
  while (a < 256 && address % (2 * a) == 0) a *= 2;
  return a;
}

// Column-major D[m, n] = op(A)[m, k] op(B)[k, n] + beta * D, with an epilogue.
struct Gemm {
  bool transpose_a = false;
  bool transpose_b = false;
  int64_t m = 0, n = 0, k = 0;
  const at::Tensor* a = nullptr;
  int64_t lda = 0;
  const at::Tensor* b = nullptr;
  int64_t ldb = 0;
  at::Tensor* d = nullptr;
  int64_t ldd = 0;
  float beta = 0.0f;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;  // the bias (BIAS, GELU_AUX_BIAS) or where its gradient goes (BGRAD*)
  void* aux = nullptr;         // the GELU input: written by GELU_AUX_BIAS, read by DGELU_BGRAD
  int64_t aux_ld = 0;
};

// Runs the GEMM on the current stream and returns true, or returns false without touching D when
// cuBLASLt has no algorithm for it (the caller then computes it with ATen).
bool run_lt(const Gemm& g) {
  const int64_t int_max = std::numeric_limits<int32_t>::max();
  if (g.m <= 0 || g.n <= 0 || g.k <= 0) return false;
  if (!apex::lt::epilogue_enabled(g.epilogue)) return false;  // APEX_CUBLASLT_DISABLE (benchmarks)
  // cuBLASLt's dimensions and leading dimensions are 64-bit, but keep to the sizes it is
  // documented and tested for; larger problems go through ATen (which splits them as needed).
  if (g.m > int_max || g.n > int_max || g.k > int_max) return false;
  const auto ab_dtype = g.a->scalar_type();
  if (ab_dtype == c10::ScalarType::Double) return false;
  const bool needs_aux = g.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || g.epilogue == CUBLASLT_EPILOGUE_DGELU_BGRAD;
  const bool needs_bias = g.epilogue != CUBLASLT_EPILOGUE_DEFAULT;
  // Epilogue vectors must be 16-byte aligned, the auxiliary matrix's leading dimension a multiple of 8.
  if (needs_bias && alignment(g.bias) < 16) return false;
  if (needs_aux && (alignment(g.aux) < 16 || g.aux_ld % 8 != 0)) return false;

  const cudaDataType_t ab_type = cuda_type(ab_dtype);
  const cudaDataType_t d_type = cuda_type(g.d->scalar_type());
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  if (ab_dtype == c10::ScalarType::Float && at::globalContext().allowTF32CuBLAS()) {
    compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  }

  cublasLtMatmulDesc_t raw_desc = nullptr;
  if (cublasLtMatmulDescCreate(&raw_desc, compute, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return false;
  MatmulDesc desc(raw_desc);
  const cublasOperation_t op_a = g.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = g.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  bool ok = cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)) ==
                CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)) ==
                CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, &g.epilogue,
                                           sizeof(g.epilogue)) == CUBLAS_STATUS_SUCCESS;
  if (ok && needs_bias) {
    ok = cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)) ==
         CUBLAS_STATUS_SUCCESS;
  }
  if (ok && needs_aux) {
    ok = cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux,
                                        sizeof(g.aux)) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &g.aux_ld,
                                        sizeof(g.aux_ld)) == CUBLAS_STATUS_SUCCESS;
  }
  if (!ok) return false;

  auto make_layout = [](cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) -> Layout {
    cublasLtMatrixLayout_t raw = nullptr;
    if (cublasLtMatrixLayoutCreate(&raw, type, rows, cols, ld) != CUBLAS_STATUS_SUCCESS) return Layout();
    return Layout(raw);
  };
  // Stored shapes: op(A) is m x k, so A is k x m when transposed; likewise B.
  Layout layout_a = make_layout(ab_type, g.transpose_a ? g.k : g.m, g.transpose_a ? g.m : g.k, g.lda);
  Layout layout_b = make_layout(ab_type, g.transpose_b ? g.n : g.k, g.transpose_b ? g.k : g.n, g.ldb);
  Layout layout_d = make_layout(d_type, g.m, g.n, g.ldd);
  if (!layout_a || !layout_b || !layout_d) return false;

  cublasLtMatmulPreference_t raw_pref = nullptr;
  if (cublasLtMatmulPreferenceCreate(&raw_pref) != CUBLAS_STATUS_SUCCESS) return false;
  Preference pref(raw_pref);
  const uint64_t workspace_bytes = kWorkspaceBytes;
  const uint32_t align_a = alignment(g.a->const_data_ptr());
  const uint32_t align_b = alignment(g.b->const_data_ptr());
  const uint32_t align_d = alignment(g.d->const_data_ptr());
  ok = cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                            sizeof(workspace_bytes)) == CUBLAS_STATUS_SUCCESS &&
       cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                            sizeof(align_a)) == CUBLAS_STATUS_SUCCESS &&
       cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                            sizeof(align_b)) == CUBLAS_STATUS_SUCCESS &&
       cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d,
                                            sizeof(align_d)) == CUBLAS_STATUS_SUCCESS &&
       cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                                            sizeof(align_d)) == CUBLAS_STATUS_SUCCESS;
  if (!ok) return false;

  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const apex::lt::AlgoKey key = {g.transpose_a,      g.transpose_b, g.m,       g.n,       g.k,
                                 g.lda,              g.ldb,         g.ldd,     g.epilogue, ab_type,
                                 d_type,             compute,       align_a,   align_b,   align_d,
                                 g.aux_ld,           g.beta != 0.0f, kWorkspaceBytes, g.d->get_device(), 0};
  cublasLtMatmulAlgo_t algo = {};
  const bool found = apex::lt::cached_algo(key, &algo, [&](cublasLtMatmulAlgo_t* out) {
    cublasLtMatmulHeuristicResult_t heuristic = {};
    int count = 0;
    if (cublasLtMatmulAlgoGetHeuristic(handle, desc.get(), layout_a.get(), layout_b.get(), layout_d.get(),
                                       layout_d.get(), pref.get(), 1, &heuristic, &count) != CUBLAS_STATUS_SUCCESS ||
        count == 0) {
      return false;
    }
    *out = heuristic.algo;
    return true;
  });
  if (!found) return false;
  at::Tensor workspace = at::empty({kWorkspaceBytes}, g.d->options().dtype(at::kByte));
  const float alpha = 1.0f;
  const cublasStatus_t status =
      cublasLtMatmul(handle, desc.get(), &alpha, g.a->const_data_ptr(), layout_a.get(), g.b->const_data_ptr(),
                     layout_b.get(), &g.beta, g.d->data_ptr(), layout_d.get(), g.d->data_ptr(), layout_d.get(),
                     &algo, workspace.data_ptr(), kWorkspaceBytes, at::cuda::getCurrentCUDAStream());
  // Argument errors are reported before anything is launched, so D is untouched on failure.
  return status == CUBLAS_STATUS_SUCCESS;
}

// ---------------------------------------------------------------- the GEMMs of a dense layer

// out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]).
at::Tensor dense_forward(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  Gemm g;
  g.transpose_a = true;
  g.m = n, g.n = m, g.k = k;
  g.a = &w, g.lda = k;
  g.b = &x, g.ldb = k;
  g.d = &out, g.ldd = n;
  if (bias) {
    g.epilogue = CUBLASLT_EPILOGUE_BIAS;
    g.bias = bias->const_data_ptr();
  }
  if (run_lt(g)) return out;
  return bias ? at::addmm(*bias, x, w.t()) : at::mm(x, w.t());
}

// d_x[M, K] = d_out[M, N] @ w[N, K].
at::Tensor input_grad(const at::Tensor& d_out, const at::Tensor& w) {
  const int64_t m = d_out.size(0), n = d_out.size(1), k = w.size(1);
  at::Tensor d_x = at::empty({m, k}, d_out.options());
  Gemm g;
  g.m = k, g.n = m, g.k = n;
  g.a = &w, g.lda = k;
  g.b = &d_out, g.ldb = n;
  g.d = &d_x, g.ldd = k;
  if (run_lt(g)) return d_x;
  return at::mm(d_out, w);
}

// d_w[N, K] (+)= d_out[M, N]^T @ x[M, K]; with d_bias defined, also d_bias[N] = d_out summed over M,
// in the GEMM's epilogue when cuBLASLt has it. beta = 1 accumulates into d_w (of its own dtype).
void weight_grad(const at::Tensor& x, const at::Tensor& d_out, at::Tensor& d_w, at::Tensor* d_bias, float beta) {
  const int64_t m = x.size(0), k = x.size(1), n = d_out.size(1);
  Gemm g;
  g.transpose_b = true;
  g.m = k, g.n = n, g.k = m;
  g.a = &x, g.lda = k;
  g.b = &d_out, g.ldb = n;
  g.d = &d_w, g.ldd = k;
  g.beta = beta;
  if (d_bias != nullptr) {
    g.epilogue = CUBLASLT_EPILOGUE_BGRADB;
    g.bias = d_bias->data_ptr();
    if (run_lt(g)) return;
    g.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    g.bias = nullptr;
    if (m > 0) {
      at::sum_out(*d_bias, d_out, {0});
    } else {
      d_bias->zero_();
    }
  }
  if (run_lt(g)) return;
  if (beta == 0.0f) {
    d_w.copy_(at::mm(d_out.t(), x));
  } else if (d_w.scalar_type() == x.scalar_type()) {
    d_w.addmm_(d_out.t(), x);
  } else {  // a 16-bit GEMM into a float32 accumulator: compute the product in float32
    d_w.addmm_(d_out.t().to(d_w.scalar_type()), x.to(d_w.scalar_type()));
  }
}

// ---------------------------------------------------------------- the ops

void check_linear(const char* op, const at::Tensor& input, const at::Tensor& weight) {
  check_first(op, "input", input, kMatmulDtypes);
  check_like(op, "weight", weight, "input", input);
  check_ndim(op, "input", input, 2);
  check_ndim(op, "weight", weight, 2);
  check_size(op, "weight", weight, 1, input.size(1), "input.size(1)");
}

void check_bias(const char* op, const char* name, const at::Tensor& bias, const at::Tensor& input,
                const at::Tensor& weight) {
  check_like(op, name, bias, "input", input);
  check_ndim(op, name, bias, 1);
  check_size(op, name, bias, 0, weight.size(0), "out features");
}

at::Tensor linear_forward_cuda(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias) {
  constexpr const char* kOp = "linear_forward";
  check_linear(kOp, input, weight);
  if (bias) check_bias(kOp, "bias", *bias, input, weight);
  const c10::cuda::CUDAGuard device_guard(input.device());
  return dense_forward(input, weight, bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward_cuda(const at::Tensor& input,
                                                                    const at::Tensor& weight,
                                                                    const at::Tensor& grad_output, bool bias_grad) {
  constexpr const char* kOp = "linear_backward";
  check_linear(kOp, input, weight);
  check_like(kOp, "grad_output", grad_output, "input", input);
  check_ndim(kOp, "grad_output", grad_output, 2);
  check_size(kOp, "grad_output", grad_output, 0, input.size(0), "input.size(0)");
  check_size(kOp, "grad_output", grad_output, 1, weight.size(0), "weight.size(0)");
  const c10::cuda::CUDAGuard device_guard(input.device());
  at::Tensor d_input = input_grad(grad_output, weight);
  at::Tensor d_weight = at::empty_like(weight);
  at::Tensor d_bias = at::empty({bias_grad ? weight.size(0) : 0}, weight.options());
  weight_grad(input, grad_output, d_weight, bias_grad ? &d_bias : nullptr, 0.0f);
  return {d_input, d_weight, d_bias};
}

void check_gelu_layers(const char* op, const at::Tensor& input, const at::Tensor& weight1, const at::Tensor& weight2) {
  check_linear(op, input, weight1);
  check_like(op, "weight2", weight2, "input", input);
  check_ndim(op, "weight2", weight2, 2);
  check_size(op, "weight2", weight2, 1, weight1.size(0), "weight1.size(0)");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_gelu_linear_forward_cuda(const at::Tensor& input,
                                                                               const at::Tensor& weight1,
                                                                               const at::Tensor& bias1,
                                                                               const at::Tensor& weight2,
                                                                               const at::Tensor& bias2) {
  constexpr const char* kOp = "linear_gelu_linear_forward";
  check_gelu_layers(kOp, input, weight1, weight2);
  check_bias(kOp, "bias1", bias1, input, weight1);
  check_bias(kOp, "bias2", bias2, input, weight2);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const int64_t m = input.size(0), k = input.size(1), h = weight1.size(0);
  at::Tensor output1 = at::empty({m, h}, input.options());
  at::Tensor gelu_in = at::empty({m, h}, input.options());
  Gemm g;
  g.transpose_a = true;
  g.m = h, g.n = m, g.k = k;
  g.a = &weight1, g.lda = k;
  g.b = &input, g.ldb = k;
  g.d = &output1, g.ldd = h;
  g.epilogue = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  g.bias = bias1.const_data_ptr();
  g.aux = gelu_in.data_ptr();
  g.aux_ld = h;
  if (!run_lt(g)) {
    gelu_in = at::addmm(bias1, input, weight1.t());
    output1 = at::gelu(gelu_in, "tanh");
  }
  at::Tensor output2 = dense_forward(output1, weight2, bias2);
  return {output1, output2, gelu_in};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_gelu_linear_backward_cuda(
    const at::Tensor& input, const at::Tensor& gelu_in, const at::Tensor& output1, const at::Tensor& weight1,
    const at::Tensor& weight2, const at::Tensor& grad_output) {
  constexpr const char* kOp = "linear_gelu_linear_backward";
  check_gelu_layers(kOp, input, weight1, weight2);
  const int64_t m = input.size(0), h = weight1.size(0), n = weight2.size(0);
  auto check_hidden = [&](const char* name, const at::Tensor& t) {
    check_like(kOp, name, t, "input", input);
    check_ndim(kOp, name, t, 2);
    check_size(kOp, name, t, 0, m, "input.size(0)");
    check_size(kOp, name, t, 1, h, "weight1.size(0)");
  };
  check_hidden("gelu_in", gelu_in);
  check_hidden("output1", output1);
  check_like(kOp, "grad_output", grad_output, "input", input);
  check_ndim(kOp, "grad_output", grad_output, 2);
  check_size(kOp, "grad_output", grad_output, 0, m, "input.size(0)");
  check_size(kOp, "grad_output", grad_output, 1, n, "weight2.size(0)");
  const c10::cuda::CUDAGuard device_guard(input.device());

  at::Tensor d_weight2 = at::empty_like(weight2);
  at::Tensor d_bias2 = at::empty({n}, weight2.options());
  weight_grad(output1, grad_output, d_weight2, &d_bias2, 0.0f);

  // The pre-activation's gradient: (grad_output @ weight2) * gelu'(gelu_in), and its column sums
  // (bias1's gradient), in one GEMM's epilogue.
  at::Tensor d_gelu_in = at::empty({m, h}, input.options());
  at::Tensor d_bias1 = at::empty({h}, weight1.options());
  Gemm g;
  g.m = h, g.n = m, g.k = n;
  g.a = &weight2, g.lda = h;
  g.b = &grad_output, g.ldb = n;
  g.d = &d_gelu_in, g.ldd = h;
  g.epilogue = CUBLASLT_EPILOGUE_DGELU_BGRAD;
  g.bias = d_bias1.data_ptr();
  g.aux = const_cast<void*>(gelu_in.const_data_ptr());  // read only by DGELU
  g.aux_ld = h;
  if (!run_lt(g)) {
    d_gelu_in = at::gelu_backward(input_grad(grad_output, weight2), gelu_in, "tanh");
    if (m > 0) {
      at::sum_out(d_bias1, d_gelu_in, {0});
    } else {
      d_bias1.zero_();
    }
  }
  at::Tensor d_weight1 = at::empty_like(weight1);
  weight_grad(input, d_gelu_in, d_weight1, nullptr, 0.0f);
  at::Tensor d_input = input_grad(d_gelu_in, weight1);
  return {d_input, d_weight1, d_bias1, d_weight2, d_bias2};
}

// Megatron's tensors may be [s, b, h]: the leading dimensions are the GEMM's reduction dimension.
at::Tensor as_rows(const at::Tensor& t) {
  at::Tensor rows = t.reshape({-1, t.size(-1)});
  return rows.is_contiguous() ? rows : rows.contiguous();
}

const std::array<c10::ScalarType, 2> k16BitDtypes = {c10::ScalarType::Half, c10::ScalarType::BFloat16};

void wgrad_gemm_accum(const char* op, const at::Tensor& input, const at::Tensor& d_output,
                      const at::Tensor& main_grad, bool fp32_accumulator) {
  if (fp32_accumulator) {
    check_first(op, "input", input, checks::kFloatDtypes, false);
  } else {
    check_first(op, "input", input, k16BitDtypes, false);
  }
  check_like(op, "d_output", d_output, "input", input, false);
  TORCH_CHECK_VALUE(input.dim() >= 2, op, ": input must have at least 2 dimensions, got shape ",
                    checks::shape_string(input.sizes()));
  TORCH_CHECK_VALUE(d_output.dim() >= 2, op, ": d_output must have at least 2 dimensions, got shape ",
                    checks::shape_string(d_output.sizes()));
  const int64_t rows = c10::multiply_integers(input.sizes().slice(0, input.dim() - 1));
  const int64_t d_rows = c10::multiply_integers(d_output.sizes().slice(0, d_output.dim() - 1));
  TORCH_CHECK_VALUE(rows == d_rows, op, ": d_output has shape ", checks::shape_string(d_output.sizes()),
                    " and input has ", checks::shape_string(input.sizes()),
                    "; their leading dimensions must hold as many rows");
  if (fp32_accumulator) {
    TORCH_CHECK_TYPE(main_grad.scalar_type() == c10::ScalarType::Float, op, ": main_grad has dtype ",
                     torch_dtype(main_grad.scalar_type()), "; expected torch.float32");
  } else {
    TORCH_CHECK_TYPE(main_grad.scalar_type() == input.scalar_type(), op, ": main_grad has dtype ",
                     torch_dtype(main_grad.scalar_type()), " but input has ", torch_dtype(input.scalar_type()));
  }
  TORCH_CHECK_VALUE(main_grad.layout() == c10::kStrided, op, ": main_grad has layout ", main_grad.layout(),
                    "; only dense (strided) tensors are supported");
  TORCH_CHECK_VALUE(main_grad.device() == input.device(), op, ": main_grad is on ", main_grad.device(),
                    ", expected ", input.device());
  TORCH_CHECK_VALUE(main_grad.is_contiguous(), op, ": main_grad is not contiguous");
  TORCH_CHECK_VALUE(main_grad.dim() == 2 && main_grad.size(0) == d_output.size(-1) &&
                        main_grad.size(1) == input.size(-1),
                    op, ": main_grad has shape ", checks::shape_string(main_grad.sizes()), ", expected (",
                    d_output.size(-1), ", ", input.size(-1), ") (d_output.size(-1), input.size(-1))");
  const c10::cuda::CUDAGuard device_guard(input.device());
  if (main_grad.numel() == 0 || rows == 0) return;
  at::Tensor accumulator = main_grad;  // the same tensor: written in place
  weight_grad(as_rows(input), as_rows(d_output), accumulator, nullptr, 1.0f);
}

void wgrad_gemm_accum_fp32_cuda(const at::Tensor& input, const at::Tensor& d_output, const at::Tensor& main_grad) {
  wgrad_gemm_accum("wgrad_gemm_accum_fp32", input, d_output, main_grad, true);
}

void wgrad_gemm_accum_fp16_cuda(const at::Tensor& input, const at::Tensor& d_output, const at::Tensor& main_grad) {
  wgrad_gemm_accum("wgrad_gemm_accum_fp16", input, d_output, main_grad, false);
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_fused_dense, CUDA, m) {
  m.impl("linear_forward", &linear_forward_cuda);
  m.impl("linear_backward", &linear_backward_cuda);
  m.impl("linear_gelu_linear_forward", &linear_gelu_linear_forward_cuda);
  m.impl("linear_gelu_linear_backward", &linear_gelu_linear_backward_cuda);
  m.impl("wgrad_gemm_accum_fp32", &wgrad_gemm_accum_fp32_cuda);
  m.impl("wgrad_gemm_accum_fp16", &wgrad_gemm_accum_fp16_cuda);
}
