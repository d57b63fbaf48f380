// Text for numbers, shapes and dtypes in error messages, built without
// std::ostream. Seen on the H200 machine (g++ 13.3 building against torch 2.11):
// inserting a number into the std::ostringstream that c10::str inlines into
// this library crashes (strings are fine), so messages pass numbers as strings.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

namespace fused_ce {

template <typename Int, typename = std::enable_if_t<std::is_integral_v<Int>>>
std::string num(Int v) {
  return std::to_string(v);
}

inline std::string num(double v) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%g", v);
  return buffer;
}

inline std::string shape(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

inline std::string name(c10::ScalarType t) {
  return c10::toString(t);
}

}  // namespace fused_ce
