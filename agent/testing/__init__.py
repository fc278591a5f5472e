"""Helpers the tests and the benchmarks share: a tiny random-weight model, `agent serve` as a child process,
unfiltered droplet matrices of real cells and DropletUtils as the cell-calling oracle."""
