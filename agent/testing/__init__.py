"""Helpers the tests and the benchmarks share: a tiny random-weight model, `agent serve` as a child process,
unfiltered droplet matrices of real cells and DropletUtils as the cell-calling oracle, the reference
analysis without the loop, a CellTypist model trained on real cells, a session without data. They
never import pytest: the benchmarks run without it."""
