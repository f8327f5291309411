"""The shapes the benchmark runs, and one case's input tensors.

A case is T tokens of a query [T, Hq, D] and a key [T, Hk, D] (GQA: Hk = Hq / 4), with a value
[T, Hk, D] and paged KV caches for the fused op. Tables are float32, as models keep them:
cos/sin [T, 1, D/2] gathered for `apply`, cos_sin_cache [max_position, D] for the ops that take
positions. Positions are random (a batch of sequences at different offsets), seeded.
"""

from dataclasses import dataclass

import torch

import rope_ext
from rope_ext import reference


@dataclass(frozen=True)
class Shape:
    tokens: int
    q_heads: int
    kv_heads: int
    head_dim: int


def steady_norm_weight(size, dtype=torch.float32, device="cpu"):
    """A norm weight of random signs, magnitude 1, for benchmarks that call an in-place norm on
    the same tensors again and again: weights of other magnitudes would grow some dims and shrink
    the others geometrically, call after call, down to subnormal floats, which x86 CPUs compute
    about ten times slower (a timed 128-token prologue went from 0.2 to 2 ms in 40 calls)."""
    return (torch.randint(0, 2, (size,), device=device) * 2 - 1).to(dtype)


def _gqa(tokens, heads, head_dim=128):
    return Shape(tokens, heads, max(1, heads // 4), head_dim)


# CPU: decode, a case that fits the last-level cache, one that does not quite, and prefill.
# "fresh" (256 MiB fp32 outputs) is for docs/cpu-performance.md's page-fault measurements.
CPU_CASES = {
    "decode": _gqa(8, 32),
    "cache": _gqa(256, 32),
    "mid": _gqa(1024, 32),
    "prefill": _gqa(8192, 32),
    "fresh": _gqa(16384, 32),
}
CPU_DEFAULT = ("decode", "cache", "mid", "prefill")

CUDA_CASES = {
    "decode-1": _gqa(1, 32),
    "decode-16": _gqa(16, 32),
    "decode-64": _gqa(64, 32),
    "prefill": _gqa(8192, 32),
    "long": _gqa(131072, 8),
}
# The order of a run that a time budget may cut short: the cases that say most come first.
CUDA_DEFAULT = ("decode-64", "prefill", "long", "decode-1", "decode-16")

QUICK_CASES = {"tiny": Shape(4, 4, 2, 32)}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCK_SIZE = 16  # tokens per block of the paged KV cache


def cases_for(device):
    return CUDA_CASES if device == "cuda" else CPU_CASES


def default_cases(device):
    return CUDA_DEFAULT if device == "cuda" else CPU_DEFAULT


def mrope_section(head_dim):
    """Qwen2-VL's split of the rotary pairs (16, 24, 24 for head_dim 128), scaled to head_dim."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


class Inputs:
    """Every tensor one case's rows read or write, made once on `device`."""

    def __init__(self, shape, dtype, device, seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        T, Hq, Hk, D = shape.tokens, shape.q_heads, shape.kv_heads, shape.head_dim
        self.shape, self.dtype, self.device = shape, dtype, device

        def randn(*size):
            return torch.randn(size, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)

        self.q, self.k, self.v = randn(T, Hq, D), randn(T, Hk, D), randn(T, Hk, D)
        self.grad = randn(T, Hq, D)
        self.out = torch.empty_like(self.q)
        self.max_position = max(4096, T)
        self.cache = rope_ext.cos_sin_cache(self.max_position, D, device=device)  # float32
        self.positions = torch.randint(0, self.max_position, (T,), generator=g).to(device)
        self.positions3 = torch.randint(0, self.max_position, (3, T), generator=g).to(device)
        self.section = mrope_section(D)
        self.cos_t, self.sin_t = reference.cache_halves(self.cache)  # views, (P, D/2)
        self.cos = self.cos_t[self.positions, None].contiguous()  # [T, 1, D/2]
        self.sin = self.sin_t[self.positions, None].contiguous()
        # Paged KV cache with room for every token; each token gets its own slot, shuffled.
        blocks = (T + BLOCK_SIZE - 1) // BLOCK_SIZE + 1
        self.key_cache = torch.zeros(blocks, BLOCK_SIZE, Hk, D, dtype=dtype, device=device)
        self.value_cache = torch.zeros_like(self.key_cache)
        self.slots = torch.randperm(blocks * BLOCK_SIZE, generator=g)[:T].to(device)

    # Bytes as the memory limit sees them: every tensor read once, every result written once.
    def nbytes(self, t):
        return t.numel() * t.element_size()

    def table_bytes(self):
        """The float32 cos and sin values one call reads: rotary_dim per token."""
        return self.shape.tokens * self.shape.head_dim * 4
