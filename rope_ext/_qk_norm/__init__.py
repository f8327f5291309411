"""The fused QK-RMSNorm + RoPE ops' Python side: argument checks (mirroring
csrc/ops/qk_norm/checks.h), the reference, fake and autograd registrations. The public functions
are rope_ext.qk_norm."""
