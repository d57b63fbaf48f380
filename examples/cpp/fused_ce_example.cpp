// fused_ce from C++: load the op library (it registers fused_ce::linear_cross_entropy with torch's
// dispatcher), call the op, run the backward through libtorch's autograd, print the loss and the
// gradients' norms. tests/test_cpp_example.py builds this and compares with Python.
#include <dlfcn.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <optional>
#include <tuple>

// The op's schema (csrc/ops.cpp): input, linear_weight, target, linear_bias, weight, reduction,
// ignore_index, label_smoothing, z_loss, softcap, logit_scale, workspace_bytes -> (loss, lse).
using LinearCrossEntropy = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const std::optional<at::Tensor>&,
                                                              const std::optional<at::Tensor>&, c10::string_view,
                                                              int64_t, double, double, std::optional<double>, double,
                                                              std::optional<int64_t>);

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr,
                 "usage: %s PATH_OF_FUSED_CE_LIBRARY (python -c 'import fused_ce; print(fused_ce.library_path())')\n",
                 argv[0]);
    return 2;
  }
  if (dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::fprintf(stderr, "cannot load %s: %s\n", argv[1], dlerror());
    return 1;
  }
  torch::manual_seed(0);
  const int64_t N = 64, D = 32, V = 1000;
  const at::Tensor x = torch::randn({N, D}).requires_grad_();
  const at::Tensor w = (torch::randn({V, D}) / std::sqrt(static_cast<double>(D))).requires_grad_();
  at::Tensor target = torch::randint(0, V, {N});
  target.index_put_({0}, -100);  // an ignored row
  auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fused_ce::linear_cross_entropy", "").typed<LinearCrossEntropy>();
  const auto [loss, lse] = op.call(x, w, target, std::nullopt, std::nullopt, "mean", -100, /*label_smoothing=*/0.1,
                                   /*z_loss=*/1e-3, std::nullopt, 1.0, std::nullopt);
  loss.backward();
  std::printf("loss %.9g\nlse_sum %.9g\ngrad_input_norm %.9g\ngrad_weight_norm %.9g\n", loss.item<double>(),
              lse.sum().item<double>(), x.grad().norm().item<double>(), w.grad().norm().item<double>());
  return 0;
}
