// Run-time dtype -> C++ type dispatch for the floating types apex kernels store: float32,
// float16 and bfloat16 (as float, c10::Half and c10::BFloat16).
//
//   apex::dispatch_float_types(dtype, "multi_tensor_scale", "inputs", [&](auto tag) {
//     using T = typename decltype(tag)::type;
//     launch<T>(...);
//   });
//
// or, with the macros, which name the type for you:
//
//   APEX_DISPATCH_FLOAT_TYPES(dtype, "multi_tensor_scale", "inputs", scalar_t, launch<scalar_t>(...););
//   APEX_DISPATCH_FLOAT_TYPES2(in_dtype, "inputs", in_t, out_dtype, "outputs", out_t, "multi_tensor_scale",
//                              launch<in_t, out_t>(...););
//
// Another dtype raises TypeError: "<op>: <argument> has dtype torch.float64; expected one of ...".
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/StringUtil.h>

namespace apex {

template <typename T>
struct TypeTag {
  using type = T;
};

[[noreturn]] inline void unsupported_float_dtype(c10::ScalarType dtype, const char* op, const char* arg) {
  C10_THROW_ERROR(TypeError, c10::str(op, ": ", arg, " has dtype torch.", c10::getDtypeNames(dtype).first,
                                      "; expected one of float32, float16, bfloat16"));
}

// Calls f(TypeTag<T>{}) with T the C++ type of `dtype`; `op` and `arg` name the op and the
// argument in the error for other dtypes.
template <typename F>
decltype(auto) dispatch_float_types(c10::ScalarType dtype, const char* op, const char* arg, F&& f) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return f(TypeTag<float>{});
    case c10::ScalarType::Half:
      return f(TypeTag<c10::Half>{});
    case c10::ScalarType::BFloat16:
      return f(TypeTag<c10::BFloat16>{});
    default:
      unsupported_float_dtype(dtype, op, arg);
  }
}

// Two-level dispatch (e.g. input dtype x output dtype): calls f(TypeTag<A>{}, TypeTag<B>{}).
template <typename F>
decltype(auto) dispatch_float_types2(c10::ScalarType dtype_a, const char* arg_a, c10::ScalarType dtype_b,
                                     const char* arg_b, const char* op, F&& f) {
  return dispatch_float_types(dtype_a, op, arg_a, [&](auto tag_a) -> decltype(auto) {
    return dispatch_float_types(dtype_b, op, arg_b, [&](auto tag_b) -> decltype(auto) { return f(tag_a, tag_b); });
  });
}

}  // namespace apex

// The body (the variadic tail) is the statement(s) to run with TYPE naming the C++ type.
#define APEX_DISPATCH_FLOAT_TYPES(DTYPE, OP, ARG, TYPE, ...)                       \
  ::apex::dispatch_float_types(DTYPE, OP, ARG, [&](auto apex_tag_##TYPE) {         \
    using TYPE = typename decltype(apex_tag_##TYPE)::type;                         \
    __VA_ARGS__                                                                    \
  })

#define APEX_DISPATCH_FLOAT_TYPES2(DTYPE_A, ARG_A, TYPE_A, DTYPE_B, ARG_B, TYPE_B, OP, ...)         \
  ::apex::dispatch_float_types2(DTYPE_A, ARG_A, DTYPE_B, ARG_B, OP,                                \
                                [&](auto apex_tag_##TYPE_A, auto apex_tag_##TYPE_B) {              \
                                  using TYPE_A = typename decltype(apex_tag_##TYPE_A)::type;       \
                                  using TYPE_B = typename decltype(apex_tag_##TYPE_B)::type;       \
                                  __VA_ARGS__                                                      \
                                })
