"""Drop-in rows: each rope_ext.compat drop-in against its peer's own eager code path.

The peers' eager code comes from tests/peers.py (independent implementations with the peers'
names and layouts, the same ones tests/test_compat.py checks the drop-ins against). When that
module or rope_ext.compat cannot be imported, the drop-in rows are skipped with a printed note;
the rest of the benchmark is unaffected. Each pair gets the layout its peer takes, over the
case's tensors (views where the peer's layout is one, as models and serving stacks pass them).

The training stacks' drop-ins (Transformer Engine, the Llama reference, gpt-fast) are timed as
training steps, forward and backward, against the peers' PyTorch code as tests/training_peers.py
implements it independently (the same functions tests/test_te_compat.py and
tests/test_llama_gpt_fast_compat.py check the drop-ins against) and against rope_ext's op on the
same tensors with its tables ready (TRAINING_PAIRS, run by groups/dropins.py).
"""

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from .rows import Row, apply_bytes, cache_bytes, inplace_bytes, rw_bytes

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "tests")


def load():
    """((peers module, rope_ext.compat) or None, status line)."""
    if not os.path.exists(os.path.join(TESTS, "peers.py")):
        return None, "skipped: tests/peers.py is not present"
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    try:
        peers = importlib.import_module("peers")
        compat = importlib.import_module("rope_ext.compat")
    except Exception as e:  # noqa: BLE001 - reported, never fatal
        return None, f"skipped: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return (peers, compat), ("rope_ext.compat against the peers' code (transformers' own where "
                             "installed, else tests/peers.py's)")


def _hf(i, peers, compat):
    """transformers' apply_rotary_pos_emb: q, k (batch, heads, seq, head_dim) as the attention
    module's transpose makes them, cos/sin (batch, seq, head_dim) in the activations' dtype.
    The peer is transformers' own Llama function where transformers is installed (tests/peers.py's
    also passes a partial rotary's tail through: a concatenation Llama's does not make)."""
    q, k = i.q.unsqueeze(0).transpose(1, 2), i.k.unsqueeze(0).transpose(1, 2)
    cos = torch.cat((i.cos[:, 0], i.cos[:, 0]), -1).unsqueeze(0).to(i.dtype)
    sin = torch.cat((i.sin[:, 0], i.sin[:, 0]), -1).unsqueeze(0).to(i.dtype)
    n = rw_bytes(i, i.q, i.k) + 2 * i.nbytes(cos)
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as theirs
        peer = "transformers.models.llama.apply_rotary_pos_emb"
    except ImportError:
        theirs, peer = peers.hf_apply_rotary_pos_emb, "hf_apply_rotary_pos_emb"
    return ("transformers.apply_rotary_pos_emb", "clone", n,
            lambda: compat.transformers.apply_rotary_pos_emb(q, k, cos, sin),
            peer, lambda: theirs(q, k, cos, sin))


def _hf_family(fn_name, peer_name, table):
    """Another transformers family's apply_rotary_pos_emb (q, k as _hf's), its cos/sin made from
    the case's angles as that family's rotary module lays them out (`table`)."""
    def make(i, peers, compat):
        q, k = i.q.unsqueeze(0).transpose(1, 2), i.k.unsqueeze(0).transpose(1, 2)
        cos, sin = (table(t[:, 0]).unsqueeze(0).to(i.dtype) for t in (i.cos, i.sin))
        ours, theirs = getattr(compat.transformers, fn_name), getattr(peers, peer_name)
        return (f"transformers.{fn_name}", "clone", rw_bytes(i, i.q, i.k) + 2 * i.nbytes(cos),
                lambda: ours(q, k, cos, sin), peer_name, lambda: theirs(q, k, cos, sin))
    make.__name__ = "_" + fn_name
    return make


def _halves(t):
    return torch.cat((t, t), -1)


def _flash_attn(i, peers, compat):
    """flash-attn's apply_rotary_emb: x (batch, seqlen, heads, head_dim), cos/sin (seqlen,
    rotary_dim/2) float32, positions 0.. (no offsets); its eager path is apply_rotary_emb_torch."""
    x = i.q.unsqueeze(0)
    T = i.shape.tokens
    cos, sin = i.cos_t[:T].contiguous(), i.sin_t[:T].contiguous()
    return ("flash_attn.apply_rotary_emb", "clone", apply_bytes(i),
            lambda: compat.flash_attn.apply_rotary_emb(x, cos, sin),
            "fa_apply_rotary_emb_torch", lambda: peers.fa_apply_rotary_emb_torch(x, cos, sin))


def _flash_attn_qkv(i, peers, compat):
    """flash-attn's apply_rotary_emb_qkv_: Q and K of a fused GQA qkv (batch, seqlen,
    num_heads_q + 2 * num_heads_k, head_dim) rotated in place, positions 0.."""
    hq, T = i.q.shape[1], i.shape.tokens
    qkv = torch.cat((i.q, i.k, i.k), dim=1).unsqueeze(0)  # the last Hk heads: V, untouched
    cos, sin = i.cos_t[:T].contiguous(), i.sin_t[:T].contiguous()
    return ("flash_attn.apply_rotary_emb_qkv_", "copy", rw_bytes(i, i.q, i.k) + i.table_bytes(),
            lambda: compat.flash_attn.apply_rotary_emb_qkv_(qkv, cos, sin, num_heads_q=hq),
            "fa_apply_rotary_emb_qkv_",
            lambda: peers.fa_apply_rotary_emb_qkv_(qkv, cos, sin, num_heads_q=hq))


def _flat(i):
    T = i.shape.tokens
    return i.q.view(T, -1), i.k.view(T, -1), i.shape.head_dim


def _vllm(i, peers, compat):
    """vLLM's rotary_embedding: flat q/k (tokens, heads * head_size), in place."""
    q, k, d = _flat(i)
    return ("vllm.rotary_embedding", "copy", inplace_bytes(i, i.positions),
            lambda: compat.vllm.rotary_embedding(i.positions, q, k, d, i.cache, True),
            "vllm_rotary_embedding",
            lambda: peers.vllm_rotary_embedding(i.positions, q, k, d, i.cache, True))


def _flashinfer(i, peers, compat):
    q, k, d = _flat(i)
    return ("flashinfer.apply_rope_with_cos_sin_cache_inplace", "copy",
            inplace_bytes(i, i.positions),
            lambda: compat.flashinfer.apply_rope_with_cos_sin_cache_inplace(
                i.positions, q, k, d, i.cache, True),
            "flashinfer_apply_rope_with_cos_sin_cache_inplace",
            lambda: peers.flashinfer_apply_rope_with_cos_sin_cache_inplace(
                i.positions, q, k, d, i.cache, True))


def _sglang(i, peers, compat):
    """SGLang's rope with the fused KV-buffer store: token slots (num_slots, heads * head_size)."""
    q, k, d = _flat(i)
    T = i.shape.tokens
    v = i.v.view(T, -1)
    kb = i.key_cache.view(-1, i.key_cache.shape[2] * i.key_cache.shape[3])
    vb = i.value_cache.view(-1, i.value_cache.shape[2] * i.value_cache.shape[3])
    arg = compat.sglang.FusedSetKVBufferArg(v, kb, vb, None, None, i.slots)  # the peer's record
    return ("sglang.apply_rope_with_cos_sin_cache_inplace+kv", "copy", cache_bytes(i),
            lambda: compat.sglang.apply_rope_with_cos_sin_cache_inplace(
                i.positions, q, k, d, i.cache, True, fused_set_kv_buffer_arg=arg),
            "sglang_apply_rope_with_cos_sin_cache_inplace",
            lambda: peers.sglang_apply_rope_with_cos_sin_cache_inplace(
                i.positions, q, k, d, i.cache, True, fused_set_kv_buffer_arg=arg))


PAIRS = (_hf,
         _hf_family("apply_rotary_pos_emb_glm", "hf_glm_apply_rotary_pos_emb", _halves),
         _hf_family("apply_rotary_pos_emb_cohere", "hf_cohere_apply_rotary_pos_emb",
                    lambda t: t.repeat_interleave(2, -1)),
         _hf_family("apply_rotary_pos_emb_interleave", "hf_deepseek_apply_rotary_pos_emb_interleave",
                    _halves),
         _hf_family("apply_rotary_pos_emb_half_tables", "hf_gpt_oss_apply_rotary_pos_emb",
                    lambda t: t),
         _flash_attn, _flash_attn_qkv, _vllm, _flashinfer, _sglang)


def rows(loaded, inputs):
    """(rows, notes) for one case: two rows per drop-in (ours, the peer's eager path); a pair
    whose set-up fails is noted and left out."""
    peers, compat = loaded
    out, notes = [], []
    for make in PAIRS:
        try:
            op, limit, n, ours, peer_name, theirs = make(inputs, peers, compat)
        except Exception as e:  # noqa: BLE001 - a missing function in one peer skips that pair
            notes.append(f"drop-in {make.__name__[1:]} skipped ({type(e).__name__}: {e})")
            continue
        op = "compat." + op
        out.append(Row(op, "dropin", op, f"rope_ext.{op}", n, ours, limit))
        out.append(Row(f"{op} eager", "eager", op, peer_label(peer_name), n, theirs, limit))
    return out, notes


def peer_label(peer_name):
    """Where a peer's code comes from: its own package (a dotted name), or tests/peers.py."""
    return peer_name if "." in peer_name else f"tests/peers.py {peer_name}"


# ---- training stacks: forward + backward steps ------------------------------------------------

def load_training():
    """((tests/training_peers.py, rope_ext.compat) or None, status line)."""
    if not os.path.exists(os.path.join(TESTS, "training_peers.py")):
        return None, "skipped: tests/training_peers.py is not present"
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    try:
        peers = importlib.import_module("training_peers")
        compat = importlib.import_module("rope_ext.compat")
    except Exception as e:  # noqa: BLE001 - reported, never fatal
        return None, f"skipped: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return (peers, compat), "rope_ext.compat against tests/training_peers.py"


def _leaf(shape, dtype, g):
    return torch.randn(shape, generator=g).to(dtype).requires_grad_()


@dataclass
class _step:
    """A training step's RoPE part, called with no arguments: forward, then backward with the
    given output gradients; the leaves' gradients are dropped so that every call allocates as
    the first did."""

    forward: Callable
    leaves: list
    grads: tuple

    def __call__(self):
        torch.autograd.backward(self.forward(), self.grads)
        for t in self.leaves:
            t.grad = None


def _placed(table, at):
    """A (rows, D/2) float32 table placed against x: at="sbhd" (rows, 1, 1, D/2), "bshd" (1,
    rows, 1, D/2), "thd" (rows, 1, D/2); contiguous, as a caller keeping the op's tables ready."""
    view = {"sbhd": (slice(None), None, None), "bshd": (None, slice(None), None),
            "thd": (slice(None), None)}[at]
    return table[view].float().contiguous()


def _te_sbhd(size, dtype, peers, compat, g):
    """TE's apply_rotary_pos_emb, t sbhd [s, b, h, d], angles from RotaryPositionEmbedding."""
    te = compat.transformer_engine
    b, s, h, _, d = size
    t = _leaf((s, b, h, d), dtype, g)
    grads = (torch.randn(t.shape, generator=g).to(dtype),)
    freqs = te.RotaryPositionEmbedding(d)(s).cpu()
    cos, sin = (_placed(f(freqs[:, 0, 0, : d // 2]), "sbhd") for f in (torch.cos, torch.sin))
    return ("transformer_engine.apply_rotary_pos_emb sbhd", "te_apply_rotary_pos_emb",
            _step(lambda: (te.apply_rotary_pos_emb(t, freqs, "sbhd"),), [t], grads),
            _step(lambda: (peers.te_apply_rotary_pos_emb(t, freqs, "sbhd"),), [t], grads),
            _step(lambda: (torch.ops.rope.apply(t, cos, sin, False),), [t], grads))


def _te_thd(size, dtype, peers, compat, g):
    """TE's packed format: the batch's tokens as b sequences of unequal lengths (thd)."""
    te = compat.transformer_engine
    b, s, h, _, d = size
    lengths = [s + s // 2 * (i % 2 * 2 - 1) if b > 1 else s for i in range(b)]  # s/2, 3s/2, ...
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    t = _leaf((sum(lengths), h, d), dtype, g)
    grads = (torch.randn(t.shape, generator=g).to(dtype),)
    freqs = te.RotaryPositionEmbedding(d)(max(lengths)).cpu()
    pos = torch.cat([torch.arange(n) for n in lengths])
    cos, sin = (_placed(f(freqs[pos, 0, 0, : d // 2]), "thd") for f in (torch.cos, torch.sin))
    return ("transformer_engine.apply_rotary_pos_emb thd", "te_apply_rotary_pos_emb",
            _step(lambda: (te.apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu),), [t], grads),
            _step(lambda: (peers.te_apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu),), [t],
                  grads),
            _step(lambda: (torch.ops.rope.apply(t, cos, sin, False),), [t], grads))


def _qk(size, dtype, g):
    b, s, h, hk, d = size
    q, k = _leaf((b, s, h, d), dtype, g), _leaf((b, s, hk, d), dtype, g)
    grads = tuple(torch.randn(x.shape, generator=g).to(dtype) for x in (q, k))
    return q, k, grads


def _llama(size, dtype, peers, compat, g):
    """The Llama reference's apply_rotary_emb(xq, xk, freqs_cis): GQA keys, a complex table."""
    llama = compat.llama
    q, k, grads = _qk(size, dtype, g)
    fc = llama.precompute_freqs_cis(size[4], size[1])
    cos, sin = (_placed(p, "bshd") for p in torch.view_as_real(fc).unbind(-1))
    ops = torch.ops.rope
    return ("llama.apply_rotary_emb", "llama_apply_rotary_emb",
            _step(lambda: llama.apply_rotary_emb(q, k, fc), [q, k], grads),
            _step(lambda: peers.llama_apply_rotary_emb(q, k, fc), [q, k], grads),
            _step(lambda: (ops.apply(q, cos, sin, True), ops.apply(k, cos, sin, True)), [q, k], grads))


def _gpt_fast(size, dtype, peers, compat, g):
    """gpt-fast's apply_rotary_emb(x, freqs_cis), called for q and for k as its attention does,
    with its bfloat16 cache."""
    gf = compat.gpt_fast
    q, k, grads = _qk(size, dtype, g)
    cache = gf.precompute_freqs_cis(size[1], size[4])
    cos, sin = (_placed(p, "bshd") for p in cache.unbind(-1))
    ops = torch.ops.rope
    return ("gpt_fast.apply_rotary_emb", "gpt_fast_apply_rotary_emb",
            _step(lambda: (gf.apply_rotary_emb(q, cache), gf.apply_rotary_emb(k, cache)), [q, k], grads),
            _step(lambda: (peers.gpt_fast_apply_rotary_emb(q, cache),
                           peers.gpt_fast_apply_rotary_emb(k, cache)), [q, k], grads),
            _step(lambda: (ops.apply(q, cos, sin, True), ops.apply(k, cos, sin, True)), [q, k], grads))


# Each: (size (batch, seq, heads, kv_heads, head_dim), dtype, tests/training_peers.py,
# rope_ext.compat, generator) -> (drop-in, peer's function, ours, theirs, rope_ext's op):
# zero-argument training steps on the same tensors.
TRAINING_PAIRS = (_te_sbhd, _te_thd, _llama, _gpt_fast)
