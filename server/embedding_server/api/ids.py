"""Ids for requests and responses."""

from __future__ import annotations

import random

_ids = random.Random()


def new_id() -> str:
    """A 32-hex-digit id for requests and responses.

    Not ``uuid4``: that reads ``os.urandom`` on every call, a syscall that showed up in
    request profiles; ids need to be unique, not unpredictable.
    """
    return f"{_ids.getrandbits(128):032x}"
