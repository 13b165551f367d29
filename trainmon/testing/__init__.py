"""Helpers for tests, demos and benchmarks: a tiny GPT model."""
