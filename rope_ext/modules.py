"""nn.Module wrapper: holds the cos/sin table and rotates query/key by positions."""

import torch

from . import _checks
from .cache import cos_sin_cache
from .ops import apply_rope


class RotaryEmbedding(torch.nn.Module):
    """RoPE for attention: forward(query, key, positions) returns rotated copies of query
    (..., Hq, head_dim) and key (..., Hk, head_dim) (key may be None), differentiable.

    The table is a non-persistent float32 buffer; it follows the module across devices but keeps
    its float32 precision when the module is cast to a lower precision (RoPE tables in bf16/fp16
    cost model quality).
    """

    def __init__(self, head_dim, *, rotary_dim=None, max_position=8192, base=10000.0,
                 interleaved=False):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < rotary_dim <= head_dim:
            raise ValueError(f"RotaryEmbedding: rotary_dim must be in (0, head_dim={head_dim}], got {rotary_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.base = base
        self.interleaved = interleaved
        self.register_buffer("cos_sin_cache", self._table(None), persistent=False)

    def _table(self, device):
        return cos_sin_cache(self.max_position, self.rotary_dim, base=self.base,
                             dtype=torch.float32, device=device)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.cos_sin_cache.dtype != torch.float32:  # a dtype cast: rebuild exactly in float32
            self.cos_sin_cache = self._table(self.cos_sin_cache.device)
        return self

    def extra_repr(self):
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
                f"max_position={self.max_position}, base={self.base}, interleaved={self.interleaved}")

    def forward(self, query, key, positions):
        _checks.check_apply_inplace(query, key, positions, self.cos_sin_cache)
        if not torch.compiler.is_compiling():
            _checks.check_positions_in_range(positions, self.max_position, op="RotaryEmbedding")
        half = self.rotary_dim // 2
        rows = self.cos_sin_cache[positions].unsqueeze(-2)  # (..., 1, rotary_dim)
        cos, sin = rows[..., :half], rows[..., half:]
        q = apply_rope(query, cos, sin, interleaved=self.interleaved)
        k = None if key is None else apply_rope(key, cos, sin, interleaved=self.interleaved)
        return q, k
