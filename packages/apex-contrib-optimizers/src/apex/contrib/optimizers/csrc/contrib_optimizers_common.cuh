// What the kernels of apex.contrib.optimizers share: the argument checks of the flat-shard ops
// (_distributed_adam_ops.py's _check_common, same words), torch.lerp's formula, the device bias
// correction and the bf16 + int16 remainder split of an fp32 master.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include <cuda_fp16.h>

#include <apex/checks.h>
#include <apex/vectorized.cuh>

namespace apex_contrib_optimizers {

using apex::accesses_in_flight;

// One role's tensor list and the dtypes it may have.
struct ShardList {
  const char* name;
  at::TensorList tensors;
  c10::ArrayRef<c10::ScalarType> dtypes;
};

// _check_common's list checks: chunk_size, one length, dtypes and one device per list,
// contiguous tensors (flat shards), and the element counts of the first list (params).
// Returns the device of the tensors, nullopt when the lists are empty.
inline std::optional<c10::Device> check_shards(const char* op, int64_t chunk_size,
                                               std::initializer_list<ShardList> lists) {
  namespace checks = apex::checks;
  checks::positive_chunk_size(op, chunk_size);
  const ShardList& first = *lists.begin();
  bool same = true;
  for (const auto& list : lists) same = same && list.tensors.size() == first.tensors.size();
  if (!same) {
    std::string described;
    for (const auto& list : lists) {
      described += (described.empty() ? "" : ", ") + std::string(list.name) + " has " +
                   std::to_string(list.tensors.size());
    }
    TORCH_CHECK_VALUE(false, op, ": tensor lists must have the same length (", described, ")");
  }
  if (first.tensors.empty()) return std::nullopt;
  const c10::Device device = first.tensors[0].device();
  for (const auto& list : lists) {
    checks::tensor_list(op, list.name, list.tensors, device, list.dtypes);
    for (size_t i = 0; i < list.tensors.size(); ++i) {
      TORCH_CHECK_VALUE(list.tensors[i].is_contiguous(), op, ": ", list.name, "[", i,
                        "] is not contiguous; the ops take flat (contiguous) shards");
    }
  }
  for (const auto& list : lists) checks::same_numel(op, list.name, list.tensors, first.name, first.tensors);
  return device;
}

// The scalar arguments of the Adam shard ops, checked as _check_common checks them.
inline void check_step_scalars(const char* op, std::optional<c10::Device> device, int64_t adam_mode,
                               const at::Tensor& noop_flag, const at::Tensor& grad_scale,
                               const std::optional<at::Tensor>& lr_tensor,
                               const std::optional<at::Tensor>& step_tensor, int64_t step, bool bias_correction) {
  namespace checks = apex::checks;
  TORCH_CHECK_VALUE(adam_mode == 0 || adam_mode == 1, op,
                    ": adam_mode must be 0 (L2) or 1 (decoupled weight decay), got ", adam_mode);
  TORCH_CHECK_TYPE(noop_flag.scalar_type() == at::kInt && noop_flag.numel() == 1, op,
                   ": noop_flag must be a one-element int32 tensor, got torch.",
                   checks::dtype_name(noop_flag.scalar_type()), " of shape ", checks::shape_string(noop_flag.sizes()));
  static constexpr c10::ScalarType kFloat[] = {at::kFloat};
  checks::scalar_tensor(op, "grad_scale", grad_scale, kFloat);
  if (lr_tensor.has_value() && lr_tensor->defined()) checks::scalar_tensor(op, "lr_tensor", *lr_tensor, kFloat);
  const bool has_step_tensor = step_tensor.has_value() && step_tensor->defined();
  if (has_step_tensor) checks::scalar_tensor(op, "step_tensor", *step_tensor, kFloat);
  if (device) {
    const std::pair<const char*, const at::Tensor*> scalars[] = {
        {"noop_flag", &noop_flag},
        {"grad_scale", &grad_scale},
        {"lr_tensor", apex::optional_tensor(lr_tensor)},
        {"step_tensor", apex::optional_tensor(step_tensor)}};
    for (const auto& [name, t] : scalars) {
      TORCH_CHECK_VALUE(t == nullptr || t->device() == *device, op, ": ", name, " is on ", t->device(), ", expected ",
                        *device, " (the device of params)");
    }
  }
  TORCH_CHECK_VALUE(has_step_tensor || !bias_correction || step >= 1, op,
                    ": step must be >= 1 with bias_correction, got ", step);
}

// torch.lerp(self, end, weight) for a fixed weight, in torch's formula (the reference's moments:
// lerp(g, m, beta1) = beta1 m + (1 - beta1) g).
struct Lerp {
  float weight;
  float one_minus_weight;
  bool small;

  __device__ __forceinline__ explicit Lerp(float w) : weight(w), one_minus_weight(1.0f - w), small(w < 0.5f) {}

  __device__ __forceinline__ float operator()(float self, float end) const {
    const float diff = end - self;
    return small ? self + weight * diff : end - diff * one_minus_weight;
  }
};

// 1 - beta^step for an fp32 step read on the device. The power goes through double so that
// --use_fast_math's approximate powf cannot cost digits of 1 - beta^step (beta2 = 0.999 at step 1
// leaves 1e-3).
__device__ __forceinline__ float bias_correction(float beta, float step) {
  return 1.0f - static_cast<float>(pow(static_cast<double>(beta), static_cast<double>(step)));
}

// The fp32 value of a bf16 (its bits as a signed 16-bit value `high`) and an int16 remainder
// `low`: the bf16 was rounded up in magnitude when the remainder is negative (its top bit set).
// As bf16_and_remainder_to_fp32 of _distributed_adam_ops.py, bit for bit.
__device__ __forceinline__ float join_bf16_and_remainder(int32_t high, int32_t low) {
  const uint32_t bits =
      (static_cast<uint32_t>(high - (low < 0 ? 1 : 0)) << 16) | (static_cast<uint32_t>(low) & 0xFFFFu);
  return __uint_as_float(bits);
}

// Its inverse (fp32_to_bf16_and_remainder): the low 16 bits as a signed remainder, the high 16
// rounded up in magnitude when the remainder's top bit is set, both as signed 16-bit values.
__device__ __forceinline__ void split_bf16_and_remainder(float x, int32_t& high, int32_t& low) {
  const uint32_t bits = __float_as_uint(x);
  low = static_cast<int16_t>(static_cast<uint16_t>(bits & 0xFFFFu));
  high = static_cast<int16_t>(static_cast<uint16_t>((bits >> 16) + (low < 0 ? 1u : 0u)));
}

// e5m2 bytes (uint8 tensors): the high byte of a float16. The code of x, rounded to nearest by
// adding an eighth of its power of two first (to_e5m2 of _ops.py), as a float 0..255 (what the
// element loops store into uint8 exactly).
__device__ __forceinline__ float e5m2_code(float x) {
  const float power = __uint_as_float(__float_as_uint(x) & 0xFF800000u);
  const uint16_t half_bits = __half_as_ushort(__float2half_rn(x + power * 0.125f));
  return static_cast<float>(half_bits >> 8);
}

// The value of an e5m2 code (given as a float 0..255, as the element loops load uint8), from_e5m2.
__device__ __forceinline__ float e5m2_value(float code) {
  return __half2float(__ushort_as_half(static_cast<uint16_t>(static_cast<uint32_t>(code) << 8)));
}

}  // namespace apex_contrib_optimizers
