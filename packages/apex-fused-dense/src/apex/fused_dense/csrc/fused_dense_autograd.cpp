// Autograd of linear_forward and linear_gelu_linear_forward on CUDA, in C++ (the AutogradCUDA
// kernels): the formulas apex/fused_dense/_ops.py registers with torch.library (_dense_setup_context
// and _dense_backward, _gelu_setup_context and _gelu_backward), without the host time of a Python
// autograd layer on every eager call. The dispatcher prefers a kernel registered for AutogradCUDA to
// that registration for CUDA tensors; the Python one serves the other devices, and CUDA before this
// library is loaded. Both save the same tensors and call the same backward op with the same
// arguments.
#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace apex_fused_dense {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using LinearForwardSignature = Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&);
using LinearBackwardSignature = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, bool);
using GeluForwardSignature = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                const Tensor&, const Tensor&);
using GeluBackwardSignature = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&);

template <typename Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// One dense layer: out = input @ weight.T (+ bias). Saves the input and the weight.
struct LinearForward : public torch::autograd::Function<LinearForward> {
  static Tensor forward(AutogradContext* ctx, const Tensor& input, const Tensor& weight,
                        const std::optional<Tensor>& bias) {
    static const auto op = op_handle<LinearForwardSignature>("apex_fused_dense::linear_forward");
    Tensor out;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      out = op.call(input, weight, bias);
    }
    ctx->save_for_backward({input, weight});
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return out;
  }

  // One gradient per forward argument: d_input, d_weight, d_bias (undefined without a bias).
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op = op_handle<LinearBackwardSignature>("apex_fused_dense::linear_backward");
    const variable_list saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    auto [d_input, d_weight, d_bias] = op.call(saved[0], saved[1], grad_outputs[0].contiguous(), has_bias);
    return {d_input, d_weight, has_bias ? d_bias : Tensor()};
  }
};

// Dense -> GELU -> dense: (output1, output2, gelu_in); output1 (the GELU's output) and gelu_in (its
// input) are kept for the backward and are not differentiable. No zero-filled gradients are made
// for them (set_materialize_grads(false)): only output2's gradient counts.
struct LinearGeluLinearForward : public torch::autograd::Function<LinearGeluLinearForward> {
  static variable_list forward(AutogradContext* ctx, const Tensor& input, const Tensor& weight1, const Tensor& bias1,
                               const Tensor& weight2, const Tensor& bias2) {
    static const auto op = op_handle<GeluForwardSignature>("apex_fused_dense::linear_gelu_linear_forward");
    Tensor output1, output2, gelu_in;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(output1, output2, gelu_in) = op.call(input, weight1, bias1, weight2, bias2);
    }
    ctx->save_for_backward({input, gelu_in, output1, weight1, weight2});
    ctx->mark_non_differentiable({output1, gelu_in});
    ctx->set_materialize_grads(false);
    return {output1, output2, gelu_in};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op = op_handle<GeluBackwardSignature>("apex_fused_dense::linear_gelu_linear_backward");
    const Tensor& grad = grad_outputs[1];
    if (!grad.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const variable_list saved = ctx->get_saved_variables();
    auto [d_input, d_weight1, d_bias1, d_weight2, d_bias2] =
        op.call(saved[0], saved[1], saved[2], saved[3], saved[4], grad.contiguous());
    return {d_input, d_weight1, d_bias1, d_weight2, d_bias2};
  }
};

Tensor linear_forward_autograd(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias) {
  return LinearForward::apply(input, weight, bias);
}

std::tuple<Tensor, Tensor, Tensor> linear_gelu_linear_forward_autograd(const Tensor& input, const Tensor& weight1,
                                                                       const Tensor& bias1, const Tensor& weight2,
                                                                       const Tensor& bias2) {
  auto outputs = LinearGeluLinearForward::apply(input, weight1, bias1, weight2, bias2);
  return {outputs[0], outputs[1], outputs[2]};
}

}  // namespace
}  // namespace apex_fused_dense

TORCH_LIBRARY_IMPL(apex_fused_dense, AutogradCUDA, m) {
  m.impl("linear_forward", &apex_fused_dense::linear_forward_autograd);
  m.impl("linear_gelu_linear_forward", &apex_fused_dense::linear_gelu_linear_forward_autograd);
}
