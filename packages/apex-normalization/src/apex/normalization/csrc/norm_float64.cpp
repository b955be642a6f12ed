#include "norm_float64.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <vector>

namespace apex_normalization {
namespace {

std::vector<int64_t> row_dims(const at::Tensor& t, c10::IntArrayRef shape) {
  std::vector<int64_t> dims;
  for (int64_t d = t.dim() - static_cast<int64_t>(shape.size()); d < t.dim(); ++d) dims.push_back(d);
  return dims;
}

// The statistics' shape broadcast against the rows: the leading shape, then a 1 per normalized dim.
std::vector<int64_t> stat_shape(const at::Tensor& t, c10::IntArrayRef shape) {
  std::vector<int64_t> out(t.sizes().begin(), t.sizes().end() - static_cast<int64_t>(shape.size()));
  out.insert(out.end(), shape.size(), 1);
  return out;
}

at::Tensor as_double(const at::Tensor* t) { return t == nullptr ? at::Tensor() : t->to(at::kDouble); }

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_float64(
    const at::Tensor& input, const at::Tensor* residual, const at::Tensor* weight, const at::Tensor* bias,
    c10::IntArrayRef shape, double eps, bool rms, c10::ScalarType out_dtype) {
  const c10::cuda::CUDAGuard device_guard(input.device());
  const at::Tensor x = residual != nullptr ? input + *residual : input;
  const auto dims = row_dims(x, shape);
  const auto lead = x.sizes().slice(0, x.dim() - static_cast<int64_t>(shape.size()));
  at::Tensor mean, centered;
  if (rms) {
    mean = at::empty({0}, x.options().dtype(at::kFloat));
    centered = x;
  } else {
    const at::Tensor row_mean = x.mean(dims, /*keepdim=*/true);
    centered = x - row_mean;
    mean = row_mean.reshape(lead);
  }
  const at::Tensor rstd = (centered.square().mean(dims, /*keepdim=*/true) + eps).rsqrt();
  at::Tensor y = centered * rstd;
  if (weight != nullptr) y = y * as_double(weight);
  if (bias != nullptr) y = y + as_double(bias);
  return {y.to(out_dtype).contiguous(), residual != nullptr ? x : at::Tensor(), mean.contiguous(),
          rstd.reshape(lead).contiguous()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_float64(
    const at::Tensor& grad_output, const at::Tensor& saved, const at::Tensor* weight, const at::Tensor* bias,
    const at::Tensor& mean, const at::Tensor& rstd, c10::IntArrayRef shape, bool rms, bool memory_efficient,
    bool weight_grads, const at::Tensor* grad_residual_out) {
  const c10::cuda::CUDAGuard device_guard(saved.device());
  const auto dims = row_dims(saved, shape);
  const auto stats = stat_shape(saved, shape);
  const at::Tensor r = rstd.to(at::kDouble).reshape(stats);
  const at::Tensor w = as_double(weight);
  at::Tensor xhat;
  if (memory_efficient) {  // the normalized rows back from the output
    xhat = saved.to(at::kDouble);
    if (bias != nullptr) xhat = xhat - as_double(bias);
    if (weight != nullptr) xhat = xhat / w;
  } else {
    xhat = rms ? saved * r : (saved - mean.reshape(stats)) * r;
  }
  const at::Tensor dy = grad_output.to(at::kDouble);
  const at::Tensor wdy = weight != nullptr ? dy * w : dy;
  at::Tensor inner = wdy - xhat * (wdy * xhat).mean(dims, /*keepdim=*/true);
  if (!rms) inner = inner - wdy.mean(dims, /*keepdim=*/true);
  at::Tensor grad_input = inner * r;
  if (grad_residual_out != nullptr) grad_input = grad_input + *grad_residual_out;
  const auto f32 = saved.options().dtype(at::kFloat);
  const bool with_weight = weight_grads && weight != nullptr;
  std::vector<int64_t> lead_dims;
  for (int64_t d = 0; d < saved.dim() - static_cast<int64_t>(shape.size()); ++d) lead_dims.push_back(d);
  at::Tensor grad_weight = at::empty({0}, f32);
  at::Tensor grad_bias = at::empty({0}, f32);
  if (with_weight) {
    grad_weight = (dy * xhat).sum(lead_dims).to(weight->scalar_type()).contiguous();
    if (bias != nullptr) grad_bias = dy.sum(lead_dims).to(bias->scalar_type()).contiguous();
  }
  return {grad_input.to(at::kDouble).contiguous(), grad_weight, grad_bias};
}

}  // namespace apex_normalization
