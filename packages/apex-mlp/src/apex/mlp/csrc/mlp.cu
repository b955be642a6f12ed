// The MLP's forward and backward, one op each: y_i = act(y_{i-1} w_i^T + b_i) for every layer.
// The references, and the wording of the checks below, are in apex.mlp's _ops.py.
//
// Each GEMM goes through apex-core's cuBLASLt runner (apex/cublaslt.h: the handle PyTorch keeps for
// the current device, the current stream, a workspace from PyTorch's caching allocator) with its
// epilogue doing what follows it: forward: the bias and relu (CUBLASLT_EPILOGUE_RELU_BIAS; with
// relu_masks, RELU_AUX_BIAS for hidden layers, which also writes the bit mask of y > 0 that the
// backward's DRELU epilogue reads), sigmoid by a small element-wise kernel after the bias epilogue;
// backward: relu's derivative and the previous layer's bias gradient in the input-gradient GEMM
// (CUBLASLT_EPILOGUE_DRELU_BGRAD, reading the mask; off by default, see apex/cublaslt.h),
// otherwise the activation's derivative and the bias gradient in one pass of apex-core's
// apex/bias_grad.cuh over the gradient and the layer's output (relu: y > 0, sigmoid: y (1 - y));
// without an activation, the bias gradient in the weight-gradient GEMM (CUBLASLT_EPILOGUE_BGRADB).
// Where cuBLASLt cannot take a GEMM (a leading dimension or pointer not 16-byte aligned, an empty
// dimension, float64, an epilogue switched off, no algorithm for the epilogue), that GEMM and its
// epilogue go through ATen and small kernels instead: every shape works.
//
// Row-major [rows, cols] is column-major [cols, rows]; so y = x w^T is, in cuBLASLt's terms,
// D (n_out x batch) = op_T(w) (n_out x n_in) * x (n_in x batch).
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <apex/bias_grad.cuh>
#include <apex/checks.h>
#include <apex/cublaslt.h>
#include <apex/dispatch.h>
#include <apex/launch.cuh>
#include <apex/side_stream.h>
#include <apex/vectorized.cuh>

#include "cuda_ops.h"

namespace {

constexpr int64_t kNone = 0;
constexpr int64_t kRelu = 1;
constexpr int64_t kSigmoid = 2;

// Bytes per row of a relu mask: one bit per feature, rows padded to 128 bits (cuBLASLt's rule for
// the leading dimension of a bit-mask auxiliary matrix). Feature f of a row is bit f % 8 of byte f / 8.
int64_t mask_bytes(int64_t features) { return (features + 127) / 128 * 16; }

int64_t mask_count(int64_t activation, int64_t layers) { return activation == kRelu ? layers - 1 : 0; }

// ---------------------------------------------------------------------------------------------
// Checks (the same words as _ops.py)

void check_matrix(const char* op, const std::string& name, const at::Tensor& t, int64_t dim,
                  c10::ScalarType dtype, c10::Device device) {
  namespace checks = apex::checks;
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": ", name, " has dtype ", checks::torch_dtype(t.scalar_type()),
                   "; expected ", checks::torch_dtype(dtype), dtype == at::kByte ? "" : " (the input's)");
  checks::placed(op, name.c_str(), t, device);
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got shape ",
                    checks::shape_string(t.sizes()));
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " is not contiguous");
}

void check_layers(const char* op, const at::Tensor& x, at::TensorList weights, int64_t biases, at::TensorList bias_list) {
  namespace checks = apex::checks;
  const auto dtype = x.scalar_type();
  TORCH_CHECK_TYPE(checks::contains(checks::kFloatDtypes, dtype) || dtype == at::kDouble, op, ": input has dtype ",
                   checks::torch_dtype(dtype), "; expected one of float32, float16, bfloat16, float64");
  check_matrix(op, "input", x, 2, dtype, x.device());
  const auto layers = static_cast<int64_t>(weights.size());
  TORCH_CHECK_VALUE(layers > 0, op, ": weights is empty; an MLP needs at least one layer");
  TORCH_CHECK_VALUE(biases == 0 || biases == layers, op, ": biases has ", biases, " tensors; expected 0 or ", layers,
                    " (one per weight)");
  int64_t features = x.size(1);
  for (int64_t i = 0; i < layers; ++i) {
    const auto name = "weights[" + std::to_string(i) + "]";
    check_matrix(op, name, weights[i], 2, dtype, x.device());
    TORCH_CHECK_VALUE(weights[i].size(1) == features, op, ": ", name, " has shape ",
                      checks::shape_string(weights[i].sizes()), "; expected ", features, " columns (the ",
                      i == 0 ? std::string("input") : "weights[" + std::to_string(i - 1) + "]", "'s features)");
    features = weights[i].size(0);
    if (!bias_list.empty()) {
      const auto bias_name = "biases[" + std::to_string(i) + "]";
      check_matrix(op, bias_name, bias_list[i], 1, dtype, x.device());
      TORCH_CHECK_VALUE(bias_list[i].size(0) == features, op, ": ", bias_name, " has shape ",
                        checks::shape_string(bias_list[i].sizes()), "; expected (", features, ",) (", name,
                        "'s rows)");
    }
  }
}

void check_activation(const char* op, int64_t activation) {
  TORCH_CHECK_VALUE(activation == kNone || activation == kRelu || activation == kSigmoid, op, ": activation is ",
                    activation, "; expected 0 (none), 1 (relu) or 2 (sigmoid)");
}

// ---------------------------------------------------------------------------------------------
// cuBLASLt: apex-core's runner (apex/cublaslt.h). Every GEMM here needs 16-byte aligned pointers
// and leading dimensions, or it goes through ATen; cuBLASLt is told 16 bytes for every operand.

constexpr uint32_t kAlignment = 16;

// ---------------------------------------------------------------------------------------------
// Element-wise kernels: sigmoid in place, and the relu mask where cuBLASLt did not write it.

constexpr int kThreads = 256;
constexpr int kAccessesInFlight = 4;
template <typename T>
constexpr int64_t kPerBlock = int64_t{kThreads} * apex::vector_width<T>() * kAccessesInFlight * 4;

template <typename T>
__global__ void __launch_bounds__(kThreads) sigmoid_kernel(T* y, int64_t n) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kPerBlock<T>;
  const int64_t count = n - begin < kPerBlock<T> ? n - begin : kPerBlock<T>;
  T* block_y = y + begin;
  apex::for_each_element<apex::vector_width<T>(), kAccessesInFlight>(
      count,
      [&](auto group) {
        using Group = decltype(group);
        float v[Group::kCount][Group::kWidth];
        group.load(v, block_y);
        group.for_each_value([&](int i, int j) { v[i][j] = 1.0f / (1.0f + __expf(-v[i][j])); });
        group.store(block_y, v);
      },
      block_y);
}

// The relu mask of y where cuBLASLt did not write it (one thread per mask byte).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    relu_mask_kernel(const T* y, uint8_t* mask, int64_t rows, int64_t features, int64_t row_bytes) {
  const int64_t total = rows * row_bytes;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t row = i / row_bytes;
    const int64_t first = i % row_bytes * 8;
    uint8_t bits = 0;
    for (int k = 0; k < 8 && first + k < features; ++k) {
      if (static_cast<float>(y[row * features + first + k]) > 0.0f) bits |= static_cast<uint8_t>(1u << k);
    }
    mask[i] = bits;
  }
}

void write_relu_mask(const at::Tensor& y, at::Tensor& mask) {
  const int64_t total = mask.numel();
  if (total == 0) return;
  const auto blocks = static_cast<unsigned int>(std::min<int64_t>(apex::ceil_div(total, kThreads), 1 << 16));
  const auto stream = at::cuda::getCurrentCUDAStream();
  auto launch = [&](auto* typed_y) {
    relu_mask_kernel<<<blocks, kThreads, 0, stream>>>(typed_y, mask.mutable_data_ptr<uint8_t>(), y.size(0),
                                                      y.size(1), mask.size(1));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (y.scalar_type() == at::kDouble) {
    launch(y.const_data_ptr<double>());
  } else {
    APEX_DISPATCH_FLOAT_TYPES(y.scalar_type(), "mlp_forward", "input", scalar_t,
                              { launch(y.const_data_ptr<scalar_t>()); });
  }
}

void sigmoid_in_place(at::Tensor& y) {
  const int64_t n = y.numel();
  if (n == 0) return;
  if (y.scalar_type() == at::kDouble) {
    y.sigmoid_();
    return;
  }
  APEX_DISPATCH_FLOAT_TYPES(y.scalar_type(), "mlp_forward", "input", scalar_t, {
    const auto blocks = static_cast<unsigned int>(apex::ceil_div(n, kPerBlock<scalar_t>));
    sigmoid_kernel<scalar_t>
        <<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(y.mutable_data_ptr<scalar_t>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// dz = dy * act'(y) from the activation's output y (relu' = (y > 0), sigmoid' = y (1 - y)), and
// with db defined also the bias gradient db = dz summed over the batch, in one pass (apex-core's
// apex/bias_grad.cuh); no activation: dz is dy, db its column sums. float64 through ATen.
at::Tensor activation_backward(const at::Tensor& dy, const at::Tensor& y, int64_t activation, at::Tensor db) {
  if (y.scalar_type() == at::kDouble) {
    at::Tensor dz = activation == kNone   ? dy
                    : activation == kRelu ? at::where(y > 0, dy, at::zeros({}, dy.options()))
                                          : dy * y * (1 - y);
    if (db.defined()) {
      const int64_t batch_dim[] = {0};
      at::sum_out(db, dz, batch_dim);
    }
    return dz;
  }
  namespace bg = apex::bias_grad;
  if (activation == kNone) {
    if (db.defined()) bg::activation_bias_grad<bg::Act::kIdentity>(dy, dy, at::Tensor(), db);
    return dy;
  }
  at::Tensor dz = at::empty_like(y);
  if (activation == kRelu) {
    bg::activation_bias_grad<bg::Act::kRelu>(dy, y, dz, db);
  } else {
    bg::activation_bias_grad<bg::Act::kSigmoid>(dy, y, dz, db);
  }
  return dz;
}

// ---------------------------------------------------------------------------------------------
// The ops

}  // namespace

namespace apex_mlp {

std::vector<at::Tensor> mlp_forward_cuda(const at::Tensor& input, at::TensorList weights, at::TensorList biases,
                                         int64_t activation, bool relu_masks) {
  constexpr const char* kOp = "mlp_forward";
  check_layers(kOp, input, weights, static_cast<int64_t>(biases.size()), biases);
  check_activation(kOp, activation);
  const c10::cuda::CUDAGuard device_guard(input.device());

  apex::lt::Runner lt(input, kAlignment);
  const int64_t batch = input.size(0);
  const bool bias = !biases.empty();
  const auto layers = static_cast<int64_t>(weights.size());
  // Without relu_masks (the backward will not run DRELU) no mask is allocated or written.
  const int64_t masks = relu_masks ? mask_count(activation, layers) : 0;
  std::vector<at::Tensor> outputs;
  outputs.reserve(layers + masks);
  std::vector<at::Tensor> mask_tensors;
  at::Tensor y = input;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor& w = weights[i];
    const int64_t n_in = w.size(1);
    const int64_t n_out = w.size(0);
    at::Tensor out = at::empty({batch, n_out}, input.options());
    at::Tensor mask;
    apex::lt::Gemm gemm =
        apex::lt::linear_forward(y.const_data_ptr(), w.const_data_ptr(), out.mutable_data_ptr(), batch, n_in, n_out);
    gemm.epilogue = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    if (activation == kRelu) gemm.epilogue = bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
    if (bias) gemm.bias = biases[i].const_data_ptr();
    if (i < masks) {
      // Zeroed: cuBLASLt need not write the padding bits, and an op's outputs must not vary run to run.
      mask = at::zeros({batch, mask_bytes(n_out)}, input.options().dtype(at::kByte));
      gemm.epilogue = bias ? CUBLASLT_EPILOGUE_RELU_AUX_BIAS : CUBLASLT_EPILOGUE_RELU_AUX;
      gemm.aux = mask.mutable_data_ptr();
      gemm.aux_ld = mask_bytes(n_out) * 8;
    }
    if (!lt.run(gemm)) {
      if (bias) {
        at::addmm_out(out, biases[i], y, w.t());
      } else {
        at::mm_out(out, y, w.t());
      }
      if (activation == kRelu) out.relu_();
      if (mask.defined()) write_relu_mask(out, mask);
    }
    if (activation == kSigmoid) sigmoid_in_place(out);
    outputs.push_back(out);
    if (mask.defined()) mask_tensors.push_back(mask);
    y = out;
  }
  outputs.insert(outputs.end(), mask_tensors.begin(), mask_tensors.end());
  return outputs;
}

std::vector<at::Tensor> mlp_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                          at::TensorList weights, at::TensorList outputs, at::TensorList masks,
                                          bool bias, int64_t activation, bool input_grad) {
  constexpr const char* kOp = "mlp_backward";
  namespace checks = apex::checks;
  check_layers(kOp, input, weights, bias ? static_cast<int64_t>(weights.size()) : 0, {});
  check_activation(kOp, activation);
  const auto layers = static_cast<int64_t>(weights.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(outputs.size()) == layers, kOp, ": outputs has ", outputs.size(),
                    " tensors; expected ", layers, " (one per layer)");
  const int64_t batch = input.size(0);
  for (int64_t i = 0; i < layers; ++i) {
    const auto name = "outputs[" + std::to_string(i) + "]";
    check_matrix(kOp, name, outputs[i], 2, input.scalar_type(), input.device());
    TORCH_CHECK_VALUE(outputs[i].size(0) == batch && outputs[i].size(1) == weights[i].size(0), kOp, ": ", name,
                      " has shape ", checks::shape_string(outputs[i].sizes()), "; expected (", batch, ", ",
                      weights[i].size(0), ")");
  }
  const int64_t expected_masks = mask_count(activation, layers);
  TORCH_CHECK_VALUE(masks.empty() || static_cast<int64_t>(masks.size()) == expected_masks, kOp, ": masks has ",
                    masks.size(), " tensors; expected 0 or ", expected_masks, " (one per hidden layer with relu)");
  for (size_t i = 0; i < masks.size(); ++i) {
    const auto name = "masks[" + std::to_string(i) + "]";
    check_matrix(kOp, name, masks[i], 2, at::kByte, input.device());
    const int64_t row_bytes = mask_bytes(weights[i].size(0));
    TORCH_CHECK_VALUE(masks[i].size(0) == batch && masks[i].size(1) == row_bytes, kOp, ": ", name, " has shape ",
                      checks::shape_string(masks[i].sizes()), "; expected (", batch, ", ", row_bytes, ")");
  }
  check_matrix(kOp, "grad_output", grad_output, 2, input.scalar_type(), input.device());
  TORCH_CHECK_VALUE(grad_output.sizes() == outputs[layers - 1].sizes(), kOp, ": grad_output has shape ",
                    checks::shape_string(grad_output.sizes()), "; expected ",
                    checks::shape_string(outputs[layers - 1].sizes()), " (the output's)");
  const c10::cuda::CUDAGuard device_guard(input.device());

  apex::lt::Runner lt(input, kAlignment);
  // The weight gradients on a second stream, beside the input gradients' chain (apex/side_stream.h),
  // unless the largest layer's GEMMs are large enough that two at once contend.
  double largest_macs = 0.0;
  for (const at::Tensor& w : weights) largest_macs = std::max(largest_macs, double(batch) * w.size(0) * w.size(1));
  apex::SideStream side(apex::side_stream_pays(largest_macs));
  apex::lt::Runner lt_side(input, kAlignment);
  std::vector<at::Tensor> grad_weights(layers);
  std::vector<at::Tensor> grad_biases(layers);
  at::Tensor grad = grad_output;
  // Whether `grad` already went through this layer's activation derivative (a DRELU epilogue), and
  // the bias gradient that epilogue computed.
  bool grad_is_dz = false;
  at::Tensor fused_db;
  for (int64_t i = layers - 1; i >= 0; --i) {
    const at::Tensor& w = weights[i];
    const int64_t n_in = w.size(1);
    const int64_t n_out = w.size(0);
    const at::Tensor& y_in = i > 0 ? outputs[i - 1] : input;
    // The bias gradient: from the DRELU epilogue that made grad (grad_is_dz); else in the pass that
    // takes the activation's derivative; with no activation, in the weight-gradient GEMM's BGRADB
    // epilogue where that is on, else by a column sum.
    const bool db_in_gemm = bias && !grad_is_dz && activation == kNone &&
                            apex::lt::epilogue_enabled(CUBLASLT_EPILOGUE_BGRADB);
    at::Tensor db = !bias ? at::Tensor() : grad_is_dz ? fused_db : at::empty({n_out}, w.options());
    const at::Tensor dz =
        grad_is_dz ? grad : activation_backward(grad, outputs[i], activation, db_in_gemm ? at::Tensor() : db);

    // dW (n_out x n_in) = dz^T y_in.
    at::Tensor dw = at::empty_like(w);
    apex::lt::Gemm wgrad = apex::lt::linear_weight_grad(y_in.const_data_ptr(), dz.const_data_ptr(),
                                                        dw.mutable_data_ptr(), batch, n_in, n_out);
    if (db_in_gemm) {
      wgrad.epilogue = CUBLASLT_EPILOGUE_BGRADB;
      wgrad.bias = db.mutable_data_ptr();
    }
    side.run({y_in, dz, dw, db}, [&] {
      if (!lt_side.run(wgrad)) {
        at::mm_out(dw, dz.t(), y_in);
        if (db_in_gemm) activation_backward(dz, dz, kNone, db);
      }
    });
    grad_weights[i] = dw;
    grad_biases[i] = db;

    if (i > 0 || input_grad) {
      // dy_in (batch x n_in) = dz w.
      // With the previous layer's relu mask, its derivative and bias gradient come in the epilogue.
      at::Tensor dy_in = at::empty({batch, n_in}, input.options());
      const bool drelu = i > 0 && !masks.empty();
      at::Tensor next_db = drelu && bias ? at::empty({n_in}, w.options()) : at::Tensor();
      apex::lt::Gemm dgrad = apex::lt::linear_input_grad(dz.const_data_ptr(), w.const_data_ptr(),
                                                         dy_in.mutable_data_ptr(), batch, n_in, n_out);
      if (drelu) {
        dgrad.epilogue = bias ? CUBLASLT_EPILOGUE_DRELU_BGRAD : CUBLASLT_EPILOGUE_DRELU;
        if (bias) dgrad.bias = next_db.mutable_data_ptr();
        dgrad.aux = const_cast<void*>(masks[i - 1].const_data_ptr());  // read only by DRELU
        dgrad.aux_ld = masks[i - 1].size(1) * 8;
      }
      grad_is_dz = drelu && lt.run(dgrad);
      if (!grad_is_dz) {
        apex::lt::Gemm plain = dgrad;
        plain.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
        plain.bias = nullptr;
        plain.aux = nullptr;
        plain.aux_ld = 0;
        if (!lt.run(plain)) at::mm_out(dy_in, dz, w);
      }
      fused_db = next_db;
      grad = dy_in;
    }
  }
  side.join();
  std::vector<at::Tensor> grads;
  grads.reserve(2 * layers + 1);
  if (input_grad) grads.push_back(grad);
  grads.insert(grads.end(), grad_weights.begin(), grad_weights.end());
  if (bias) grads.insert(grads.end(), grad_biases.begin(), grad_biases.end());
  return grads;
}

}  // namespace apex_mlp

