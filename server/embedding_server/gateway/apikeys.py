"""Which API keys send bulk traffic: ``--bulk-api-keys-file``.

A team's indexing job and its search box often share a route (``/v1/embeddings``) but not a
key, so the key is how the gateway tells them apart; a bulk key's requests stay bulk whatever
their ``X-Priority`` says, so an indexing job cannot jump the interactive queue.

The keys are secrets, so the gateway keeps only their SHA-256 digests, never logs a key or
its digest (only how many were read and from where), and compares a request's key with every
digest through :func:`hmac.compare_digest`, all of them each time, so the time a request
takes says nothing about which key, or how much of one, matched. The file (a mounted Secret,
which the kubelet swaps in place when the Secret changes) is read again when its modification
time changes; a file that cannot be read keeps the last keys, with a warning.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
from collections.abc import Iterable

logger = logging.getLogger(__name__)

BEARER = "bearer "


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str) -> list[str]:
    """One key per line; blank lines and lines starting with ``#`` are skipped, and each
    line's surrounding whitespace is not part of the key (a Secret's trailing newline)."""
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


class BulkApiKeys:
    """The digests of the keys whose requests default to bulk."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests: tuple[bytes, ...] = tuple({_digest(k) for k in keys})

    def __len__(self) -> int:
        return len(self._digests)

    @classmethod
    def from_file(cls, path: str) -> BulkApiKeys:
        """The keys in ``path`` (OSError when it cannot be read, ValueError when it is not
        UTF-8 text; neither message quotes the content)."""
        with open(path, "rb") as file:
            raw = file.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text") from None
        return cls(parse_keys(text))

    def is_bulk(self, authorization: str | None) -> bool:
        """Whether an ``Authorization: Bearer <key>`` header carries one of the keys."""
        if not self._digests or not authorization:
            return False
        if authorization[: len(BEARER)].lower() != BEARER:
            return False
        presented = _digest(authorization[len(BEARER) :].strip())
        found = False
        for digest in self._digests:  # every one, whatever matched: constant time
            found |= hmac.compare_digest(presented, digest)
        return found


class BulkApiKeysFile:
    """:class:`BulkApiKeys` from a file, read again when it changes."""

    def __init__(self, path: str, check_interval: float = 1.0) -> None:
        self.path = path
        self.check_interval = check_interval
        self._mtime = os.stat(path).st_mtime_ns
        self.keys = BulkApiKeys.from_file(path)
        logger.info("read %d bulk API keys from %s", len(self.keys), path)

    def reload_if_changed(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
            if mtime == self._mtime:
                return
            keys = BulkApiKeys.from_file(self.path)
        except (OSError, ValueError) as error:
            # The message names the file and the error (never the content: it is secret).
            logger.warning(
                "cannot read the bulk API keys file %s (%s); keeping the last keys",
                self.path,
                type(error).__name__,
            )
            return
        self._mtime = mtime
        self.keys = keys
        logger.info("read %d bulk API keys from %s", len(keys), self.path)

    async def watch(self) -> None:
        """Check the file every ``check_interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.check_interval)
            self.reload_if_changed()
