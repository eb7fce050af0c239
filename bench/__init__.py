"""Benchmarks (run as modules: `python -m bench.transfer`)."""
