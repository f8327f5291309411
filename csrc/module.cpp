// The Python module `rope_ext._C`: empty. Importing it loads this shared library, whose static
// initializers register the ops with the dispatcher. Built against the limited API (abi3), so
// one binary serves every Python >= 3.10.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "rope_ext native ops (CPU)", -1, nullptr};
  return PyModule_Create(&def);
}
