"""Allocating ops whose output is a fresh mapping (above glibc's largest mmap threshold, 32 MiB):
the CPU kernels back it chunk by chunk before writing and store it without streaming
(csrc/ops/cpu/fresh_output.h). The values must be those of the same kernel writing into a buffer
that is already backed (rope.apply.out into a poisoned tensor), bit for bit, on every kernel
variant, for layouts with tokens in order and not, on one thread and two."""

import pytest
import torch

import rope_ext
from conftest import assert_close, native_cpu, poison_like
from rope_oracle import rope, table_for
from test_cpu_isa import runnable

pytestmark = pytest.mark.skipif(not native_cpu(), reason="native library not built")

# 33 MiB + one token: a fresh mapping, and a last chunk that is not full.
TOKENS = {torch.float32: 2113, torch.bfloat16: 4225}


@pytest.fixture
def threads():
    before, serving = torch.get_num_threads(), rope_ext.cpu_isa()
    yield torch.set_num_threads
    torch.set_num_threads(before)
    rope_ext.set_cpu_isa(serving)


def _inputs(dtype, layout):
    t = TOKENS[dtype]
    pos = torch.randint(0, 8192, (t,))
    cos64, sin64 = table_for(pos, 128)
    x = torch.randn(t, 32, 128, dtype=dtype)
    cos, sin = cos64[:, None].float(), sin64[:, None].float()
    if layout == "heads_outer":  # (H, T, D): a token's rows are not next to each other
        x = torch.randn(32, t, 128, dtype=dtype)
        cos, sin = cos64[None].float(), sin64[None].float()
    return x, pos, cos, sin


# Every variant on the common layout and one thread; the other layout and two threads on the
# variant that serves.
SERVING = rope_ext.cpu_isa()  # the best, or what ROPE_EXT_CPU_ISA caps it to
CASES = [(isa, "tokens_outer", 1) for isa in runnable()] + [
    (SERVING, "heads_outer", 1), (SERVING, "tokens_outer", 2), (SERVING, "heads_outer", 2)]


@pytest.mark.parametrize("isa,layout,n_threads", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_output_matches_backed_output(threads, isa, dtype, layout, n_threads):
    threads(n_threads)
    rope_ext.set_cpu_isa(isa)
    x, pos, cos, sin = _inputs(dtype, layout)
    backed = poison_like(x)
    rope_ext.apply_rope(x, cos, sin, out=backed)
    assert not backed.isnan().any()
    assert torch.equal(torch.ops.rope.apply(x, cos, sin, False), backed)
    rows = torch.randint(0, x.shape[0], (8,))
    assert_close(backed[rows], rope(x[rows], cos[rows] if layout == "tokens_outer" else cos,
                                    sin[rows] if layout == "tokens_outer" else sin, False), dtype)
    # The backward (the inverse rotation) and the gathered op take the same path.
    inv = poison_like(x)
    inv.copy_(torch.ops.rope.apply_backward(backed, cos, sin, False))
    assert_close(inv, x, dtype)
    if layout == "tokens_outer":
        cache = torch.cat(table_for(torch.arange(8192), 128), dim=-1).float()
        got = torch.ops.rope.apply_positions(x, pos, cache[:, :64], cache[:, 64:], False, False,
                                             None, False)
        expect = poison_like(x)
        rope_ext.apply_rope(x, cache[:, :64][pos, None], cache[:, 64:][pos, None], out=expect)
        assert torch.equal(got, expect)
