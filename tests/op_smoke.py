"""Smoke check of one way of loading rope_ext, run in a fresh process by the packaging tests
(test_wheel.py, test_jit.py, test_cmake_library.py): a process can hold only one copy of the ops.

    python op_smoke.py [--path DIR] [--preload LIB ...] [--expect-loaded-by KIND]
                        [--expect-under DIR] [--expect-library-under DIR]

Checks that rope_ext (and its native library) came from where the caller expects, then runs every
op (apply, apply.out, apply_backward and its autograd, apply_ (with rope_dim_offset and
inverse), mrope_, apply_positions, apply_and_cache_, shift_kv_cache_) against rope_ext.reference. Prints "OK <loaded_by> <loaded_from>" on success.
"""

import argparse
import os
import sys

TOL = {  # (rtol, atol) against the float64 reference
    "float64": (1e-12, 1e-12),
    "float32": (1e-6, 1e-6),
    "float16": (1e-3, 2e-3),
    "bfloat16": (1e-2, 1.6e-2),
}


def is_rope_library(path, extra=()):
    name = os.path.basename(path)
    return (
        (name.startswith("_C") and os.path.basename(os.path.dirname(path)) == "rope_ext")
        or name.startswith(("rope_ext_jit", "librope_ops"))
        or path in extra
    )


def mapped_rope_libraries(extra=()):
    """Real paths of rope_ext native libraries (rope_ext/_C*.so, the JIT and CMake builds, and any
    in `extra`) mapped into this process."""
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            path = os.path.realpath(fields[5].strip()) if len(fields) == 6 else ""
            if path.endswith(".so") and is_rope_library(path, extra):
                paths.add(path)
    return paths


def close(torch, actual, expected, dtype):
    rtol, atol = TOL[str(dtype).replace("torch.", "")]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


def check_preloaded_ops(torch):
    """Before rope_ext is imported: torch.ops.rope.apply from the preloaded library alone, against
    the rotation written out here (half-split layout: pairs (x[i], x[i + 6]))."""
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    ang = torch.rand(3, 1, 6, dtype=torch.float64) * 6
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., :6], x[..., 6:12]
    expected = torch.cat([a * cos - b * sin, a * sin + b * cos, x[..., 12:]], dim=-1)
    close(torch, torch.ops.rope.apply(x, cos, sin, False), expected, torch.float64)


def check_ops(torch, rope_ext):
    ref = rope_ext.reference
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for interleaved in (False, True):
            # partial rotary (24 of 32 dims), cos/sin [1,S,1,r/2] broadcast over batch and heads
            x = torch.randn(2, 7, 4, 32, dtype=dtype)
            table = rope_ext.cos_sin_cache(16, 24, dtype=torch.float32)[3:10]
            cos, sin = table[None, :, None, :12], table[None, :, None, 12:]
            exact = (x.double(), cos.double(), sin.double())
            out = torch.ops.rope.apply(x, cos, sin, interleaved)
            close(torch, out, ref.apply_rope(*exact, interleaved=interleaved), dtype)
            assert torch.equal(out[..., 24:], x[..., 24:]), "pass-through dims changed"
            buf = torch.full_like(x, float("nan"))  # the out= overload, same kernel: bit for bit
            torch.ops.rope.apply.out(x, cos, sin, interleaved, out=buf)
            assert torch.equal(buf, out), "rope.apply.out differs from rope.apply"

            back = torch.ops.rope.apply_backward(x, cos, sin, interleaved)
            close(torch, back, ref.apply_rope_backward(*exact, interleaved=interleaved), dtype)

            grads = []
            for fn in (rope_ext.apply_rope, ref.apply_rope):  # native autograd vs the reference's
                xg = exact[0].clone().requires_grad_()
                fn(xg, *exact[1:], interleaved=interleaved).square().sum().backward()
                grads.append(xg.grad)
            close(torch, grads[0], grads[1], torch.float64)

            # in place: GQA, query/key strided views into one fused qkv buffer, int32 positions
            qkv = torch.randn(9, 8 + 2 + 2, 32, dtype=dtype)
            query, key = qkv[:, :8], qkv[:, 8:10]
            positions = torch.randint(0, 64, (9,), dtype=torch.int32)
            cache = rope_ext.cos_sin_cache(64, 32, dtype=torch.float32)
            eq, ek = query.double().clone(), key.double().clone()
            ref.apply_rope_(eq, ek, positions, cache.double(), interleaved=interleaved)
            value_before = qkv[:, 10:].clone()
            torch.ops.rope.apply_(query, key, positions, cache, interleaved)
            close(torch, query, eq, dtype)
            close(torch, key, ek, dtype)
            assert torch.equal(qkv[:, 10:], value_before), "apply_ wrote outside query/key"

            # multimodal: positions (3, B, S), sections of the 16 pairs of a 32-of-40-dim rotary part
            query, key = torch.randn(2, 5, 4, 40, dtype=dtype), torch.randn(2, 5, 2, 40, dtype=dtype)
            positions = torch.randint(0, 32, (3, 2, 5))
            cache = rope_ext.cos_sin_cache(32, 32, dtype=torch.float32)
            eq, ek = query.double().clone(), key.double().clone()
            ref.apply_mrope_(eq, ek, positions, cache.double(), [4, 6, 6], interleaved=interleaved)
            torch.ops.rope.mrope_(query, key, positions, cache, [4, 6, 6], interleaved)
            close(torch, query, eq, dtype)
            close(torch, key, ek, dtype)

            # the positions op (out of place), and the fused KV-cache write
            x = torch.randn(6, 3, 32, dtype=dtype)
            positions = torch.randint(0, 32, (6,))
            half = (cache[:, :16], cache[:, 16:])
            out = torch.ops.rope.apply_positions(x, positions, *half, interleaved, False, None, False)
            close(torch, out, ref.apply_positions(x.double(), positions, half[0].double(),
                                                  half[1].double(), interleaved=interleaved), dtype)
            q, k, v = (torch.randn(6, h, 32, dtype=dtype) for h in (4, 2, 2))
            kc, vc = torch.zeros(3, 4, 2, 32, dtype=dtype), torch.zeros(3, 4, 2, 32, dtype=dtype)
            slots = torch.tensor([0, 5, -1, 11, 2, 7])
            want = [t.clone() for t in (q, k, v, positions, cache, kc, vc, slots)]
            torch.ops.rope.apply_and_cache_(q, k, v, positions, cache, kc, vc, slots, interleaved)
            ref.apply_and_cache_(*want, interleaved=interleaved)
            for got, exp in zip((q, k, kc, vc), (want[0], want[1], want[5], want[6])):
                assert torch.equal(got, exp), "apply_and_cache_ differs from the reference"

            # rope_dim_offset and inverse in place, and the K-shift of the cache just written
            y = x.clone()
            torch.ops.rope.apply_(y, None, positions, cache[:, :16], interleaved, 16, True)
            ey = x.double().clone()
            ref.apply_rope_(ey, None, positions, cache[:, :16].double(), interleaved=interleaved,
                            rope_dim_offset=16, inverse=True)
            close(torch, y, ey, dtype)
            from rope_ext._kv_shift import reference as _kv_shift_reference

            delta = torch.tensor([3, -2, 7, 0, -5, 1])
            ekc = kc.double()
            torch.ops.rope.shift_kv_cache_(kc, slots, delta, cache, interleaved)
            _kv_shift_reference.shift_kv_cache_(ekc, slots, delta, cache.double(),
                                                interleaved=interleaved)
            close(torch, kc, ekc, dtype)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", help="put DIR first on sys.path")
    parser.add_argument("--preload", action="append", default=[],
                        help="torch.ops.load_library(LIB) before importing rope_ext (repeatable: "
                        "the CPU library first, then the CUDA one)")
    parser.add_argument("--expect-loaded-by", choices=("compiled", "jit", "preloaded"))
    parser.add_argument("--expect-under", help="rope_ext and its native library must come from here")
    parser.add_argument("--expect-library-under", help="the native library must come from here")
    args = parser.parse_args()
    if args.path:
        sys.path.insert(0, args.path)

    import torch

    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    for lib in args.preload:
        torch.ops.load_library(lib)
    if args.preload:
        check_preloaded_ops(torch)

    import rope_ext
    from rope_ext import _library

    state = _library.state
    if args.expect_loaded_by:
        assert state.loaded_by == args.expect_loaded_by, (state.loaded_by, state.path)
    assert rope_ext.backend("cpu") == "native", state.error
    native = os.path.realpath(state.path)
    # The CUDA kernels may sit in a second library (rope_ext._C_cuda, or the JIT/CMake one).
    cuda = state.cuda_path
    expected = {native} | ({os.path.realpath(cuda)} if cuda else set())
    if args.preload:
        assert native == os.path.realpath(args.preload[0]), native
        expected |= {os.path.realpath(p) for p in args.preload}
    mapped = mapped_rope_libraries(extra=tuple(expected))
    assert mapped == expected, f"expected only {expected} mapped, found {mapped}"
    expected_places = [(args.expect_under, os.path.realpath(rope_ext.__file__))]
    expected_places += [(args.expect_under or args.expect_library_under, p) for p in expected]
    for place, path in expected_places:
        if place:
            under = os.path.realpath(place) + os.sep
            assert path.startswith(under), f"{path} is not under {under}"

    check_ops(torch, rope_ext)
    print("OK", state.loaded_by, state.path)


if __name__ == "__main__":
    main()
