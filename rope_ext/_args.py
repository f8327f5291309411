"""Python-level scalar arguments (sizes, counts, offsets): one check, one message, everywhere."""

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
    return int(value)


def check_float(value, name):
    """value as a float, or a ValueError naming it: a real number or a one-element tensor, not a
    bool or a string (float("2") and float(True) would otherwise pass)."""
    if type(value) is float:
        return value
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)):
        raise ValueError(f"{name} must be a float, got {value!r}")
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
    section = list(mrope_section)
    if not all(not isinstance(s, bool) and isinstance(s, numbers.Integral) for s in section):
        raise ValueError(f"mrope_section must hold ints, got {section!r}")
    return [int(s) for s in section]
