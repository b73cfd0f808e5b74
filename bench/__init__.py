"""Benchmarks (not tests): each module prints figures and ratios. Run them from the repository
root as modules, e.g. ``python -m bench.offline --texts 200`` (``make bench`` runs them all).

Figures and charts go to ``bench/out/``, or to the folder ``$BENCH_OUT`` names: the smoke run
of every script in the e2e tier (``e2e/test_bench.py``) writes there, so that it never
overwrites a real run's figures."""

from __future__ import annotations

import os
from pathlib import Path

OUT_ENV = "BENCH_OUT"


def out_dir() -> Path:
    """Where a benchmark writes its figures: ``$BENCH_OUT``, else ``bench/out``."""
    chosen = os.environ.get(OUT_ENV)
    return Path(chosen) if chosen else Path(__file__).resolve().parent / "out"
