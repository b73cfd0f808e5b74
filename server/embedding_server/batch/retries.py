"""What every bulk client of a server does alike: send at bulk priority, and wait out an
overloaded or starting server for as long as it says (``Retry-After`` on 429 and 503), with
a bounded backoff when it says nothing. ``run-batch``'s runner and the job's worker share it."""

from __future__ import annotations

import math

import httpx2

RETRY_STATUSES = frozenset({429, 503})
MAX_RETRY_WAIT_S = 30.0
FIRST_BACKOFF_S = 0.5
PRIORITY_HEADERS = {"X-Priority": "bulk"}
"""Bulk work rides the room interactive requests leave (the scheduler's priorities)."""


def retry_after(response: httpx2.Response) -> float | None:
    """The response's ``Retry-After`` in seconds (at most :data:`MAX_RETRY_WAIT_S`), or None
    when it has none that is a number."""
    value = response.headers.get("retry-after")
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return None
    return min(seconds, MAX_RETRY_WAIT_S)


def next_backoff(backoff: float) -> float:
    """The wait after ``backoff``: doubled, up to :data:`MAX_RETRY_WAIT_S`."""
    return min(backoff * 2, MAX_RETRY_WAIT_S)
