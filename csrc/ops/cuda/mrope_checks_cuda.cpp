// The rope.mrope_ host checks (mrope_checks.cpp) compiled once more, into the CUDA library, as
// rope_checks_cuda.cpp does for rope_checks.cpp (one object per library keeps incremental builds
// from recompiling it back and forth).
#include "../mrope_checks.cpp"
