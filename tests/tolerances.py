"""Tolerances for comparing against a float64 reference: (rtol, atol) per dtype. One table for
the pytest suite and the scripts it runs in fresh processes."""

import torch

TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-6, 1e-6),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}
DTYPES = list(TOL)
