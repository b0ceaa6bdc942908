"""Helpers for tests, demos and benchmarks (not used by the serving path)."""
