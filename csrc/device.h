// What the plan knows of the device a call runs on, read once (device_facts) and passed down: the plan decides
// from it and asks the device nothing; the executors carry the plan out.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "kernel_table.h"

namespace fused_ce {

struct DeviceFacts {
  bool cuda = false;
  int arch = 0;  // the compute capability as major * 10 + minor (0 off CUDA)
  // Every stage has an embedded cubin for this device and input dtype, and the kernels are not disabled
  // (FUSED_CE_DISABLE_KERNELS): the rows run on the embedded kernels, else on ATen's stages.
  bool kernels = false;
  // The columns each partial of logit_partials covers (its general variant): a stored row's partials.
  int64_t partials_block_v = 0;
  // The architecture's plan constants (configs.ARCH_CONSTANTS, embedded by the build): its entry, else the
  // default's (arch 0).
  ArchConstants constants{};
  // A CPU without dot-product instructions in the input dtype (bfloat16: x86 without AVX512-BF16 or AMX-BF16;
  // float16: without AVX512-FP16 or AMX-FP16), where torch's products in it run up to ~80x slower than float32's:
  // the ATen path forms them in float32 instead (Plan::logits_product_dtype). FUSED_CE_CPU_FLOAT32_PRODUCTS=1 or
  // 0, read once, overrides the detection.
  bool float32_products = false;

  // Whether the per-row bookkeeping of `rows` rows runs in kernels (Plan::rows_on_device).
  bool row_kernels(int64_t rows) const { return kernels && rows > 0; }
};

// The facts of x's device for x's dtype (once per device and dtype; a warning, once, where the build has no
// kernel for a CUDA device and a kernel dtype).
DeviceFacts device_facts(const at::Tensor& x);
// device_facts' `kernels` of a device and dtype (the fake kernel's question: fused_ce/_fake.py).
bool cuda_kernels_embedded(const at::Device& device, at::ScalarType dtype);

}  // namespace fused_ce
