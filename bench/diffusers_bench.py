"""The diffusers rows: `python bench/diffusers_bench.py [--quick] [--families ...] [--dtypes ...]`
(see --help). Each patched family's attention RoPE at a real generation's token counts, rope_ext
against diffusers' eager function and torch.compile of it; prints a table and writes
diffusers-cpu.json/.md to --out (default bench/results/). Needs diffusers."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # rope_bench
sys.path.insert(1, os.path.dirname(HERE))  # rope_ext from this checkout

from rope_bench.diffusers_rows import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
