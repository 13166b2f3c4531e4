"""Benchmarks: they measure and print figures; tests check behaviour (never timings)."""
