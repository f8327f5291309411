"""nn.Module wrapper: holds the cos/sin table and rotates query/key by positions."""

import torch

from . import _checks, reference
from .cache import cos_sin_cache
from .config import rope_kwargs_from_config
from .ops import apply_mrope_, apply_rope, apply_rope_


class RotaryEmbedding(torch.nn.Module):
    """RoPE for attention: forward(query, key, positions) returns rotated copies of query
    (..., Hq, head_dim) and key (..., Hk, head_dim) (key may be None), differentiable.

    scaling: a config's `rope_scaling` dict (see rope_ext.cos_sin_cache); seq_len: the length
    `dynamic`/`longrope` tables are built for (default max_position).
    mrope_section: 3 ints summing to rotary_dim/2 (Qwen2-VL); positions of shape
    (3,) + query.shape[:-2] then give each section its own position component, and positions of
    shape query.shape[:-2] (text only) stay plain RoPE.

    The table is a non-persistent float32 buffer; it follows the module across devices but keeps
    its float32 precision when the module is cast to a lower precision (RoPE tables in bf16/fp16
    cost model quality).
    """

    def __init__(self, head_dim, *, rotary_dim=None, max_position=8192, base=10000.0,
                 interleaved=False, scaling=None, seq_len=None, mrope_section=None):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < rotary_dim <= head_dim:
            raise ValueError(f"RotaryEmbedding: rotary_dim must be in (0, head_dim={head_dim}], got {rotary_dim}")
        if mrope_section is not None:
            mrope_section = [int(s) for s in mrope_section]
            if len(mrope_section) != 3 or min(mrope_section) < 0 or sum(mrope_section) != rotary_dim // 2:
                raise ValueError(
                    f"RotaryEmbedding: mrope_section must be 3 ints >= 0 summing to rotary_dim/2 = "
                    f"{rotary_dim // 2}, got {mrope_section}"
                )
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.base = base
        self.interleaved = interleaved
        self.scaling = None if scaling is None else dict(scaling)
        self.seq_len = seq_len
        self.mrope_section = mrope_section
        self.register_buffer("cos_sin_cache", self._table(None), persistent=False)

    @classmethod
    def from_config(cls, config, *, interleaved=None, max_position=None, seq_len=None):
        """Builds the module from a model config (a transformers-style config object or a dict):
        rope_theta, head_dim (or hidden_size / num_attention_heads), partial_rotary_factor,
        rope_scaling, max_position_embeddings. `interleaved` overrides the layout the config
        implies (see rope_ext.config.layout_from_config); `max_position` the table length."""
        kwargs = rope_kwargs_from_config(config, interleaved=interleaved, max_position=max_position)
        return cls(**kwargs, seq_len=seq_len)

    def _table(self, device):
        return cos_sin_cache(self.max_position, self.rotary_dim, base=self.base, scaling=self.scaling,
                             dtype=torch.float32, device=device, seq_len=self.seq_len)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.cos_sin_cache.dtype != torch.float32:  # a dtype cast: rebuild exactly in float32
            self.cos_sin_cache = self._table(self.cos_sin_cache.device)
        return self

    def extra_repr(self):
        s = (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
             f"max_position={self.max_position}, base={self.base}, interleaved={self.interleaved}")
        if self.scaling is not None:
            s += f", scaling={self.scaling}"
        if self.mrope_section is not None:
            s += f", mrope_section={self.mrope_section}"
        return s

    def _is_mrope(self, query, positions):
        return self.mrope_section is not None and positions.dim() == query.dim() - 1

    def forward(self, query, key, positions):
        if self._is_mrope(query, positions):
            _checks.check_mrope(query, key, positions, self.cos_sin_cache, self.mrope_section)
            if not torch.compiler.is_compiling():
                _checks.check_positions_in_range(positions, self.max_position, op="RotaryEmbedding")
            cos, sin = reference.mrope_tables(positions, self.cos_sin_cache, self.mrope_section)
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        else:
            _checks.check_apply_inplace(query, key, positions, self.cos_sin_cache)
            if not torch.compiler.is_compiling():
                _checks.check_positions_in_range(positions, self.max_position, op="RotaryEmbedding")
            half = self.rotary_dim // 2
            rows = self.cos_sin_cache[positions].unsqueeze(-2)  # (..., 1, rotary_dim)
            cos, sin = rows[..., :half], rows[..., half:]
        q = apply_rope(query, cos, sin, interleaved=self.interleaved)
        k = None if key is None else apply_rope(key, cos, sin, interleaved=self.interleaved)
        return q, k

    def forward_(self, query, key, positions):
        """In place, the inference path (rope.apply_ or rope.mrope_); returns (query, key)."""
        if self._is_mrope(query, positions):
            return apply_mrope_(query, key, positions, self.cos_sin_cache, self.mrope_section,
                                interleaved=self.interleaved)
        return apply_rope_(query, key, positions, self.cos_sin_cache, interleaved=self.interleaved)
