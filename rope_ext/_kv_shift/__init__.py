"""The K-shift op's Python side: its checks (mirroring csrc/ops/kv_shift/checks.h) and reference.
The public function is rope_ext.kv_shift.shift_kv_cache_."""
