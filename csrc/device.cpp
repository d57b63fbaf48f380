#include "device.h"

#include <ATen/cpu/Utils.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_driver.h"
#include "format.h"

namespace fused_ce {

namespace {

// The kernels the build embedded in a dtype ("bf16", ...), on any architecture: read off the table once.
const std::vector<const char*>& kernels_in_dtype(const char* dtype) {
  static const auto table = [] {
    std::map<std::string, std::vector<const char*>> kernels;
    for (int i = 0; i < kNumKernelVariants; ++i) {
      const KernelVariant& v = kKernelVariants[i];
      std::vector<const char*>& names = kernels[v.dtype];
      if (std::none_of(names.begin(), names.end(), [&](const char* k) { return std::strcmp(k, v.kernel) == 0; }))
        names.push_back(v.kernel);
    }
    return kernels;
  }();
  static const std::vector<const char*> none;
  const auto it = table.find(dtype);
  return it == table.end() ? none : it->second;
}

const ArchConstants& arch_constants(int arch) {
  const ArchConstants* fallback = nullptr;
  for (int i = 0; i < kNumArchConstants; ++i) {
    if (kArchConstants[i].arch == arch) return kArchConstants[i];
    if (kArchConstants[i].arch == 0) fallback = &kArchConstants[i];
  }
  TORCH_CHECK(fallback != nullptr, "fused_ce: the build embedded no plan constants");
  return *fallback;
}

// DeviceFacts::float32_products of a CPU for bfloat16 or float16 inputs. Other architectures than x86-64 keep
// the input dtype's products (their bf16 paths go through oneDNN or the Arm libraries, not measured here).
bool cpu_float32_products(at::ScalarType dtype) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return false;
  static const char* forced = std::getenv("FUSED_CE_CPU_FLOAT32_PRODUCTS");
  if (forced != nullptr && *forced != '\0') return std::strcmp(forced, "0") != 0;
  static const auto capabilities = at::cpu::get_cpu_capabilities();
  const auto has = [&](const char* name) {
    const auto it = capabilities.find(name);
    return it != capabilities.end() && it->second.isBool() && it->second.toBool();
  };
  const auto architecture = capabilities.find("architecture");
  if (architecture == capabilities.end() || !architecture->second.isString() ||
      architecture->second.toStringRef() != "x86_64") {
    return false;
  }
  return dtype == at::kBFloat16 ? !has("avx512_bf16") && !has("amx_bf16") : !has("avx512_fp16") && !has("amx_fp16");
}

DeviceFacts read_facts(const at::Device& device, at::ScalarType dtype) {
  DeviceFacts facts;
  facts.cuda = device.is_cuda();
  facts.float32_products = device.is_cpu() && cpu_float32_products(dtype);
  facts.arch = facts.cuda ? device_arch(device.index()) : 0;
  facts.constants = arch_constants(facts.arch);
  const char* name = cuda_kernel_dtype(dtype);
  if (!facts.cuda || name == nullptr || cuda_kernels_disabled()) return facts;
  // every kernel the build embedded in this dtype for any architecture (configs.KERNELS and their flavors, as
  // the generated kernel table lists them), for this one
  facts.kernels = find_variant("prepare_rows", "fp32", "general", facts.arch) != nullptr &&
                  find_variant("assemble_loss", "fp32", "general", facts.arch) != nullptr;
  for (const char* kernel : kernels_in_dtype(name)) {
    facts.kernels = facts.kernels && find_variant(kernel, name, "general", facts.arch) != nullptr;
  }
  if (facts.kernels) facts.partials_block_v = find_variant("logit_partials", name, "general", facts.arch)->block_v;
  return facts;
}

// read_facts once per device and dtype.
DeviceFacts facts_of(const at::Device& device, at::ScalarType dtype) {
  static std::mutex mutex;
  static std::map<std::tuple<at::DeviceType, int, at::ScalarType>, DeviceFacts> known;
  const auto key = std::make_tuple(device.type(), static_cast<int>(device.index()), dtype);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(key);
  return it != known.end() ? it->second : known.emplace(key, read_facts(device, dtype)).first->second;
}

}  // namespace

DeviceFacts device_facts(const at::Tensor& x) {
  const DeviceFacts facts = facts_of(x.device(), x.scalar_type());
  const bool kernel_dtype = cuda_kernel_dtype(x.scalar_type()) != nullptr;
  if (facts.cuda && !facts.kernels && kernel_dtype && !cuda_kernels_disabled() && x.numel() > 0) {
    TORCH_WARN_ONCE("fused_ce: this build has no kernel for sm_", num(facts.arch),
                    "; using the slower chunked ATen path on CUDA. Rebuild with this architecture in "
                    "FUSED_CE_CUDA_ARCHS (see fused_ce.cuda_archs()).");
  }
  return facts;
}

bool cuda_kernels_embedded(const at::Device& device, at::ScalarType dtype) {
  return device.is_cuda() && facts_of(device, dtype).kernels;
}

}  // namespace fused_ce
