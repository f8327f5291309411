"""Python-level scalar arguments (sizes, counts, offsets): one check, one message, everywhere."""

import numbers


def check_int(value, name, minimum=None):
    """value as an int, or a ValueError naming it. A bool is not an int here, nor is a float,
    even an integral one (1.7 would otherwise become 1). minimum=1 reads "a positive int"."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Integral)
    if minimum == 1 and not (ok and value >= 1):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not ok:
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)
