// Launching the embedded cubins through the CUDA driver API.
//
// libcuda is opened at run time (dlopen), so the library builds without the CUDA
// toolkit and imports on machines without a GPU. Modules load lazily, once per
// device and variant, under a lock; every driver error becomes a c10::Error.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "kernel_table.h"

namespace fused_ce {

// Named, exactly typed kernel arguments; matched against the variant's
// parameter list (names and triton types) when launching.
class KernelArgs {
 public:
  KernelArgs& ptr(const char* name, const at::Tensor& t);  // null for an undefined tensor
  KernelArgs& i64(const char* name, int64_t v);
  KernelArgs& i32(const char* name, int32_t v);
  KernelArgs& f32(const char* name, float v);

 private:
  friend void launch(const KernelVariant&, const at::Device&, int64_t, const KernelArgs&);
  enum class Kind { Ptr, I64, I32, F32 };
  union Value {
    uint64_t ptr;
    int64_t i64;
    int32_t i32;
    float f32;
  };
  struct Arg {
    const char* name;
    Kind kind;
    Value value;
  };
  KernelArgs& add(const char* name, Kind kind, Value value) {
    args_.push_back(Arg{name, kind, value});
    return *this;
  }
  std::vector<Arg> args_;
};

// A field of a kernel's generated argument struct (kernel_args.h, from its SPEC): assigned once, from a value of
// exactly its type T (or `Also`: a flag's bool for an i32), any other type (an int64_t for an i32, a double for an
// fp32) a compile error; read at launch, where one never assigned is an error naming it.
template <typename T, typename Also = T>
class LaunchArg {
 public:
  LaunchArg& operator=(const T& value) {
    value_ = value;
    return *this;
  }
  template <typename U, std::enable_if_t<std::is_same_v<U, Also> && !std::is_same_v<U, T>, int> = 0>
  LaunchArg& operator=(U value) {
    value_ = static_cast<T>(value);
    return *this;
  }
  template <typename U, std::enable_if_t<!std::is_same_v<U, T> && !std::is_same_v<U, Also>, int> = 0>
  LaunchArg& operator=(U) = delete;
  const T& get(const char* kernel, const char* name) const {
    TORCH_CHECK(value_.has_value(), "fused_ce: a launch of ", kernel, " without its argument ", name);
    return *value_;
  }

 private:
  std::optional<T> value_;
};

// A pointer argument's tensor (kernel_args.h), checked to hold the elements of its SPEC type (`type`: "*T" the
// variant's dtype, "*fp32", "*i64", "*i32"); an undefined tensor passes (a null pointer).
const at::Tensor& pointee(const LaunchArg<at::Tensor>& arg, const char* type, const KernelVariant& variant,
                          const char* kernel, const char* name);

// The grid expressions' arithmetic (kernel_args.h).
inline int64_t launch_cdiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}
inline int64_t launch_min(int64_t a, int64_t b) {
  return a < b ? a : b;
}
inline int64_t launch_max(int64_t a, int64_t b) {
  return a > b ? a : b;
}

// Compute capability of a CUDA device as major * 10 + minor.
int device_arch(int device_index);
int device_sm_count(int device_index);

// True where FUSED_CE_DISABLE_KERNELS is set (read once).
bool cuda_kernels_disabled();
// The kernels' name of an input dtype (fused_ce/kernels/spec.py, DTYPES), nullptr for another.
const char* cuda_kernel_dtype(at::ScalarType t);
// The best embedded variant for a device of arch `arch`: the exact arch, else
// (below sm_90, whose cubins are arch-specific) the newest same-major one not
// newer than the device. nullptr when none fits.
const KernelVariant* find_variant(const char* kernel, const char* dtype, const char* layout, int arch);

// Whether torch's current stream of `device` is being captured into a CUDA graph
// (no host synchronisation allowed then).
bool stream_capturing(const at::Device& device);

// A zeroed int32 [1] on `device` in memory of the driver's own, outside torch's caching allocator (so never in a
// CUDA graph's private pool, which a tensor allocated during a capture or CUDA graph trees' warm-up would be
// in), never freed: a counter that outlives every graph that adds to it.
at::Tensor driver_allocated_counter(const at::Device& device);

// Launch `variant` with a 1-D grid on torch's current stream of `device`.
void launch(const KernelVariant& variant, const at::Device& device, int64_t grid, const KernelArgs& args);
// The same from a kernel's generated argument struct (kernel_args.h): its arguments packed and its SPEC's grid
// (`programs`: a grid-stride kernel's cap). `variant` must be one of that kernel's (or its flavors').
template <typename Args>
void launch(const KernelVariant& variant, const at::Device& device, const Args& args, int64_t programs = 0) {
  TORCH_CHECK(std::strncmp(variant.kernel, Args::kKernel, std::strlen(Args::kKernel)) == 0,
              "fused_ce: ", variant.kernel, " launched with the arguments of ", Args::kKernel);
  launch(variant, device, args.grid(variant, programs), args.pack(variant));
}

}  // namespace fused_ce
