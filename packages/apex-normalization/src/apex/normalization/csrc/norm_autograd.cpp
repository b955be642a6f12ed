// Autograd of norm_forward and add_norm_forward on CUDA, in C++ (the AutogradCUDA kernels): the
// formula apex/normalization/_ops.py registers with torch.library (_setup_context, _backward),
// without the host time of a Python autograd layer on every eager call. The dispatcher prefers a
// kernel registered for AutogradCUDA to that registration for CUDA tensors; the Python one serves
// the other devices, torch.compile, and CUDA before this library is loaded. Both save the same
// tensors and call norm_backward with the same arguments.
#include <ATen/core/Tensor.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <c10/core/SymIntArrayRef.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace apex_normalization {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSignature = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const std::optional<Tensor>&,
                                                            const std::optional<Tensor>&, c10::SymIntArrayRef,
                                                            double, bool, bool, std::optional<c10::ScalarType>);
using AddForwardSignature = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const std::optional<Tensor>&, const std::optional<Tensor>&, c10::SymIntArrayRef,
    double, bool, bool, std::optional<c10::ScalarType>);
using BackwardSignature = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                                                             const std::optional<Tensor>&, const Tensor&,
                                                             const Tensor&, c10::SymIntArrayRef, bool, bool,
                                                             c10::ScalarType, bool, const std::optional<Tensor>&);

template <typename Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

bool defined(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

// The index of each optional tensor argument among the forward's differentiable inputs (the
// tensors given), for needs_input_grad; -1 when not given.
void save_edges(AutogradContext* ctx, int64_t first, const std::optional<Tensor>& weight,
                const std::optional<Tensor>& bias) {
  ctx->saved_data["weight_edge"] = defined(weight) ? first : int64_t{-1};
  ctx->saved_data["bias_edge"] = defined(bias) ? first + (defined(weight) ? 1 : 0) : int64_t{-1};
}

// _setup_context of _ops.py.
void save(AutogradContext* ctx, const Tensor& normalized, const Tensor& output, const std::optional<Tensor>& weight,
          const std::optional<Tensor>& bias, const Tensor& mean, const Tensor& rstd, size_t shape_dims, double eps,
          bool rms, bool memory_efficient) {
  ctx->mark_non_differentiable({mean, rstd});
  ctx->set_materialize_grads(false);
  const bool keep_mean = !(rms || memory_efficient);
  ctx->save_for_backward({memory_efficient ? output : normalized, defined(weight) ? *weight : Tensor(),
                          defined(bias) ? *bias : Tensor(), keep_mean ? mean : Tensor(), rstd});
  // normalized_shape is the tail of the saved tensor's shape (symbolic while tracing).
  ctx->saved_data["shape_dims"] = static_cast<int64_t>(shape_dims);
  ctx->saved_data["eps"] = eps;
  ctx->saved_data["rms"] = rms;
  ctx->saved_data["memory_efficient"] = memory_efficient;
  ctx->saved_data["input_dtype"] = static_cast<int64_t>(normalized.scalar_type());
}

bool needs(AutogradContext* ctx, const char* edge) {
  const int64_t index = ctx->saved_data[edge].toInt();
  return index >= 0 && ctx->needs_input_grad(static_cast<size_t>(index));
}

// A backward that records a graph (create_graph=True, double backward): the gradients as
// differentiable ATen ops, with the statistics recomputed from the saved input so that their
// dependence on it is differentiated too (_double_backward_grads and _reference.norm_backward of
// _ops.py). The saved mean and rstd are constants to autograd.
std::tuple<Tensor, Tensor, Tensor> differentiable_grads(AutogradContext* ctx, const Tensor& grad_output,
                                                        const Tensor& grad_residual_out, const Tensor& kept,
                                                        const Tensor& weight, const Tensor& bias, int64_t dims) {
  TORCH_CHECK(!ctx->saved_data["memory_efficient"].toBool(),
              "apex_normalization.norm_forward: double backward (create_graph=True) is not supported with "
              "memory_efficient=True (the input is not saved); use memory_efficient=False");
  const bool rms = ctx->saved_data["rms"].toBool();
  const double eps = ctx->saved_data["eps"].toDouble();
  const auto input_dtype = static_cast<c10::ScalarType>(ctx->saved_data["input_dtype"].toInt());
  const auto compute = kept.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  std::vector<int64_t> rows, lead;
  for (int64_t d = 0; d < kept.dim(); ++d) (d < kept.dim() - dims ? lead : rows).push_back(d);
  const Tensor x = kept.to(compute);
  Tensor centered = x;
  if (!rms) centered = x - x.mean(rows, /*keepdim=*/true);
  const Tensor rstd = (centered.square().mean(rows, /*keepdim=*/true) + eps).rsqrt();
  const Tensor xhat = centered * rstd;
  const Tensor dy = grad_output.to(compute);
  const Tensor wdy = weight.defined() ? dy * weight.to(compute) : dy;
  Tensor inner = wdy - xhat * (wdy * xhat).mean(rows, /*keepdim=*/true);
  if (!rms) inner = inner - wdy.mean(rows, /*keepdim=*/true);
  Tensor grad_input = inner * rstd;
  if (grad_residual_out.defined()) grad_input = grad_input + grad_residual_out.to(compute);
  Tensor grad_weight, grad_bias;
  if (weight.defined() && needs(ctx, "weight_edge")) grad_weight = (dy * xhat).sum(lead).to(weight.scalar_type());
  if (bias.defined() && needs(ctx, "bias_edge")) grad_bias = dy.sum(lead).to(bias.scalar_type());
  return {grad_input.to(input_dtype), grad_weight, grad_bias};
}

// _backward of _ops.py: (grad_input, grad_weight, grad_bias).
std::tuple<Tensor, Tensor, Tensor> grads(AutogradContext* ctx, const Tensor& grad_output,
                                         const Tensor& grad_residual_out) {
  if (!grad_output.defined()) return {grad_residual_out, Tensor(), Tensor()};  // only the sum was used
  const variable_list saved = ctx->get_saved_variables();
  const Tensor& kept = saved[0];
  const Tensor& weight = saved[1];
  const Tensor& bias = saved[2];
  const Tensor& mean = saved[3];
  const Tensor& rstd = saved[4];
  const int64_t dims = ctx->saved_data["shape_dims"].toInt();
  if (at::GradMode::is_enabled()) return differentiable_grads(ctx, grad_output, grad_residual_out, kept, weight, bias, dims);
  const bool weight_grads = weight.defined() && (needs(ctx, "weight_edge") || (bias.defined() && needs(ctx, "bias_edge")));
  static const auto backward = op_handle<BackwardSignature>("apex_normalization::norm_backward");
  auto [grad_input, grad_weight, grad_bias] = backward.call(
      grad_output.contiguous(), kept, weight.defined() ? std::optional<Tensor>(weight) : std::nullopt,
      bias.defined() ? std::optional<Tensor>(bias) : std::nullopt,
      mean.defined() ? mean : at::empty({0}, rstd.options()), rstd, kept.sym_sizes().slice(kept.dim() - dims),
      ctx->saved_data["rms"].toBool(), ctx->saved_data["memory_efficient"].toBool(),
      static_cast<c10::ScalarType>(ctx->saved_data["input_dtype"].toInt()), weight_grads,
      grad_residual_out.defined() ? std::optional<Tensor>(grad_residual_out.contiguous()) : std::nullopt);
  if (!weight_grads) return {grad_input, Tensor(), Tensor()};
  return {grad_input, grad_weight, bias.defined() ? grad_bias : Tensor()};
}

struct NormForward : public torch::autograd::Function<NormForward> {
  static variable_list forward(AutogradContext* ctx, const Tensor& input, const std::optional<Tensor>& weight,
                               const std::optional<Tensor>& bias, c10::SymIntArrayRef normalized_shape, double eps,
                               bool rms, bool memory_efficient, std::optional<c10::ScalarType> output_dtype) {
    static const auto op = op_handle<ForwardSignature>("apex_normalization::norm_forward");
    Tensor out, mean, rstd;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(out, mean, rstd) =
          op.call(input, weight, bias, normalized_shape, eps, rms, memory_efficient, output_dtype);
    }
    save_edges(ctx, 1, weight, bias);
    save(ctx, input, out, weight, bias, mean, rstd, normalized_shape.size(), eps, rms, memory_efficient);
    return {out, mean, rstd};
  }

  // One gradient per forward argument (undefined for the non-tensor ones).
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto [grad_input, grad_weight, grad_bias] = grads(ctx, grad_outputs[0], Tensor());
    return {grad_input, grad_weight, grad_bias, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

struct AddNormForward : public torch::autograd::Function<AddNormForward> {
  static variable_list forward(AutogradContext* ctx, const Tensor& input, const Tensor& residual,
                               const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
                               c10::SymIntArrayRef normalized_shape, double eps, bool rms, bool memory_efficient,
                               std::optional<c10::ScalarType> output_dtype) {
    static const auto op = op_handle<AddForwardSignature>("apex_normalization::add_norm_forward");
    Tensor out, residual_out, mean, rstd;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(out, residual_out, mean, rstd) =
          op.call(input, residual, weight, bias, normalized_shape, eps, rms, memory_efficient, output_dtype);
    }
    save_edges(ctx, 2, weight, bias);
    save(ctx, residual_out, out, weight, bias, mean, rstd, normalized_shape.size(), eps, rms, memory_efficient);
    return {out, residual_out, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto [grad_sum, grad_weight, grad_bias] = grads(ctx, grad_outputs[0], grad_outputs[1]);
    return {ctx->needs_input_grad(0) ? grad_sum : Tensor(),
            ctx->needs_input_grad(1) ? grad_sum : Tensor(),
            grad_weight,
            grad_bias,
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> norm_forward_autograd(const Tensor& input, const std::optional<Tensor>& weight,
                                                         const std::optional<Tensor>& bias,
                                                         c10::SymIntArrayRef normalized_shape, double eps, bool rms,
                                                         bool memory_efficient,
                                                         std::optional<c10::ScalarType> output_dtype) {
  auto outputs =
      NormForward::apply(input, weight, bias, normalized_shape, eps, rms, memory_efficient, output_dtype);
  return {outputs[0], outputs[1], outputs[2]};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> add_norm_forward_autograd(
    const Tensor& input, const Tensor& residual, const std::optional<Tensor>& weight,
    const std::optional<Tensor>& bias, c10::SymIntArrayRef normalized_shape, double eps, bool rms,
    bool memory_efficient, std::optional<c10::ScalarType> output_dtype) {
  auto outputs = AddNormForward::apply(input, residual, weight, bias, normalized_shape, eps, rms, memory_efficient,
                                       output_dtype);
  return {outputs[0], outputs[1], outputs[2], outputs[3]};
}

}  // namespace
}  // namespace apex_normalization

TORCH_LIBRARY_IMPL(apex_normalization, AutogradCUDA, m) {
  m.impl("norm_forward", &apex_normalization::norm_forward_autograd);
  m.impl("add_norm_forward", &apex_normalization::add_norm_forward_autograd);
}
