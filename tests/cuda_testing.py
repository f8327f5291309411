"""Shared helpers of the CUDA tests (simulated and on a GPU).

Tolerances and comparisons come from conftest.py when it provides them, so that every test file
uses one definition; the fallback here keeps these tests runnable on their own.
"""

import torch

try:
    from conftest import TOL, assert_close  # noqa: F401
except ImportError:  # pragma: no cover - only without the project's conftest.py
    TOL = {
        torch.float64: (1e-12, 1e-12),
        torch.float32: (1e-6, 1e-6),
        torch.float16: (1e-3, 2e-3),
        torch.bfloat16: (1e-2, 1.6e-2),
    }

    def assert_close(actual, expected, dtype):
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def vec_width(dtype):
    """Elements per 16-byte vector access."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def tables(positions, rotary_dim, dtype=torch.float32, device="cpu"):
    """cos, sin of shape positions.shape + (rotary_dim/2,), in `dtype`."""
    import rope_ext

    cache = rope_ext.cos_sin_cache(int(positions.max()) + 1, rotary_dim, dtype=dtype, device=device)
    rows = cache[positions.long()]
    return rows[..., : rotary_dim // 2], rows[..., rotary_dim // 2 :]


def reference_apply(x, cos, sin, interleaved, inverse=False):
    """The float64 reference of rope.apply (inverse: apply_backward)."""
    import rope_ext

    f = rope_ext.reference.apply_rope_backward if inverse else rope_ext.reference.apply_rope
    return f(x.double(), cos.double(), sin.double(), interleaved=interleaved)


def reference_apply_(query, key, positions, cache, interleaved):
    """float64 copies of query and key rotated by the reference."""
    import rope_ext

    q = query.double().clone()
    k = None if key is None else key.double().clone()
    rope_ext.reference.apply_rope_(q, k, positions, cache.double(), interleaved=interleaved)
    return q, k


def fused_qkv(tokens, hq, hk, head_dim, dtype, device="cpu", lead=()):
    """query and key as strided views into one fused (..., tokens, (hq + 2*hk) * head_dim)
    buffer, the layout of a fused qkv projection."""
    qkv = torch.randn(*lead, tokens, (hq + 2 * hk) * head_dim, dtype=dtype, device=device)
    q = qkv[..., : hq * head_dim].unflatten(-1, (hq, head_dim))
    k = qkv[..., hq * head_dim : (hq + hk) * head_dim].unflatten(-1, (hk, head_dim))
    return q, k
