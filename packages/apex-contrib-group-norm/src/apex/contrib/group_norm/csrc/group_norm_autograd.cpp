// Autograd of group_norm_forward on CUDA, in C++ (the AutogradCUDA kernel): the formula
// apex/contrib/group_norm/_ops.py registers with torch.library (_setup_context, _backward), without
// the host time of a Python autograd layer on every eager call (tens of microseconds, as much as
// the kernels take at Stable Diffusion's sizes). The dispatcher prefers this kernel for CUDA tensors
// once the library is loaded; the Python one serves the other devices and CUDA before the library
// loads. Both save the same tensors and call group_norm_backward with the same arguments.
#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace apex_contrib_group_norm {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSignature = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const std::optional<Tensor>&,
                                                            const std::optional<Tensor>&, int64_t, double,
                                                            c10::string_view);
using BackwardSignature = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&,
                                                             const std::optional<Tensor>&,
                                                             const std::optional<Tensor>&, const Tensor&,
                                                             const Tensor&, int64_t, c10::string_view);

template <typename Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

bool defined(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

std::optional<Tensor> optional(const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; }

bool is_silu(const std::string& act) { return act == "silu" || act == "swish"; }

// A backward that records a graph (create_graph=True): _reference.backward as differentiable ATen
// ops, with mean and rstd recomputed from x (_reference.statistics) so that their dependence on x
// is differentiated too.
std::tuple<Tensor, Tensor, Tensor> differentiable_grads(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                                        const Tensor& bias, int64_t groups, double eps, bool silu) {
  const int64_t n = x.size(0);
  const int64_t c = x.size(-1);
  const int64_t hw = n * c == 0 ? 0 : x.numel() / (n * c);
  const Tensor xg = x.to(at::kFloat).reshape({n, hw, groups, c / groups});
  const Tensor centered = xg - xg.mean(at::IntArrayRef{1, 3}, /*keepdim=*/true);
  const Tensor rstd = (centered.square().mean(at::IntArrayRef{1, 3}, /*keepdim=*/true) + eps).rsqrt();
  const Tensor xhat = (centered * rstd).reshape({n, hw, c});
  Tensor g = dy.to(at::kFloat).reshape({n, hw, c});
  if (silu) {
    Tensor z = weight.defined() ? xhat * weight.to(at::kFloat) : xhat;
    if (bias.defined()) z = z + bias.to(at::kFloat);
    const Tensor s = at::sigmoid(z);
    g = g * (s * (1 + z * (1 - s)));
  }
  Tensor dweight, dbias;
  if (weight.defined()) dweight = (g * xhat).sum(at::IntArrayRef{0, 1}).to(weight.scalar_type());
  if (bias.defined()) dbias = g.sum(at::IntArrayRef{0, 1}).to(bias.scalar_type());
  const Tensor gw = (weight.defined() ? g * weight.to(at::kFloat) : g).reshape({n, hw, groups, c / groups});
  const Tensor xhat_g = xhat.reshape({n, hw, groups, c / groups});
  const Tensor dx = rstd * (gw - gw.mean(at::IntArrayRef{1, 3}, true) - xhat_g * (gw * xhat_g).mean(at::IntArrayRef{1, 3}, true));
  return {dx.reshape(x.sizes()).to(x.scalar_type()), dweight, dbias};
}

struct GroupNormForward : public torch::autograd::Function<GroupNormForward> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& weight,
                               const std::optional<Tensor>& bias, int64_t num_groups, double eps,
                               c10::string_view act) {
    static const auto op = op_handle<ForwardSignature>("apex_contrib_group_norm::group_norm_forward");
    Tensor y, mean, rstd;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(y, mean, rstd) = op.call(x, weight, bias, num_groups, eps, act);
    }
    ctx->mark_non_differentiable({mean, rstd});
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x, defined(weight) ? *weight : Tensor(), defined(bias) ? *bias : Tensor(), mean, rstd});
    // needs_input_grad counts the tensors given: x, then weight and bias where present
    ctx->saved_data["weight_edge"] = defined(weight) ? int64_t{1} : int64_t{-1};
    ctx->saved_data["bias_edge"] = defined(bias) ? (defined(weight) ? int64_t{2} : int64_t{1}) : int64_t{-1};
    ctx->saved_data["num_groups"] = num_groups;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["act"] = std::string(act.data(), act.size());
    return {y, mean, rstd};
  }

  // One gradient per forward argument (undefined for the non-tensor ones).
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const Tensor& dy = grad_outputs[0];
    if (!dy.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const variable_list saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    const Tensor& weight = saved[1];
    const Tensor& bias = saved[2];
    const int64_t num_groups = ctx->saved_data["num_groups"].toInt();
    const std::string act = ctx->saved_data["act"].toStringRef();
    Tensor dx, dweight, dbias;
    if (at::GradMode::is_enabled()) {
      std::tie(dx, dweight, dbias) = differentiable_grads(dy, x, weight, bias, num_groups,
                                                          ctx->saved_data["eps"].toDouble(), is_silu(act));
    } else {
      static const auto op = op_handle<BackwardSignature>("apex_contrib_group_norm::group_norm_backward");
      std::tie(dx, dweight, dbias) =
          op.call(dy.contiguous(), x, optional(weight), optional(bias), saved[3], saved[4], num_groups, act);
    }
    auto needs = [&](const char* edge) {
      const int64_t index = ctx->saved_data[edge].toInt();
      return index >= 0 && ctx->needs_input_grad(static_cast<size_t>(index));
    };
    return {ctx->needs_input_grad(0) ? dx : Tensor(),
            needs("weight_edge") ? dweight : Tensor(),
            needs("bias_edge") ? dbias : Tensor(),
            Tensor(),
            Tensor(),
            Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> group_norm_forward_autograd(const Tensor& x, const std::optional<Tensor>& weight,
                                                               const std::optional<Tensor>& bias, int64_t num_groups,
                                                               double eps, c10::string_view act) {
  auto outputs = GroupNormForward::apply(x, weight, bias, num_groups, eps, act);
  return {outputs[0], outputs[1], outputs[2]};
}

}  // namespace
}  // namespace apex_contrib_group_norm

TORCH_LIBRARY_IMPL(apex_contrib_group_norm, AutogradCUDA, m) {
  m.impl("group_norm_forward", &apex_contrib_group_norm::group_norm_forward_autograd);
}
