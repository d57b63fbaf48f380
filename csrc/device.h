// What the plan knows of the device a problem is on: whether the build embedded a kernel for every stage there
// (else the ATen stages run), and so whether the per-row bookkeeping runs in kernels.
#pragma once

#include <ATen/ATen.h>

#include "problem.h"

namespace fused_ce {

// Whether every stage has an embedded cubin for this device and input dtype (and the kernels are not disabled).
bool cuda_kernels_embedded(const at::Device& device, at::ScalarType dtype);
// The same for p's device and dtype.
bool cuda_kernels_available(const Problem& p);
// Whether the per-row bookkeeping runs in kernels (Plan::rows_on_device), known before the targets are
// prepared: p is on a device with a cubin for every stage (else a warning, once, where it would have been).
bool uses_row_kernels(const Problem& p);

}  // namespace fused_ce
