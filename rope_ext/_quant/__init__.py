"""The RoPE + FP8 quantization ops' Python side: argument checks (mirroring
csrc/ops/quant/checks.h), the reference, fake kernels and in-place bookkeeping. The public
functions are rope_ext.compat.flashinfer's."""
