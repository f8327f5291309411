"""Rows from outside rope_ext: GPU peers (Liger-Kernel, FlashInfer) and the drop-ins.

Each peer is imported if it can be; one that cannot is named with the reason, printed and written
to the JSON, and its rows are left out (never an error: none of them is a dependency).
"""

import importlib

import torch

from .rows import Row, OPS


def _try_import(module):
    try:
        m = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to report
        return None, f"not loaded ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    return m, "loaded" + (f" ({m.__version__})" if hasattr(m, "__version__") else "")


def _liger(i):
    """Liger-Kernel's Triton RoPE on q and k in the HF layout (B, H, T, D) over our [T, H, D]
    memory (a transposed view, so it rotates in place), with HF-style full-width cos/sin
    [1, T, D] in q's dtype, gathered beforehand (it takes no positions)."""
    mod, status = _try_import("liger_kernel.transformers.rope")
    if mod is None:
        return status, []
    q = i.q.unsqueeze(0).transpose(1, 2)
    k = i.k.unsqueeze(0).transpose(1, 2)
    cos = torch.cat((i.cos[:, 0], i.cos[:, 0]), -1).unsqueeze(0).to(i.dtype)  # i.cos: [T, 1, D/2]
    sin = torch.cat((i.sin[:, 0], i.sin[:, 0]), -1).unsqueeze(0).to(i.dtype)
    n = OPS["apply_"].nbytes(i)
    return status, [Row("apply_ liger", "peer", "apply_",
                        "liger_kernel liger_rotary_pos_emb(q, k, cos, sin), in place, "
                        "cos/sin pre-gathered [1, T, D]", n,
                        lambda: mod.liger_rotary_pos_emb(q, k, cos, sin), "copy")]


def _flashinfer(i):
    """FlashInfer's vLLM-compatible in-place RoPE: the same contract as rope_ext.apply_rope_
    (positions, flat q/k, float32 cos_sin_cache)."""
    mod, status = _try_import("flashinfer.rope")
    if mod is None:
        return status, []
    T, D = i.shape.tokens, i.shape.head_dim
    q, k = i.q.view(T, -1), i.k.view(T, -1)
    n = OPS["apply_"].nbytes(i)
    return status, [Row("apply_ flashinfer", "peer", "apply_",
                        "flashinfer.rope.apply_rope_with_cos_sin_cache_inplace", n,
                        lambda: mod.apply_rope_with_cos_sin_cache_inplace(
                            i.positions, q, k, D, i.cache, True), "copy")]


GPU_PEERS = {"liger-kernel": _liger, "flashinfer": _flashinfer}


def gpu_peer_rows(i, ops):
    """(rows, {peer: status}); peers are CUDA kernels, so on other devices none is tried."""
    if i.device != "cuda":
        return [], {p: "not tried (CUDA only)" for p in GPU_PEERS}
    rows, status = [], {}
    for name, make in GPU_PEERS.items():
        s, r = make(i)
        status[name] = s
        rows += [row for row in r if row.op in ops]
    return rows, status
