"""Helpers the tests and the benchmarks share: a tiny random-weight model, `agent serve` as a child process."""
