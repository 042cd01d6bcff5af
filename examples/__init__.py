"""Runnable examples; `examples.models` also serves the tests and benchmarks."""
