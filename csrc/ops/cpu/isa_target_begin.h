// The start of an ISA file's target switch: the code after it, up to isa_target_end.h, is
// compiled for ROPE_ISA_TARGET (the features, e.g. "avx2,fma,f16c"), which the file defines
// before including it. Include it below every header with external linkage (see kernel_api.h):
// nothing that another file could share may be compiled for these features.
#define ROPE_ISA_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define ROPE_ISA_PUSH(features) \
  ROPE_ISA_PRAGMA(clang attribute push(__attribute__((target(features))), apply_to = function))
ROPE_ISA_PUSH(ROPE_ISA_TARGET)
#else
#define ROPE_ISA_PUSH(features) ROPE_ISA_PRAGMA(GCC target(features))
#pragma GCC push_options
ROPE_ISA_PUSH(ROPE_ISA_TARGET)
#endif
