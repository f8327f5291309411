"""The CPU benchmark: `python -m rope_ext.bench` (or `make bench`).

For each case (shape) and dtype it times rope_ext's ops, the eager and torch.compile'd
references, and a copy of the same bytes, then prints a table, writes JSON (and a Markdown
table) to bench/results/, and draws a PNG of bandwidth against tensor size when matplotlib is
installed. A script, not a test: tests/test_bench.py only runs it once on a tiny size.
"""
