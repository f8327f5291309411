// The end of an ISA file's target switch (isa_target_begin.h): the code after it is baseline
// again.
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
