"""What the benchmark times: one zero-argument callable per implementation and case.

Every implementation moves the same bytes, x read once and a result of x's size written once
(2 * x.nbytes); the cos/sin tables are not counted (they are broadcast over the heads and stay
in cache). That makes "copy" (out.copy_(x) into a preallocated tensor) the bandwidth limit.
"""

import torch

import rope_ext
from rope_ext import reference

# name -> (label, what it is). The order is the table's column order.
IMPLS = {
    "copy": "out.copy_(x), preallocated out: the bandwidth limit",
    "clone": "x.clone(): a copy that allocates its output, as apply does",
    "apply": "torch.ops.rope.apply (new output)",
    "apply_out": "torch.ops.rope.apply.out into the preallocated out, as copy",
    "apply_": "torch.ops.rope.apply_ (in place, positions + cos_sin_cache)",
    "backward": "torch.ops.rope.apply_backward (new output)",
    "empty_op": "torch.ops.rope.apply on zero rows: the fixed cost of one op call",
    "eager_ref": "rope_ext.reference.apply_rope, eager",
    "eager_hf": "HF-style x*cos + rotate_half(x)*sin, eager",
    "compile_ref": "torch.compile(rope_ext.reference.apply_rope)",
    "compile_hf": "torch.compile of the HF-style rotate_half function",
}
COMPILED = ("compile_ref", "compile_hf")


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def hf_apply(x, cos, sin):
    """The HuggingFace Llama formulation, with full-width tables in x's dtype."""
    return x * cos + rotate_half(x) * sin


_compiled = {}


def compiled(name):
    if name not in _compiled:
        fn = reference.apply_rope if name == "compile_ref" else hf_apply
        _compiled[name] = torch.compile(fn, dynamic=False)
    return _compiled[name]


class Case:
    """Inputs of one shape [tokens, heads, head_dim] and dtype; tables in float32."""

    def __init__(self, name, shape, dtype):
        self.name, self.shape, self.dtype = name, tuple(shape), dtype
        tokens, _, head_dim = shape
        self.x = torch.randn(shape, dtype=dtype)
        self.out = torch.empty_like(self.x)
        self.cache = rope_ext.cos_sin_cache(max(tokens, 1), head_dim)
        self.positions = torch.arange(tokens)
        half = head_dim // 2
        rows = self.cache[self.positions]
        self.cos = rows[:, :half].unsqueeze(1).contiguous()  # [T, 1, D/2], broadcast over heads
        self.sin = rows[:, half:].unsqueeze(1).contiguous()
        self.cos_full = torch.cat((self.cos, self.cos), -1).to(dtype)  # HF: [T, 1, D] in x's dtype
        self.sin_full = torch.cat((self.sin, self.sin), -1).to(dtype)
        self.x_empty = self.x[:0]
        self.cos_empty, self.sin_empty = self.cos[:0], self.sin[:0]

    @property
    def bytes(self):
        return 2 * self.x.numel() * self.x.element_size()

    def fn(self, impl):
        x, cos, sin, ops = self.x, self.cos, self.sin, torch.ops.rope
        table = {
            "copy": lambda: self.out.copy_(x),
            "clone": lambda: x.clone(),
            "apply": lambda: ops.apply(x, cos, sin, False),
            "apply_out": lambda: ops.apply.out(x, cos, sin, False, out=self.out),
            "apply_": lambda: ops.apply_(x, None, self.positions, self.cache, False),
            "backward": lambda: ops.apply_backward(x, cos, sin, False),
            "empty_op": lambda: ops.apply(self.x_empty, self.cos_empty, self.sin_empty, False),
            "eager_ref": lambda: reference.apply_rope(x, cos, sin),
            "eager_hf": lambda: hf_apply(x, self.cos_full, self.sin_full),
        }
        if impl in COMPILED:
            f = compiled(impl)
            if impl == "compile_ref":
                return lambda: f(x, cos, sin)
            return lambda: f(x, self.cos_full, self.sin_full)
        return table[impl]
