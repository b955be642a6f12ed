// fused_novograd: NovoGrad over params, grads, exp_avgs (and fp32 master_params), with one
// second-moment value per tensor (exp_avg_sq_norms) fed by per-tensor gradient norms
// (grad_norms, computed by the caller). See _novograd_reference in apex/optimizers/_ops.py.
//
// Two launches: a one-block kernel updates exp_avg_sq_norms from grad_norms, then the
// element-wise pass reads each tensor's new value once per block. (Updating it inside the
// element-wise pass would race: every block of a tensor must see the new value.) Traffic per
// fp32 parameter: read p, g, m; write p, m (20 bytes).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <optional>
#include <type_traits>

#include <apex/checks.h>
#include <apex/dispatch.h>
#include <apex/multi_tensor_apply.cuh>
#include <apex/vectorized.cuh>

#include "optimizer_common.cuh"
#include "cuda_ops.h"

namespace {

constexpr const char* kOp = "fused_novograd";
constexpr int kNormsBlockSize = 256;

// v[i] = grad_norms[i]^2 on the first step (unless init_zero), else beta2 * v[i] + (1 - beta2) *
// grad_norms[i]^2. Nothing is written when found_inf is set.
__global__ void __launch_bounds__(kNormsBlockSize)
    update_norms_kernel(float* exp_avg_sq_norms, int64_t norms_stride, const float* grad_norms,
                        int64_t grad_norms_stride, int64_t n, float beta2, bool first, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const float one_minus_beta2 = 1.0f - beta2;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float norm = grad_norms[i * grad_norms_stride];
    const float norm_sq = norm * norm;
    float* v = exp_avg_sq_norms + i * norms_stride;
    *v = first ? norm_sq : *v * beta2 + norm_sq * one_minus_beta2;
  }
}

struct NovoGradArgs {
  apex_optimizers::DeviceScalars scalars;
  const float* exp_avg_sq_norms;
  int64_t norms_stride;
  float lr;
  float bias_correction2;
  float inv_bias_correction1;
  float beta1;
  float beta3;  // weight of the normalized gradient in the moment: 1 - beta1 with grad averaging, else 1
  float eps;
  float weight_decay;
  bool reg_inside_moment;
};

// Lists: 0 the parameter the update is computed on (fp32 master copy when kMaster, else the
// params), 1 grads, 2 exp_avgs, and with kMaster 3 the params (written only).
template <typename Param, typename Grad, bool kMaster>
struct NovoGradFunctor {
  using Current = std::conditional_t<kMaster, float, Param>;
  static constexpr int kDepth = kMaster ? 4 : 3;

  NovoGradArgs args;

  __device__ void operator()(const apex::Chunk<kDepth>& chunk) const {
    if (args.scalars.skip()) return;
    const float lr = args.scalars.lr(args.lr);
    // The gradient is unscaled and divided by its tensor's sqrt(v / bias_correction2) + eps: one
    // factor per block.
    const float v = args.exp_avg_sq_norms[chunk.tensor_index * args.norms_stride];
    const float denom = __fsqrt_rn(__fdiv_rn(v, args.bias_correction2)) + args.eps;
    const float grad_factor = __fdiv_rn(args.scalars.inv_grad_scale(), denom);
    const float inner_decay = args.reg_inside_moment ? args.weight_decay : 0.0f;
    const float outer_decay = args.reg_inside_moment ? 0.0f : args.weight_decay;
    const float beta1 = args.beta1;
    const float beta3 = args.beta3;
    const float inv_bias_correction1 = args.inv_bias_correction1;

    Current* current = chunk.template data<Current>(0);
    const Grad* grad = chunk.template data<Grad>(1);
    float* exp_avg = chunk.template data<float>(2);
    Param* params = kMaster ? chunk.template data<Param>(3) : nullptr;

    auto body = [&](auto group) {
      typename decltype(group)::Values p, g, m;
      group.load(p, current);
      group.load(g, grad);
      group.load(m, exp_avg);
      group.for_each_value([&](int i, int j) {
        float gj = g[i][j] * grad_factor;
        // Decay terms only when asked for: 0 * inf would turn an inf parameter's moment NaN.
        if (inner_decay != 0.0f) gj += inner_decay * p[i][j];
        const float mj = m[i][j] * beta1 + gj * beta3;
        float update = mj * inv_bias_correction1;
        if (outer_decay != 0.0f) update += outer_decay * p[i][j];
        m[i][j] = mj;
        p[i][j] -= lr * update;
      });
      group.store(exp_avg, m);
      group.store(current, p);
      if constexpr (kMaster) group.store(params, p);
    };
    apex_optimizers::for_each_element<apex::vector_width<Param, Grad, float>(), kMaster>(chunk.size, body, params,
                                                                                        current, grad, exp_avg);
  }
};

// exp_avg_sq_norms and grad_norms: 1-D fp32 with one element per tensor, on the params' device.
void check_per_tensor(const char* name, const at::Tensor& t, size_t n_tensors, std::optional<c10::Device> device) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.dim() == 1 && t.numel() == static_cast<int64_t>(n_tensors), kOp,
                    ": ", name, " must be a 1-D float32 tensor of ", n_tensors,
                    " elements (one per tensor), got torch.", apex::checks::dtype_name(t.scalar_type()),
                    " of shape ", apex::checks::shape_string(t.sizes()));
  TORCH_CHECK_VALUE(!device || t.device() == *device, kOp, ": ", name, " is on ", t.device(), ", expected ", *device);
}

}  // namespace

namespace apex_optimizers {

void fused_novograd_cuda(int64_t chunk_size, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         const at::Tensor& exp_avg_sq_norms, const at::Tensor& grad_norms,
                         at::TensorList master_params, double lr, int64_t step, double beta1, double beta2, double eps,
                         double weight_decay, bool bias_correction, bool grad_averaging, bool reg_inside_moment,
                         bool init_zero, const std::optional<at::Tensor>& lr_tensor,
                         const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  namespace checks = apex::checks;
  checks::positive_chunk_size(kOp, chunk_size);
  checks::same_lengths(kOp, {{"params", params.size()}, {"grads", grads.size()}, {"exp_avgs", exp_avgs.size()}});
  const auto device = apex_optimizers::check_common(
      kOp, params, grads, {{"exp_avgs", exp_avgs}}, master_params,
      {{"lr_tensor", lr_tensor}, {"grad_scale", grad_scale}, {"found_inf", found_inf}});
  check_per_tensor("exp_avg_sq_norms", exp_avg_sq_norms, params.size(), device);
  check_per_tensor("grad_norms", grad_norms, params.size(), device);
  TORCH_CHECK_VALUE(step >= 1, kOp, ": step must be >= 1, got ", step);
  if (!device) return;

  double bias_correction1 = 1.0, bias_correction2 = 1.0;
  if (bias_correction) {
    bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  }
  const float* found_inf_ptr = apex_optimizers::optional_ptr(found_inf);

  const c10::cuda::CUDAGuard device_guard(*device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  update_norms_kernel<<<1, kNormsBlockSize, 0, stream>>>(
      exp_avg_sq_norms.data_ptr<float>(), exp_avg_sq_norms.stride(0), grad_norms.data_ptr<float>(),
      grad_norms.stride(0), static_cast<int64_t>(params.size()), static_cast<float>(beta2), step == 1 && !init_zero,
      found_inf_ptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  NovoGradArgs args{};
  args.scalars = apex_optimizers::device_scalars(lr_tensor, grad_scale, found_inf);
  args.exp_avg_sq_norms = exp_avg_sq_norms.data_ptr<float>();
  args.norms_stride = exp_avg_sq_norms.stride(0);
  args.lr = static_cast<float>(lr);
  args.bias_correction2 = static_cast<float>(bias_correction2);
  args.inv_bias_correction1 = static_cast<float>(1.0 / bias_correction1);
  args.beta1 = static_cast<float>(beta1);
  args.beta3 = static_cast<float>(grad_averaging ? 1.0 - beta1 : 1.0);
  args.eps = static_cast<float>(eps);
  args.weight_decay = static_cast<float>(weight_decay);
  args.reg_inside_moment = reg_inside_moment;

  apex_optimizers::launch_elementwise<NovoGradFunctor>(kOp, chunk_size, params, grads, master_params, args,
                                                       exp_avgs);
}

}  // namespace apex_optimizers

