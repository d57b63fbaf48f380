// fused_ce from C++: load the op library (it registers fused_ce::linear_cross_entropy with torch's
// dispatcher), call the op, run the backward through libtorch's autograd, print the loss and the
// gradients' norms. tests/test_cpp_example.py builds this and compares with Python.
#include <dlfcn.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <string>

// The op's schema: input, linear_weight, target, linear_bias, weight, then the loss options of
// FUSED_CE_LOSS_OPTIONS in csrc/options.h (reduction, ignore_index, label_smoothing, z_loss, ...) -> (loss, lse).
// A boxed call fills the options this program does not set with the schema's defaults, so it keeps working when
// options are appended.
std::vector<c10::IValue> call(const c10::OperatorHandle& op, std::vector<c10::IValue> tensors,
                              const std::vector<std::pair<std::string, c10::IValue>>& options) {
  torch::jit::Stack stack = std::move(tensors);
  const auto& arguments = op.schema().arguments();
  for (size_t i = stack.size(); i < arguments.size(); ++i) stack.push_back(*arguments[i].default_value());
  for (const auto& [name, value] : options) {
    const auto index = op.schema().argumentIndexWithName(name);
    if (!index) throw std::runtime_error("the op has no argument " + name);
    stack[*index] = value;
  }
  op.callBoxed(&stack);
  return stack;
}

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
  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("fused_ce::linear_cross_entropy", "");
  const auto outputs = call(op, {x, w, target, c10::IValue(), c10::IValue()},
                            {{"label_smoothing", 0.1}, {"z_loss", 1e-3}});
  const at::Tensor loss = outputs[0].toTensor(), lse = outputs[1].toTensor();
  loss.backward();
  std::printf("loss %.9g\nlse_sum %.9g\ngrad_input_norm %.9g\ngrad_weight_norm %.9g\n", loss.item<double>(),
              lse.sum().item<double>(), x.grad().norm().item<double>(), w.grad().norm().item<double>());
  return 0;
}
