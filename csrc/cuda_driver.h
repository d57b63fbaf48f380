// Launching the embedded cubins through the CUDA driver API.
//
// libcuda is opened at run time (dlopen), so the library builds without the CUDA
// toolkit and imports on machines without a GPU. Modules load lazily, once per
// device and variant, under a lock; every driver error becomes a c10::Error.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
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

}  // namespace fused_ce
