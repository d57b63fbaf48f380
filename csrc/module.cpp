// `import fused_ce._C` loads this library; its static initialisers register the
// ops (ops.cpp). The module itself is empty, as in pytorch/extension-cpp.
#include <Python.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
