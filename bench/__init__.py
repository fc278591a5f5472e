"""The benchmarks: each one a module, run from the repository root as ``python -m bench.NAME``
(bench/README.md); the modules named with a leading underscore are the helpers they share."""
