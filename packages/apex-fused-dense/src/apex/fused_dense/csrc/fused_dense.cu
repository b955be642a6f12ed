// apex_fused_dense's CUDA kernels: GEMMs through cuBLASLt with fused epilogues (bias, GELU with
// its pre-activation kept, the GELU gradient, the bias gradient), and the in-place weight-gradient
// accumulation of Megatron's gradient-accumulation fusion. The PyTorch references, and the
// wording of the checks below, are in apex.fused_dense's _ops.py.
//
// Row-major tensors are column-major transposes: out[M, N] = x[M, K] @ w[N, K]^T is, read
// column-major, out^T[N, M] = w^T[N, K] (w is K x N column-major, transposed) times x^T[K, M].
// So every GEMM below is written in cuBLAS's column-major terms with m and n swapped.
//
// Every GEMM goes through apex-core's cuBLASLt runner (apex/cublaslt.h), which tells cuBLASLt each
// pointer's own alignment. Whenever cuBLASLt declines a problem (no algorithm for the alignment,
// the epilogue, or the dtypes; an empty dimension; an epilogue switched off) the op computes the
// same result with ATen ops and apex-core's activation and bias-gradient pass (apex/bias_grad.cuh)
// instead: the fallback is part of the contract, never an error.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include <apex/bias_grad.cuh>
#include <apex/checks.h>
#include <apex/cublaslt.h>
#include <apex/side_stream.h>

#include "cuda_ops.h"

namespace {

namespace checks = apex::checks;

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

// ---------------------------------------------------------------- the GEMMs of a dense layer

// d_bias[N] = d_out[M, N] summed over M (apex-core's column sum; float64 through ATen).
void bias_grad(const at::Tensor& d_out, at::Tensor& d_bias) {
  if (d_out.scalar_type() == c10::ScalarType::Double) {
    if (d_out.size(0) > 0) {
      at::sum_out(d_bias, d_out, {0});
    } else {
      d_bias.zero_();
    }
    return;
  }
  apex::bias_grad::activation_bias_grad<apex::bias_grad::Act::kIdentity>(d_out, d_out, at::Tensor(), d_bias);
}

// out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]).
at::Tensor dense_forward(apex::lt::Runner& lt, const at::Tensor& x, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  apex::lt::Gemm g = apex::lt::linear_forward(x.const_data_ptr(), w.const_data_ptr(), out.data_ptr(), m, k, n);
  if (bias) {
    g.epilogue = CUBLASLT_EPILOGUE_BIAS;
    g.bias = bias->const_data_ptr();
  }
  if (lt.run(g)) return out;
  return bias ? at::addmm(*bias, x, w.t()) : at::mm(x, w.t());
}

// d_x[M, K] = d_out[M, N] @ w[N, K].
at::Tensor input_grad(apex::lt::Runner& lt, const at::Tensor& d_out, const at::Tensor& w) {
  const int64_t m = d_out.size(0), n = d_out.size(1), k = w.size(1);
  at::Tensor d_x = at::empty({m, k}, d_out.options());
  const apex::lt::Gemm g =
      apex::lt::linear_input_grad(d_out.const_data_ptr(), w.const_data_ptr(), d_x.data_ptr(), m, k, n);
  if (lt.run(g)) return d_x;
  return at::mm(d_out, w);
}

// d_w[N, K] (+)= d_out[M, N]^T @ x[M, K]; with d_bias defined, also d_bias[N] = d_out summed over M,
// in the GEMM's epilogue when cuBLASLt has it. beta = 1 accumulates into d_w (of its own dtype).
// (d_w may be of another dtype than x: a float32 accumulator of 16-bit products.)
void weight_grad(apex::lt::Runner& lt, const at::Tensor& x, const at::Tensor& d_out, at::Tensor& d_w,
                 at::Tensor* d_bias, float beta) {
  const int64_t m = x.size(0), k = x.size(1), n = d_out.size(1);
  apex::lt::Gemm g = apex::lt::linear_weight_grad(x.const_data_ptr(), d_out.const_data_ptr(), d_w.data_ptr(), m, k, n);
  g.d_dtype = d_w.scalar_type();
  g.beta = beta;
  if (d_bias != nullptr) {
    g.epilogue = CUBLASLT_EPILOGUE_BGRADB;
    g.bias = d_bias->data_ptr();
    if (lt.run(g)) return;
    g.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    g.bias = nullptr;
    bias_grad(d_out, *d_bias);
  }
  if (lt.run(g)) return;
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

}  // namespace

namespace apex_fused_dense {

at::Tensor linear_forward_cuda(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias) {
  constexpr const char* kOp = "linear_forward";
  check_linear(kOp, input, weight);
  if (bias) check_bias(kOp, "bias", *bias, input, weight);
  const c10::cuda::CUDAGuard device_guard(input.device());
  apex::lt::Runner lt(input);
  return dense_forward(lt, input, weight, bias);
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
  // The weight's (and bias's) gradient on a second stream beside the input's (apex/side_stream.h),
  // unless the GEMMs are large enough that two at once contend.
  apex::SideStream side(apex::side_stream_pays(double(input.size(0)) * input.size(1) * weight.size(0)));
  apex::lt::Runner lt_side(input);
  at::Tensor d_weight = at::empty_like(weight);
  at::Tensor d_bias = at::empty({bias_grad ? weight.size(0) : 0}, weight.options());
  side.run({input, grad_output, d_weight, d_bias}, [&] {
    weight_grad(lt_side, input, grad_output, d_weight, bias_grad ? &d_bias : nullptr, 0.0f);
  });
  apex::lt::Runner lt(input);
  at::Tensor d_input = input_grad(lt, grad_output, weight);
  side.join();
  return {d_input, d_weight, d_bias};
}

}  // namespace apex_fused_dense

namespace {

void check_gelu_layers(const char* op, const at::Tensor& input, const at::Tensor& weight1, const at::Tensor& weight2) {
  check_linear(op, input, weight1);
  check_like(op, "weight2", weight2, "input", input);
  check_ndim(op, "weight2", weight2, 2);
  check_size(op, "weight2", weight2, 1, weight1.size(0), "weight1.size(0)");
}

}  // namespace

namespace apex_fused_dense {

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
  apex::lt::Runner lt(input);
  const int64_t m = input.size(0), k = input.size(1), h = weight1.size(0);
  at::Tensor output1 = at::empty({m, h}, input.options());
  at::Tensor gelu_in = at::empty({m, h}, input.options());
  apex::lt::Gemm g =
      apex::lt::linear_forward(input.const_data_ptr(), weight1.const_data_ptr(), output1.data_ptr(), m, k, h);
  g.epilogue = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  g.bias = bias1.const_data_ptr();
  g.aux = gelu_in.data_ptr();
  g.aux_ld = h;
  if (!lt.run(g)) {
    gelu_in = at::addmm(bias1, input, weight1.t());
    output1 = at::gelu(gelu_in, "tanh");
  }
  at::Tensor output2 = dense_forward(lt, output1, weight2, bias2);
  return {output1, output2, gelu_in};
}

}  // namespace apex_fused_dense

namespace {

// The widest second layer (out_features) for which the backward asks cuBLASLt for the DGELU epilogue.
constexpr int64_t kDGeluEpilogueMaxWidth = 1024;

}  // namespace

namespace apex_fused_dense {

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
  apex::lt::Runner lt(input);
  // The weights' (and bias2's) gradients on a second stream beside the input gradient's chain
  // (apex/side_stream.h): the second layer's beside the pre-activation's gradient, the first's
  // beside the input's.
  apex::SideStream side(apex::side_stream_pays(double(m) * h * std::max(input.size(1), n)));
  apex::lt::Runner lt_side(input);

  at::Tensor d_weight2 = at::empty_like(weight2);
  at::Tensor d_bias2 = at::empty({n}, weight2.options());
  side.run({output1, grad_output, d_weight2, d_bias2},
           [&] { weight_grad(lt_side, output1, grad_output, d_weight2, &d_bias2, 0.0f); });

  // The pre-activation's gradient: (grad_output @ weight2) * gelu'(gelu_in), and its column sums
  // (bias1's gradient): in one GEMM's epilogue where DGELU_BGRAD is on (off by default, see
  // apex/cublaslt.h); else the GEMM, then GELU's gradient and bias1's in one pass over its output,
  // written in place (apex-core's apex/bias_grad.cuh).
  at::Tensor d_gelu_in;
  at::Tensor d_bias1 = at::empty({h}, weight1.options());
  // (grad_output @ weight2) with a DGELU epilogue reading the pre-activation (and writing bias1's
  // gradient where bias is given).
  auto dgelu_gemm = [&](cublasLtEpilogue_t epilogue, void* bias) {
    d_gelu_in = at::empty({m, h}, input.options());
    apex::lt::Gemm g = apex::lt::linear_input_grad(grad_output.const_data_ptr(), weight2.const_data_ptr(),
                                                   d_gelu_in.data_ptr(), m, h, n);
    g.epilogue = epilogue;
    g.bias = bias;
    g.aux = const_cast<void*>(gelu_in.const_data_ptr());  // read only by DGELU
    g.aux_ld = h;
    return lt.run(g);
  };
  bool fused = false;
  if (apex::lt::epilogue_enabled(CUBLASLT_EPILOGUE_DGELU_BGRAD)) {
    fused = dgelu_gemm(CUBLASLT_EPILOGUE_DGELU_BGRAD, d_bias1.data_ptr());
  }
  // Or DGELU alone (off by default: APEX_CUBLASLT_ENABLE=dgelu_only), then only a column sum for
  // bias1, where the GEMM's reduction (the second layer's width n) is short next to the pass over
  // [m, h] it saves. cuBLASLt runs it as a slower GEMM kernel than the plain one; H100, bf16, forward
  // and backward on against off (2026-12-06): m x n x h 16384x768x3072 -0.5 to -1.5%, 16384x1024x4096
  // -2.6%, 8192x1024x4096 0%, 8192x512x2048 +32%.
  if (!fused && n <= kDGeluEpilogueMaxWidth && apex::lt::epilogue_enabled(CUBLASLT_EPILOGUE_DGELU)) {
    fused = dgelu_gemm(CUBLASLT_EPILOGUE_DGELU, nullptr);
    if (fused) bias_grad(d_gelu_in, d_bias1);
  }
  if (!fused) {
    d_gelu_in = input_grad(lt, grad_output, weight2);
    if (d_gelu_in.scalar_type() == c10::ScalarType::Double) {
      d_gelu_in = at::gelu_backward(d_gelu_in, gelu_in, "tanh");
      bias_grad(d_gelu_in, d_bias1);
    } else {
      apex::bias_grad::activation_bias_grad<apex::bias_grad::Act::kGeluTanh>(d_gelu_in, gelu_in, d_gelu_in, d_bias1);
    }
  }
  at::Tensor d_weight1 = at::empty_like(weight1);
  side.run({input, d_gelu_in, d_weight1}, [&] { weight_grad(lt_side, input, d_gelu_in, d_weight1, nullptr, 0.0f); });
  at::Tensor d_input = input_grad(lt, d_gelu_in, weight1);
  side.join();
  return {d_input, d_weight1, d_bias1, d_weight2, d_bias2};
}

}  // namespace apex_fused_dense

namespace {

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
  apex::lt::Runner lt(input);
  weight_grad(lt, as_rows(input), as_rows(d_output), accumulator, nullptr, 1.0f);
}

}  // namespace

namespace apex_fused_dense {

void wgrad_gemm_accum_fp32_cuda(const at::Tensor& input, const at::Tensor& d_output, const at::Tensor& main_grad) {
  wgrad_gemm_accum("wgrad_gemm_accum_fp32", input, d_output, main_grad, true);
}

void wgrad_gemm_accum_fp16_cuda(const at::Tensor& input, const at::Tensor& d_output, const at::Tensor& main_grad) {
  wgrad_gemm_accum("wgrad_gemm_accum_fp16", input, d_output, main_grad, false);
}

}  // namespace apex_fused_dense

