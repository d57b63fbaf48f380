#include "cuda_driver.h"

#include <ATen/ops/from_blob.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "format.h"

namespace fused_ce {
namespace {

// The few driver API types and constants we use (from cuda.h, stable ABI).
using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;
using CUdeviceptr = uint64_t;                    // (cuda.h: unsigned long long, 64-bit)
constexpr int kAttrMultiprocessorCount = 16;     // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
constexpr int kAttrComputeCapabilityMajor = 75;  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
constexpr int kAttrComputeCapabilityMinor = 76;  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
constexpr int kAttrMaxSharedPerBlockOptin = 97;  // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
constexpr int kFuncAttrMaxDynamicShared = 8;     // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
constexpr int kDefaultSharedLimit = 48 * 1024;

struct Driver {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuFuncSetAttribute)(CUfunction, int, int);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                             void**, void**);
  CUresult (*cuStreamIsCapturing)(CUstream, int*);
  CUresult (*cuMemAlloc_v2)(CUdeviceptr*, size_t);
  CUresult (*cuMemsetD32Async)(CUdeviceptr, unsigned, size_t, CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
};

// Every driver entry point of Driver, bound by name when libcuda is loaded.
// clang-format off
#define FCE_DRIVER_SYMBOLS(X)                                                                       \
  X(cuInit) X(cuGetErrorName) X(cuGetErrorString) X(cuDeviceGet) X(cuDeviceGetAttribute)            \
  X(cuDevicePrimaryCtxRetain) X(cuCtxGetCurrent) X(cuCtxSetCurrent) X(cuModuleLoadData)             \
  X(cuModuleGetFunction) X(cuFuncSetAttribute) X(cuLaunchKernel) X(cuStreamIsCapturing)             \
  X(cuMemAlloc_v2) X(cuMemsetD32Async) X(cuStreamSynchronize)
// clang-format on

template <typename F>
void bind(void* lib, F& fn, const char* name) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  TORCH_CHECK(fn != nullptr, "fused_ce: libcuda has no symbol ", name);
}

const Driver& driver() {
  static const Driver d = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(lib != nullptr, "fused_ce: cannot load the CUDA driver library libcuda.so.1: ", dlerror());
    Driver d{};
#define FCE_BIND(name) bind(lib, d.name, #name);
    FCE_DRIVER_SYMBOLS(FCE_BIND)
#undef FCE_BIND
    return d;
  }();
  return d;
}

void check(CUresult result, const char* call) {
  if (result == 0) return;
  const char* name = "?";
  const char* text = "?";
  driver().cuGetErrorName(result, &name);
  driver().cuGetErrorString(result, &text);
  TORCH_CHECK(false, "fused_ce: CUDA driver call ", call, " failed with ", name, " (", num(result), "): ", text);
}

#define FCE_CU(call) check(driver().call, #call)

CUdevice cu_device(int index) {
  static std::once_flag init;
  std::call_once(init, [] { FCE_CU(cuInit(0)); });
  CUdevice dev;
  FCE_CU(cuDeviceGet(&dev, index));
  return dev;
}

int attribute(int device_index, int attr) {
  int value = 0;
  FCE_CU(cuDeviceGetAttribute(&value, attr, cu_device(device_index)));
  return value;
}

// Makes the device's primary context (the one torch's runtime uses) current.
void make_context_current(int device_index) {
  static std::mutex mutex;
  static std::map<int, CUcontext> contexts;
  CUcontext ctx;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = contexts.find(device_index);
    if (it == contexts.end()) {
      FCE_CU(cuDevicePrimaryCtxRetain(&ctx, cu_device(device_index)));
      contexts.emplace(device_index, ctx);
    } else {
      ctx = it->second;
    }
  }
  CUcontext current = nullptr;
  FCE_CU(cuCtxGetCurrent(&current));
  if (current != ctx) FCE_CU(cuCtxSetCurrent(ctx));
}

// One loaded function per (device, variant), loaded on first use.
CUfunction function_for(const KernelVariant& v, int device_index) {
  static std::mutex mutex;
  static std::map<std::pair<int, const KernelVariant*>, CUfunction> functions;
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_pair(device_index, &v);
  auto it = functions.find(key);
  if (it != functions.end()) return it->second;
  CUmodule module;
  FCE_CU(cuModuleLoadData(&module, v.cubin_begin));
  CUfunction fn;
  FCE_CU(cuModuleGetFunction(&fn, module, v.function));
  if (v.shared_bytes > kDefaultSharedLimit) {
    const int limit = attribute(device_index, kAttrMaxSharedPerBlockOptin);
    TORCH_CHECK(v.shared_bytes <= limit, "fused_ce: kernel ", v.kernel, " (sm_", num(v.arch), ") needs ",
                num(v.shared_bytes), " bytes of shared memory; device ", num(device_index), " allows ", num(limit));
    FCE_CU(cuFuncSetAttribute(fn, kFuncAttrMaxDynamicShared, v.shared_bytes));
  }
  functions.emplace(key, fn);
  return fn;
}

}  // namespace

KernelArgs& KernelArgs::ptr(const char* name, const at::Tensor& t) {
  Value v{};
  v.ptr = t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0;
  return add(name, Kind::Ptr, v);
}
KernelArgs& KernelArgs::i64(const char* name, int64_t value) {
  Value v{};
  v.i64 = value;
  return add(name, Kind::I64, v);
}
KernelArgs& KernelArgs::i32(const char* name, int32_t value) {
  Value v{};
  v.i32 = value;
  return add(name, Kind::I32, v);
}
KernelArgs& KernelArgs::f32(const char* name, float value) {
  Value v{};
  v.f32 = value;
  return add(name, Kind::F32, v);
}

int device_arch(int device_index) {
  return attribute(device_index, kAttrComputeCapabilityMajor) * 10 +
         attribute(device_index, kAttrComputeCapabilityMinor);
}

int device_sm_count(int device_index) {
  return attribute(device_index, kAttrMultiprocessorCount);
}

bool cuda_kernels_disabled() {
  static const bool disabled = [] {
    const char* value = std::getenv("FUSED_CE_DISABLE_KERNELS");
    return value != nullptr && *value != '\0' && std::strcmp(value, "0") != 0;
  }();
  return disabled;
}

const char* cuda_kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "bf16";
    case at::kHalf: return "fp16";
    case at::kFloat: return "fp32";
    default: return nullptr;
  }
}

const at::Tensor& pointee(const LaunchArg<at::Tensor>& arg, const char* type, const KernelVariant& variant,
                          const char* kernel, const char* name) {
  const at::Tensor& t = arg.get(kernel, name);
  if (!t.defined()) return t;
  const char* held = cuda_kernel_dtype(t.scalar_type());
  const char* wanted = std::strcmp(type, "*T") == 0 ? variant.dtype : type + 1;
  const bool fits = std::strcmp(wanted, "i64") == 0   ? t.scalar_type() == at::kLong
                    : std::strcmp(wanted, "i32") == 0 ? t.scalar_type() == at::kInt
                                                      : held != nullptr && std::strcmp(held, wanted) == 0;
  TORCH_CHECK(fits, "fused_ce: ", kernel, " argument ", name, " points to ", wanted, " but is given a ",
              c10::toString(t.scalar_type()), " tensor");
  return t;
}

const KernelVariant* find_variant(const char* kernel, const char* dtype, const char* layout, int arch) {
  const KernelVariant* best = nullptr;
  for (int i = 0; i < kNumKernelVariants; ++i) {
    const KernelVariant& v = kKernelVariants[i];
    if (std::strcmp(v.kernel, kernel) || std::strcmp(v.dtype, dtype) || std::strcmp(v.layout, layout)) continue;
    if (v.arch == arch) return &v;
    const bool compatible = arch < 90 && v.arch / 10 == arch / 10 && v.arch < arch;
    if (compatible && (best == nullptr || v.arch > best->arch)) best = &v;
  }
  return best;
}

bool stream_capturing(const at::Device& device) {
  c10::DeviceGuard guard(device);
  make_context_current(device.index());
  c10::impl::VirtualGuardImpl impl(device.type());
  int status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE
  const CUresult result =
      driver().cuStreamIsCapturing(static_cast<CUstream>(impl.getStream(device).native_handle()), &status);
  // An error here (the legacy stream queried while another stream captures globally) means a capture is
  // under way too: no host read either way.
  return result != 0 || status != 0;
}

at::Tensor driver_allocated_counter(const at::Device& device) {
  c10::DeviceGuard guard(device);
  make_context_current(device.index());
  CUdeviceptr ptr = 0;
  FCE_CU(cuMemAlloc_v2(&ptr, sizeof(int32_t)));
  // zeroed by a memset, not an ATen kernel (whose first launch in a process costs milliseconds: LOG step 10), and
  // waited for, so that every stream sees the zero
  c10::impl::VirtualGuardImpl impl(device.type());
  auto stream = static_cast<CUstream>(impl.getStream(device).native_handle());
  FCE_CU(cuMemsetD32Async(ptr, 0, 1, stream));
  FCE_CU(cuStreamSynchronize(stream));
  return at::from_blob(reinterpret_cast<void*>(ptr), {1}, [](void*) {}, at::device(device).dtype(at::kInt));
}

void launch(const KernelVariant& v, const at::Device& device, int64_t grid, const KernelArgs& args) {
  TORCH_CHECK(grid > 0 && grid < (int64_t{1} << 31), "fused_ce: grid of ", num(grid), " programs is out of range");
  const int index = device.index();
  c10::DeviceGuard guard(device);
  make_context_current(index);
  CUfunction fn = function_for(v, index);

  std::vector<void*> params;
  params.reserve(v.num_params + v.num_extra_params);
  for (int i = 0; i < v.num_params; ++i) {
    const char* name = v.param_names[i];
    const char* type = v.param_types[i];
    const KernelArgs::Arg* found = nullptr;
    for (const auto& a : args.args_) {
      if (std::strcmp(a.name, name) == 0) found = &a;
    }
    TORCH_CHECK(found != nullptr, "fused_ce: kernel ", v.kernel, " expects argument ", name,
                " that the launcher does not pass (kernel table out of date?)");
    using Kind = KernelArgs::Kind;
    const Kind expected = type[0] == '*'                   ? Kind::Ptr
                          : std::strcmp(type, "i64") == 0  ? Kind::I64
                          : std::strcmp(type, "i32") == 0  ? Kind::I32
                          : std::strcmp(type, "fp32") == 0 ? Kind::F32
                                                           : Kind::Ptr;
    TORCH_CHECK(found->kind == expected && (type[0] == '*' || expected != Kind::Ptr), "fused_ce: kernel ", v.kernel,
                " argument ", name, " has triton type ", type, " but the launcher passes another type");
    params.push_back(const_cast<void*>(static_cast<const void*>(&found->value)));
  }
  static const uint64_t null_scratch = 0;
  for (int i = 0; i < v.num_extra_params; ++i) {
    params.push_back(const_cast<uint64_t*>(&null_scratch));
  }

  c10::impl::VirtualGuardImpl impl(device.type());
  auto stream = static_cast<CUstream>(impl.getStream(device).native_handle());
  FCE_CU(cuLaunchKernel(fn, static_cast<unsigned>(grid), 1, 1, 32 * v.num_warps, 1, 1, v.shared_bytes, stream,
                        params.data(), nullptr));
}

}  // namespace fused_ce
