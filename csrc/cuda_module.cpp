// The Python module `rope_ext._C_cuda`: empty, like rope_ext._C. Importing it loads the CUDA
// kernels, whose static initializers register them for the CUDA key. A separate library so that
// rope_ext._C still loads under a CPU-only torch; rope_ext imports this one only where
// torch.version.cuda is set.
#include <Python.h>

PyMODINIT_FUNC PyInit__C_cuda(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C_cuda", "rope_ext native ops (CUDA)", -1,
                            nullptr};
  return PyModule_Create(&def);
}
