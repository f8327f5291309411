"""vLLM's RoPE kernel entry point, `vllm._custom_ops.rotary_embedding`, on rope_ext's in-place op.

    from vllm import _custom_ops as ops          ->  from rope_ext.compat import vllm as ops
    ops.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox,
                         rope_dim_offset=0, inverse=False)
    ops.fused_qk_norm_rope(...), ops.fused_qknorm_rope_cache(...)   (the fused prologues)
"""

from .._args import check_tensors
from .._call import ops
from ..ops import _rotation_args
from ._layout import check_head_size, heads, interleaved_of

_apply_ = ops.apply_  # torch.ops.rope.apply_, without autograd where none is needed


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0,
                     inverse=False):
    """Rotates query and key (or None) in place; returns None, as vLLM's op does.

    positions: (num_tokens,) or (batch, seq_len), int32 or int64 (vLLM takes int64 only).
    query: (*positions.shape, num_heads * head_size), e.g. a slice of a fused qkv buffer, or
    (*positions.shape, num_heads, head_size); key likewise with num_kv_heads, or None.
    cos_sin_cache: (max_position, rot_dim), cos in the first rot_dim/2 columns and sin in the
    rest, any float dtype; dims [rope_dim_offset, rope_dim_offset + rot_dim) of each head rotate
    (DeepSeek-V4 passes head_size - rot_dim: the tail), the rest stay as they are.
    is_neox: pairs (i, i + rot_dim/2) if True, (2i, 2i+1) (GPT-J) if False.
    inverse: rotate by the negative angle (sin negated), in place like the forward rotation.

    Unlike vLLM's kernel, a position outside [0, max_position) is an error (vLLM reads outside
    the table), and the call is differentiable like torch's in-place ops.
    """
    if type(head_size) is not int or head_size < 1:
        head_size = check_head_size(head_size)
    try:
        lead = positions.dim()
        qs, ks = query.shape, None if key is None else key.shape
    except AttributeError:
        check_tensors(("key",), positions=positions, query=query, key=key)
        raise
    if lead not in (1, 2):
        raise ValueError(f"positions must have shape (num_tokens,) or (batch, seq_len), got "
                         f"{list(positions.shape)}")
    if lead == 1 and len(qs) == 2 and qs[1] % head_size == 0 and (
            ks is None or (len(ks) == 2 and ks[1] % head_size == 0)):
        # vLLM's own layout, flat (num_tokens, heads * head_size): the views alone (decode calls)
        try:
            q = query.view(qs[0], qs[1] // head_size, head_size)
            k = None if key is None else key.view(ks[0], ks[1] // head_size, head_size)
        except (NotImplementedError, RuntimeError):  # a sparse or MKL-DNN tensor has no view:
            # named below (a dense one always splits its last dim)
            heads(query, head_size, "query", lead)
            heads(key, head_size, "key", lead)
            raise
    else:
        q = heads(query, head_size, "query", lead)
        k = heads(key, head_size, "key", lead)
    if is_neox is True and inverse is False and type(rope_dim_offset) is int and \
            rope_dim_offset == 0:  # the defaults, left to torch (0.5 us of a decode call)
        _apply_(q, k, positions, cos_sin_cache)
    else:
        interleaved = interleaved_of(is_neox)
        _rotation_args(interleaved, rope_dim_offset, inverse)
        _apply_(q, k, positions, cos_sin_cache, interleaved, rope_dim_offset, inverse)


# fused QK-RMSNorm + RoPE (vLLM's `_custom_ops.fused_qk_norm_rope`), with the SGLang twin, and
# the whole prologue with the paged KV write (`_custom_ops.fused_qknorm_rope_cache`)
from ._qk_norm import fused_qk_norm_rope, fused_qknorm_rope_cache  # noqa: E402,F401
