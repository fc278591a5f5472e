"""Benchmarks that need a GPU node to show their full figures: ``python -m bench.gpu.layers``."""
