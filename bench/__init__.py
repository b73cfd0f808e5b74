"""Benchmarks (not tests): each module prints figures and ratios. Run them from the repository
root as modules, e.g. ``python -m bench.offline --texts 200`` (``make bench`` runs all three)."""
