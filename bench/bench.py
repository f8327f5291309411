"""The rope_ext benchmark: `python bench/bench.py --device cpu|cuda [--quick] [--out DIR]
[--cases ...]` (`make bench`; on a GPU machine, scripts/gpu_check.sh runs it with --device cuda).

Prints a table of medians and ratios and writes STEM.json and STEM.md (and STEM.png when
matplotlib is installed) to --out (default bench/results/). The harness is bench/rope_bench/.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # rope_bench
sys.path.insert(1, os.path.dirname(HERE))  # rope_ext from this checkout

from rope_bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
