"""Python-level scalar arguments (sizes, counts, offsets): one check, one message, everywhere."""

import math
import numbers

import torch


def check_int(value, name, minimum=None):
    """value as an int, or a ValueError naming it. A bool is not an int here, nor is a float,
    even an integral one (1.7 would otherwise become 1). minimum=1 reads "a positive int"."""
    if type(value) is not int and isinstance(value, torch.SymInt):
        # a traced size (torch.compile, export): kept symbolic
        if minimum is not None:
            torch._check(value >= minimum, lambda: f"{name} must be >= {minimum}")
        return value
    ok = type(value) is int or (not isinstance(value, bool) and isinstance(value, numbers.Integral))
    if minimum == 1 and not (ok and value >= 1):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not ok:
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if not -2**63 <= value < 2**63:  # (torch takes sizes and indices as int64)
        raise ValueError(f"{name} must fit in int64, got {value}")
    return int(value)


def check_tensors(optional=(), **named):
    """A TypeError naming the first of `named` that is not a tensor (those in `optional` may be
    None). The drop-ins' per-call paths call it after an AttributeError (a non-tensor met .dim or
    .shape), so a good call pays nothing for it."""
    for name, value in named.items():
        if not isinstance(value, torch.Tensor) and not (value is None and name in optional):
            got = "None" if value is None else type(value).__name__
            raise TypeError(f"{name} must be a tensor, got {got}")


def check_dense(t, name):
    """t, or a TypeError naming it unless it is a dense (strided) tensor: a sparse, MKL-DNN or
    nested one would fail inside the torch op that first views it, with a message naming none of
    the caller's arguments."""
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
        got = f"layout {t.layout}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name} must be a dense (strided) tensor, got {got}")
    return t


def check_float(value, name):
    """value as a float, or a ValueError naming it: a real number or a one-element tensor, not a
    bool or a string (float("2") and float(True) would otherwise pass)."""
    if type(value) is float:
        return value
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)) or (
            isinstance(value, torch.Tensor) and value.numel() != 1):
        raise ValueError(f"{name} must be a float, got {value!r}")
    return float(value)


def check_flag(value, name):
    """value as a flag: True or False, or what torch's bool arguments and the peers' flags also
    take for them, a value equal to one (a NumPy bool, 0 or 1, 0.0 or 1.0, a one-element tensor
    holding one) as that bool, a traced SymBool (non-strict export) as it is; else a ValueError
    naming it (bool("false") is True, and 2 or None would pick a layout silently)."""
    if value is True or value is False or isinstance(value, torch.SymBool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):
        return bool(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        number = value.item()
    else:
        number = value if isinstance(value, numbers.Real) else None
    if number is not None and number in (0, 1):
        return bool(number)
    raise ValueError(f"{name} must be True or False, got {value!r}")


_BOOLS = frozenset((True, False))


def check_flags(names, *values):
    """check_flag of each value, named by the words of `names` in order. The common call (each
    True or False, or a value equal to one) costs one set test: these run on decode-sized calls."""
    try:
        if _BOOLS.issuperset(values):
            return
    except TypeError:  # an unhashable value: named below
        pass
    for name, value in zip(names.split(), values):
        if value is not True and value is not False:
            check_flag(value, name)


def check_eps(eps):
    """eps as a float (a bool or a string is refused; the op checks its range)."""
    return eps if type(eps) is float else check_float(eps, "eps")


def check_positive(value, name):
    """value as a float > 0 and finite, or a ValueError naming it: a base, a scale or a factor (0,
    a negative, an infinite or a NaN one gives a table of inf or NaN, which rotates silently to
    NaN). A real number or a one-element tensor; not a bool or a string."""
    try:
        ok = not isinstance(value, (bool, str, bytes)) and 0 < float(value) < math.inf
    except (TypeError, ValueError, OverflowError, RuntimeError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be > 0 and finite, got {value!r}")
    return float(value)


def mrope_section_arg(mrope_section, mrope_interleaved=False):
    """mrope_section as a list of ints (None stays None), or a ValueError: an entry that is not
    an int (16.7 would otherwise become 16), or mrope_interleaved without a section (it would be
    ignored)."""
    if mrope_section is None:
        if mrope_interleaved:
            raise ValueError("mrope_interleaved=True needs mrope_section (the pairs of each of "
                             "the 3 position components)")
        return None
    try:
        section = list(mrope_section)
    except TypeError:
        raise ValueError(f"mrope_section must be a list of ints, got {mrope_section!r}") from None
    if not all(not isinstance(s, bool) and isinstance(s, numbers.Integral) for s in section):
        raise ValueError(f"mrope_section must hold ints, got {section!r}")
    return [int(s) for s in section]
