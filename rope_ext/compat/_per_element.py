"""Rotation by angles given per element (Transformer Engine's `freqs`): the first member of each
pair turns by its own entry and the second by its own, and nothing says the two are equal.

rope.apply reads one (cos, sin) per pair. When both members of every pair hold the same angle (as
every table the peers build does), one pass over x with that angle is exact. Otherwise two passes,
each exact for one member of every pair, give the same values and gradients as the per-element
formula; so do they whenever the angles themselves need a derivative, a gradient or a forward-AD
tangent (each member's angle gets its own). Which case a call is takes one comparison of the
angles' two halves, the rows the call reads: values can change without a version bump, so nothing
is remembered. Under torch.compile the comparison runs in the graph and torch.cond picks the path.
"""

import torch

from .._compiling import compiling
from ._layout import comparable, derivative_wanted, float32_table, join_members, pair_members

from .._call import ops  # noqa: E402  (torch.ops.rope, without autograd where none is needed)


def _pass(x, angles, interleaved):
    a = float32_table(angles)  # half-precision angles: their sin/cos in float32
    return ops.apply(x, a.cos(), a.sin(), interleaved)


def _one_pass(x, angles, interleaved):
    return _pass(x, pair_members(angles, interleaved)[0], interleaved)


def _two_passes(x, angles, interleaved):
    first, second = pair_members(angles, interleaved)
    return join_members(_pass(x, first, interleaved), _pass(x, second, interleaved), interleaved,
                        angles.shape[-1])


# torch.cond's branches: functions of tensors only.
def _one_pass_true(x, angles):
    return _one_pass(x, angles, True)


def _one_pass_false(x, angles):
    return _one_pass(x, angles, False)


def _two_passes_true(x, angles):
    return _two_passes(x, angles, True)


def _two_passes_false(x, angles):
    return _two_passes(x, angles, False)


def rotate(x, angles, interleaved):
    """x rotated by `angles` (..., rotary_dim), placed against x (x's number of dims, each x's size
    or 1): element j < rotary_dim of a head turns by angles[..., j] with its pair's other member
    (pairs (2i, 2i+1) if interleaved, else (i, i + rotary_dim/2)); the dims past rotary_dim pass
    through. Returns a new tensor in x's dtype, computed in float32 (float64 for float64 x).
    Differentiable w.r.t. x and the angles."""
    if derivative_wanted(angles):  # each member's angle its own derivative, tangents included
        return _two_passes(x, angles, interleaved)
    if compiling():
        first, second = pair_members(angles, interleaved)
        return torch.cond((first == second).all(),
                          _one_pass_true if interleaved else _one_pass_false,
                          _two_passes_true if interleaved else _two_passes_false, (x, angles))
    if comparable(angles) and torch.equal(*pair_members(angles, interleaved)):
        return _one_pass(x, angles, interleaved)
    return _two_passes(x, angles, interleaved)
