// The host-side checks (rope_checks.cpp) compiled once more, into the CUDA library. A separate
// translation unit with its own name, because the CUDA build compiles with other flags and the
// two libraries share one build directory: one object per library keeps incremental builds from
// recompiling it back and forth.
#include "../rope_checks.cpp"
