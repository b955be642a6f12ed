// batch_norm_train on CUDA in C++: the op's CUDA kernel (batch_norm_forward[_c_last] by c_last) and
// its autograd (the AutogradCUDA kernel), the formula apex/parallel/sync_batchnorm.py registers with
// torch.library (_train_setup_context, _train_backward: sync_batch_norm_backward at world 1), without
// the host time of a Python autograd layer on every eager call. The dispatcher prefers a kernel
// registered for AutogradCUDA to that registration for CUDA tensors; the Python one serves the other
// devices, torch.compile, and CUDA before this library is loaded. Both save the same tensors and call
// the same ops in the same order, with z's gradient from the reduction (masked_in_reduce=True).
#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKey.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace apex_parallel {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<Tensor>;

using TrainSignature = Tensor(const Tensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&,
                              const Tensor&, const Tensor&, const Tensor&, bool, bool);
using ForwardSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&,
                                const OptionalTensor&);
using ForwardCLastSignature = Tensor(const Tensor&, const OptionalTensor&, const Tensor&, const Tensor&,
                                     const OptionalTensor&, const OptionalTensor&, bool);
using ReduceSignature = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                   const Tensor&, const OptionalTensor&);
using BackwardSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&,
                                 const Tensor&, const Tensor&, const Tensor&);
using ReluBackwardSignature = Tensor(const Tensor&, const Tensor&, const OptionalTensor&, const Tensor&,
                                     const Tensor&, const OptionalTensor&, const OptionalTensor&);
using ReduceReluSignature = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const OptionalTensor&, const Tensor&, const Tensor&, const OptionalTensor&,
    const OptionalTensor&, bool);
using BackwardReluSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptionalTensor&,
                                                         const Tensor&, const Tensor&, const OptionalTensor&,
                                                         const OptionalTensor&, const Tensor&, const Tensor&,
                                                         const Tensor&, bool);

template <typename Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

bool defined(const OptionalTensor& t) { return t.has_value() && t->defined(); }

OptionalTensor optional(const Tensor& t) { return t.defined() ? OptionalTensor(t) : std::nullopt; }

// batch_norm_train's CUDA kernel: the forward op of its layout.
Tensor batch_norm_train_cuda(const Tensor& input, const OptionalTensor& z, const OptionalTensor& weight,
                             const OptionalTensor& bias, const Tensor& mean, const Tensor& invstd,
                             const Tensor& count, bool c_last, bool relu) {
  // The forward ops check the rest; the count is the backward's, checked here so that a bad one
  // fails in the forward, as the Python check does.
  TORCH_CHECK_VALUE(c_last || !(defined(z) || relu),
                    "batch_norm_train: z and relu need c_last=True (the channels-last kernels fuse them)");
  TORCH_CHECK_TYPE(count.scalar_type() == at::kFloat || count.scalar_type() == at::kDouble,
                   "batch_norm_train: count has dtype ", count.scalar_type(),
                   "; expected torch.float32 or torch.float64");
  TORCH_CHECK_VALUE(count.dim() == 1, "batch_norm_train: count must be 1-D (one count per rank), got shape ",
                    count.sizes());
  TORCH_CHECK_VALUE(count.device() == input.device(), "batch_norm_train: count is on ", count.device(),
                    ", expected ", input.device());
  if (c_last) {
    static const auto forward = op_handle<ForwardCLastSignature>("apex_parallel::batch_norm_forward_c_last");
    return forward.call(input, z, mean, invstd, weight, bias, relu);
  }
  static const auto forward = op_handle<ForwardSignature>("apex_parallel::batch_norm_forward");
  return forward.call(input, mean, invstd, weight, bias);
}

// The index of an optional input among the forward's tensor inputs that were given (autograd's
// edges, which needs_input_grad counts), or -1 when not given.
int64_t edge(const OptionalTensor& t, int64_t& next) { return defined(t) ? next++ : int64_t{-1}; }

bool needs(AutogradContext* ctx, const char* name) {
  const int64_t index = ctx->saved_data[name].toInt();
  return index >= 0 && ctx->needs_input_grad(static_cast<size_t>(index));
}

struct BatchNormTrain : public torch::autograd::Function<BatchNormTrain> {
  static Tensor forward(AutogradContext* ctx, const Tensor& input, const OptionalTensor& z,
                        const OptionalTensor& weight, const OptionalTensor& bias, const Tensor& mean,
                        const Tensor& invstd, const Tensor& count, bool c_last, bool relu) {
    static const auto op = op_handle<TrainSignature>("apex_parallel::batch_norm_train");
    Tensor out;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      out = op.call(input, z, weight, bias, mean, invstd, count, c_last, relu);
    }
    // _train_setup_context of sync_batchnorm.py.
    ctx->save_for_backward({input, defined(z) ? *z : Tensor(), defined(weight) ? *weight : Tensor(),
                            defined(bias) ? *bias : Tensor(), mean, invstd, count});
    int64_t next = 1;  // input is edge 0
    ctx->saved_data["z_edge"] = edge(z, next);
    ctx->saved_data["weight_edge"] = edge(weight, next);
    ctx->saved_data["bias_edge"] = edge(bias, next);
    ctx->saved_data["c_last"] = c_last;
    ctx->saved_data["relu"] = relu;
    return out;
  }

  // _train_backward of sync_batchnorm.py (sync_batch_norm_backward at world 1): one gradient per
  // forward argument (undefined where not needed and for the non-differentiable ones).
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor& input = saved[0];
    const OptionalTensor z = optional(saved[1]);
    const OptionalTensor weight = optional(saved[2]);
    const OptionalTensor bias = optional(saved[3]);
    const Tensor& mean = saved[4];
    const Tensor& invstd = saved[5];
    const Tensor& count = saved[6];
    const bool c_last = ctx->saved_data["c_last"].toBool();
    const bool relu = ctx->saved_data["relu"].toBool();
    const bool input_grad = ctx->needs_input_grad(0);
    const bool z_grad = needs(ctx, "z_edge");
    Tensor grad_output = grad_outputs[0].contiguous();
    Tensor grad_input, grad_z, grad_weight, grad_bias;
    if (relu && input_grad) {
      static const auto reduce = op_handle<ReduceReluSignature>("apex_parallel::reduce_bn_relu_c_last");
      Tensor sum_dy, sum_dy_xmu, masked;
      std::tie(sum_dy, sum_dy_xmu, grad_weight, grad_bias, masked) =
          reduce.call(grad_output, input, z, mean, invstd, weight, bias, z_grad);
      if (z_grad) {
        static const auto backward = op_handle<BackwardSignature>("apex_parallel::batch_norm_backward_c_last");
        grad_z = masked;
        grad_input = backward.call(masked, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count);
      } else {
        static const auto backward =
            op_handle<BackwardReluSignature>("apex_parallel::batch_norm_backward_relu_c_last");
        grad_input =
            std::get<0>(backward.call(grad_output, input, z, mean, invstd, weight, bias, sum_dy, sum_dy_xmu, count,
                                      false));
      }
    } else {
      if (relu) {
        static const auto relu_backward = op_handle<ReluBackwardSignature>("apex_parallel::relu_backward_c_last");
        grad_output = relu_backward.call(grad_output, input, z, mean, invstd, weight, bias);
      }
      if (z_grad) grad_z = grad_output;
      static const auto reduce = op_handle<ReduceSignature>("apex_parallel::reduce_bn");
      static const auto reduce_c_last = op_handle<ReduceSignature>("apex_parallel::reduce_bn_c_last");
      Tensor sum_dy, sum_dy_xmu;
      std::tie(sum_dy, sum_dy_xmu, grad_weight, grad_bias) =
          (c_last ? reduce_c_last : reduce).call(grad_output, input, mean, invstd, weight);
      if (input_grad) {
        static const auto backward = op_handle<BackwardSignature>("apex_parallel::batch_norm_backward");
        static const auto backward_c_last = op_handle<BackwardSignature>("apex_parallel::batch_norm_backward_c_last");
        grad_input = (c_last ? backward_c_last : backward)
                         .call(grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count);
      }
    }
    if (!defined(weight) || !needs(ctx, "weight_edge")) grad_weight = Tensor();
    if (!defined(bias) || !needs(ctx, "bias_edge")) grad_bias = Tensor();
    return {grad_input, grad_z, grad_weight, grad_bias, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor batch_norm_train_autograd(const Tensor& input, const OptionalTensor& z, const OptionalTensor& weight,
                                 const OptionalTensor& bias, const Tensor& mean, const Tensor& invstd,
                                 const Tensor& count, bool c_last, bool relu) {
  return BatchNormTrain::apply(input, z, weight, bias, mean, invstd, count, c_last, relu);
}

}  // namespace
}  // namespace apex_parallel

TORCH_LIBRARY_IMPL(apex_parallel, CUDA, m) { m.impl("batch_norm_train", &apex_parallel::batch_norm_train_cuda); }

TORCH_LIBRARY_IMPL(apex_parallel, AutogradCUDA, m) {
  m.impl("batch_norm_train", &apex_parallel::batch_norm_train_autograd);
}
