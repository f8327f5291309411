"""The benchmark behind `python bench/bench.py` (`make bench`, `make gpu-check`).

A development tool, never part of the runtime package: it lives outside rope_ext/ and nothing in
rope_ext imports it. Per case (shape) and dtype it times, in one process and interleaved:
  - the memory-copy limits: `x.clone()` (an allocating copy) and `out.copy_(x)` (into a buffer
    that already exists),
  - each rope_ext op, held against the limit with the same allocation behaviour,
  - the eager reference (rope_ext.reference) and torch.compile of the same math,
  - where they apply: the unfused rope_ext equivalent of the fused op, drop-ins against their
    peers' eager code (tests/peers.py), and GPU peers (Liger-Kernel, FlashInfer),
then prints a Markdown table of medians and ratios and writes JSON (+ Markdown, + PNG when
matplotlib is installed).

Modules: timing (interleaved blocks, medians), cases (shapes, inputs), rows (what is timed),
equivalents (the PyTorch formulations that are compiled), peers (drop-ins and GPU peers), malloc
(glibc thresholds for the run), report (summary, tables, files), plot, cli.
"""
