"""Benchmarks and evaluations: `splitspec bench`, `offline-eval` and `demo` (bench/cli.py)."""
