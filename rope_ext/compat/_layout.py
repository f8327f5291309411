"""Shared argument handling of the drop-ins: the peers' q/k layouts as views rope_ext's ops take,
and their scalar arguments checked with errors that name them."""

import numbers

import torch


def check_head_size(head_size):
    if isinstance(head_size, bool) or not isinstance(head_size, numbers.Integral) or head_size < 1:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")
    return int(head_size)


def heads(t, head_size, lead, name):
    """t as (*lead_dims, num_heads, head_size), a view: t is flat (*lead_dims, H * head_size), as
    vLLM, SGLang and FlashInfer take slices of a fused qkv buffer, or already
    (*lead_dims, H, head_size). `lead` is the number of token dims (positions' dims)."""
    if t is None:
        return None
    if t.dim() == lead + 1:
        if t.shape[-1] % head_size:
            raise ValueError(
                f"{name} of shape {list(t.shape)}: its last dim {t.shape[-1]} must be a multiple of "
                f"head_size = {head_size} (flat (num_tokens, num_heads * head_size) layout)")
        # Splitting one dim is always a view, so in-place writes reach the caller's tensor.
        return t.unflatten(-1, (t.shape[-1] // head_size, head_size))
    if t.dim() == lead + 2:
        if t.shape[-1] != head_size:
            raise ValueError(f"{name} of shape {list(t.shape)}: its last dim must be head_size = "
                             f"{head_size} in the (num_tokens, num_heads, head_size) layout")
        return t
    raise ValueError(
        f"{name} of shape {list(t.shape)} must have {lead + 1} dims (tokens, num_heads * head_size) "
        f"or {lead + 2} (tokens, num_heads, head_size) for positions with {lead} dim(s)")


def check_int(value, name, minimum=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_index_tensor(t, name, shape=None):
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an int32 or int64 tensor, got {got}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    return t
