"""Benchmarks: each prints figures and ratios against a baseline measured in the same run."""
