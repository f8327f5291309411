"""Tolerances for comparing against a float64 reference: (rtol, atol) per dtype, the table of
rope_ext.reference (which `python -m rope_ext` uses too). For the pytest suite and the scripts it
runs in fresh processes."""

from rope_ext.reference import TOLERANCES as TOL

DTYPES = list(TOL)
