"""Tier-1 tests: no cluster, no network (``make unit``). Helpers live in ``tests.support``."""
