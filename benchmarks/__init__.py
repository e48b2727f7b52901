"""Benchmarks run by `make bench`. Each prints what it compares, on which model and requests,
and writes its figures to bench-results/. None of them is a test: machines here are shared and
noisy, so comparisons are ratios measured side by side in one run."""
