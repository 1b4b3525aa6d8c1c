"""Benchmark suites: each prints medians and ratios measured in one run."""
