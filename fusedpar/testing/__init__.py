"""Helpers for tests, the demo and benchmarks: multi-process runs on CPU, numeric comparisons."""
