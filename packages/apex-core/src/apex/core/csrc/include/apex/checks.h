// Argument checks for apex kernels, worded like apex/core/checks.py.
//
// The Python reference and fake implementations and the C++ kernels check the same things
// and say the same words ("<op>: inputs[3] has dtype ..."), so a bad argument gets one
// clear error whichever implementation the dispatcher picks. Wrong dtypes raise TypeError,
// wrong values, devices, shapes and layouts raise ValueError, as in Python.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

namespace apex::checks {

inline constexpr std::array<c10::ScalarType, 3> kFloatDtypes = {
    c10::ScalarType::Float, c10::ScalarType::Half, c10::ScalarType::BFloat16};

// "float16", as Python's str(torch.float16) without the "torch." prefix.
inline std::string dtype_name(c10::ScalarType dtype) {
  return std::string(c10::getDtypeNames(dtype).first);
}

inline std::string dtype_names(c10::ArrayRef<c10::ScalarType> dtypes) {
  std::string names;
  for (const auto dtype : dtypes) {
    names += (names.empty() ? "" : ", ") + dtype_name(dtype);
  }
  return names;
}

// "(2, 3)", as Python prints a shape tuple.
inline std::string shape_string(c10::IntArrayRef sizes) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < sizes.size(); ++i) {
    out << (i ? ", " : "") << sizes[i];
  }
  out << (sizes.size() == 1 ? ",)" : ")");
  return out.str();
}

inline bool contains(c10::ArrayRef<c10::ScalarType> dtypes, c10::ScalarType dtype) {
  for (const auto allowed : dtypes) {
    if (allowed == dtype) return true;
  }
  return false;
}

inline void positive_chunk_size(const char* op, int64_t chunk_size) {
  TORCH_CHECK_VALUE(chunk_size > 0, op, ": chunk_size must be positive, got ", chunk_size);
}

// A one-element tensor such as noop_flag or a loss scale. Returns its device.
inline c10::Device scalar_tensor(const char* op, const char* name, const at::Tensor& t,
                                 c10::ArrayRef<c10::ScalarType> dtypes,
                                 std::optional<c10::Device> device = std::nullopt) {
  TORCH_CHECK_TYPE(t.defined(), op, ": ", name, " must be a Tensor, got None");
  TORCH_CHECK_TYPE(contains(dtypes, t.scalar_type()), op, ": ", name, " has dtype torch.",
                   dtype_name(t.scalar_type()), "; expected ", dtype_names(dtypes));
  TORCH_CHECK_VALUE(t.numel() == 1, op, ": ", name, " must have exactly one element, got shape ",
                    shape_string(t.sizes()));
  TORCH_CHECK_VALUE(!device || t.device() == *device, op, ": ", name, " is on ", t.device(),
                    ", expected ", *device);
  return t.device();
}

// Lists that must have one length, e.g. same_lengths(op, {{"inputs", a.size()}, {"outputs", b.size()}}).
inline size_t same_lengths(const char* op,
                           std::initializer_list<std::pair<const char*, size_t>> lists) {
  bool same = true;
  for (const auto& list : lists) {
    same = same && list.second == lists.begin()->second;
  }
  if (!same) {
    std::string described;
    for (const auto& [name, length] : lists) {
      described += (described.empty() ? "" : ", ") + std::string(name) + " has " + std::to_string(length);
    }
    TORCH_CHECK_VALUE(false, op, ": tensor lists must have the same length (", described, ")");
  }
  return lists.size() ? lists.begin()->second : 0;
}

// Contiguous, or a permutation of a contiguous layout (channels-last, a transpose): the elements
// fill numel() consecutive places of the storage, so an element-wise kernel over the storage
// sees each once (is_dense of checks.py).
inline bool is_dense(const at::Tensor& t) { return t.is_contiguous() || t.is_non_overlapping_and_dense(); }

// One shape, and one stride in every dimension of more than one element.
inline bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

// Tensors at one index of the lists are all contiguous, or have one shape and stride order
// (same_layouts of checks.py): an element-wise kernel over the storage then pairs the same
// elements. Lists shorter than others are skipped past their end.
using NamedTensorList = std::pair<const char*, at::TensorList>;

inline void same_layouts(const char* op, c10::ArrayRef<NamedTensorList> lists) {
  size_t longest = 0;
  for (const auto& list : lists) longest = std::max(longest, list.second.size());
  for (size_t i = 0; i < longest; ++i) {
    const NamedTensorList* odd = nullptr;
    for (const auto& list : lists) {
      if (i < list.second.size() && !list.second[i].is_contiguous()) {
        odd = &list;
        break;
      }
    }
    if (odd == nullptr) continue;
    const at::Tensor& ref = odd->second[i];
    for (const auto& list : lists) {
      if (i >= list.second.size() || &list == odd) continue;
      const at::Tensor& t = list.second[i];
      TORCH_CHECK_VALUE(same_layout(ref, t), op, ": ", odd->first, "[", i, "] is not contiguous and ", list.first,
                        "[", i, "] has another layout (shape ", shape_string(ref.sizes()), " strides ",
                        shape_string(ref.strides()), " vs shape ", shape_string(t.sizes()), " strides ",
                        shape_string(t.strides()),
                        "); a non-contiguous tensor needs the same shape and strides at its index of every list");
    }
  }
}

// One list's tensors: one dtype among `dtypes`, all on `device`, dense (contiguous or a
// permutation of it, see is_dense; ops taking several lists also check same_layouts) unless
// told otherwise. Returns the list's dtype, or nullopt for an empty list.
inline std::optional<c10::ScalarType> tensor_list(
    const char* op, const char* name, at::TensorList tensors, c10::Device device,
    c10::ArrayRef<c10::ScalarType> dtypes = kFloatDtypes, bool dense = true) {
  std::optional<c10::ScalarType> list_dtype;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_TYPE(t.defined(), op, ": ", name, "[", i, "] is None, not a Tensor");
    TORCH_CHECK_VALUE(t.layout() == c10::kStrided, op, ": ", name, "[", i, "] has layout ",
                      t.layout(), "; only dense (strided) tensors are supported");
    const auto dtype = t.scalar_type();
    TORCH_CHECK_TYPE(contains(dtypes, dtype), op, ": ", name, "[", i, "] has dtype torch.",
                     dtype_name(dtype), "; expected one of ", dtype_names(dtypes));
    if (!list_dtype) {
      list_dtype = dtype;
    } else {
      TORCH_CHECK_TYPE(dtype == *list_dtype, op, ": ", name, "[", i, "] has dtype torch.",
                       dtype_name(dtype), " but ", name, "[0] has torch.", dtype_name(*list_dtype),
                       "; all tensors of one list must share a dtype");
    }
    TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, "[", i, "] is on ", t.device(),
                      ", expected ", device);
    TORCH_CHECK_VALUE(!dense || is_dense(t), op, ": ", name, "[", i,
                      "] is not contiguous and not dense (a strided view with gaps or overlaps, shape ",
                      shape_string(t.sizes()), " strides ", shape_string(t.strides()), "); pass a contiguous tensor");
  }
  return list_dtype;
}

// Tensor i of `tensors` must have as many elements as tensor i of `like` (lists of one length).
inline void same_numel(const char* op, const char* name, at::TensorList tensors,
                       const char* like_name, at::TensorList like) {
  for (size_t i = 0; i < tensors.size() && i < like.size(); ++i) {
    TORCH_CHECK_VALUE(tensors[i].numel() == like[i].numel(), op, ": ", name, "[", i, "] has ",
                      tensors[i].numel(), " elements but ", like_name, "[", i, "] has ",
                      like[i].numel());
  }
}

// "torch.float16", as Python's str(torch.float16).
inline std::string torch_dtype(c10::ScalarType dtype) { return "torch." + dtype_name(dtype); }

// A strided tensor on `device`.
inline void placed(const char* op, const char* name, const at::Tensor& t, c10::Device device) {
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided, op, ": ", name, " has layout ", t.layout(),
                    "; only dense (strided) tensors are supported");
  TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), ", expected ", device);
}

// A strided, contiguous tensor on `device`.
inline void dense(const char* op, const char* name, const at::Tensor& t, c10::Device device) {
  placed(op, name, t, device);
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " is not contiguous");
}

// A strided 2-D tensor on `device` whose rows are each contiguous and do not overlap, at any row
// stride (rows of checks.py): a contiguous tensor, or the first columns of a wider one.
inline void rows(const char* op, const char* name, const at::Tensor& t, c10::Device device) {
  placed(op, name, t, device);
  const bool ok = (t.size(1) <= 1 || t.stride(1) == 1) && (t.size(0) <= 1 || t.stride(0) >= t.size(1));
  TORCH_CHECK_VALUE(ok, op, ": ", name,
                    " must have contiguous rows (unit stride along its last dimension, rows not overlapping), got "
                    "strides ",
                    shape_string(t.strides()), " for shape ", shape_string(t.sizes()));
}

}  // namespace apex::checks

namespace apex {

// The tensor of an optional argument, or null when absent or undefined.
inline const at::Tensor* optional_tensor(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? &*t : nullptr;
}

// Its data as const T*, or null.
template <typename T>
inline const T* optional_ptr(const std::optional<at::Tensor>& t) {
  const at::Tensor* tensor = optional_tensor(t);
  return tensor != nullptr ? static_cast<const T*>(tensor->const_data_ptr()) : nullptr;
}

}  // namespace apex
