"""The embedding fingerprint: one short hash of everything that decides a vector.

An index is only as good as the promise that all its vectors came from one computation. The
server states that computation as a dict of *inputs* (the content hashes of the model's
files, and the decisions made at load: task, pooling, normalization, default dimensions,
prompts, input length, dtype, quantization, attention kernel, backend; see
``embedding_server.device.fingerprint``, which gathers them) and hashes it here:

    fingerprint = sha256(canonical JSON of the inputs)[:16]   (16 lowercase hex digits)

Canonical JSON is sorted keys, no whitespace, UTF-8 (:func:`canonical`), so the hash depends
on the values only. Nothing that names or places the model takes part (the served model
name, its aliases, the path or Hub id, the revision string, port, host, API workers, batch
sizes, threads): two servers with the same fingerprint compute the same vectors, and a
rename never forces a re-embed.

This module is torch-free and shared by both planes: the device plane computes the
fingerprint at load, and the HTTP layer sends it (:data:`HEADER`) and compares it with
``--expect-fingerprint`` (:class:`ExpectedFingerprint`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HEADER = "X-Embedding-Fingerprint"
"""The response header that carries the fingerprint on every successful model answer. The
EmbeddingJob worker reads it by this name: keep it."""

EXPECT_HEADER = "X-Expect-Embedding-Fingerprint"
"""The request header a client sends to be answered only by a server with that fingerprint
(or one it starts with: :func:`expected_prefix`); another answers 409 before any work."""

MIN_PREFIX = 8
"""The fewest hex digits :data:`EXPECT_HEADER` may give (32 bits: a prefix short enough to
type, long enough that two versions of one service never share it by chance)."""

SCHEMA = 1
"""The version of what is hashed (``inputs["schema"]``): a change to the set of inputs or to
how one is written bumps it, so that an old and a new fingerprint are never confused."""

LENGTH = 16
"""Hex digits kept of the sha256: 64 bits, short enough for a label, a log line and a
versioned name (``model@<fingerprint>``); a collision between two configurations someone
actually serves is out of reach at that size."""

_FINGERPRINT = re.compile(rf"[0-9a-f]{{{LENGTH}}}")

VERSION_MARK = "@"
"""What joins a model name and a fingerprint in a versioned name (``bge-small@3f2a9c01``)."""

_PINNED = re.compile(rf"(?P<name>.+){VERSION_MARK}(?P<prefix>[0-9a-fA-F]{{{MIN_PREFIX},{LENGTH}}})")


def versioned_name(name: str, fingerprint: str) -> str:
    """The name of ``name``'s version with ``fingerprint``: what the gateway routes to that
    version only, and what a server with that fingerprint accepts as ``name``."""
    return f"{name}{VERSION_MARK}{fingerprint}"


def pinned_name(model: str) -> tuple[str, str] | None:
    """``(name, prefix)`` when ``model`` is a versioned name, ``<name>@<fingerprint>`` or
    ``<name>@<prefix of at least MIN_PREFIX hex digits>`` (the prefix in lowercase); None for
    any other name (one with no ``@``, or whose ``@`` is followed by something else)."""
    match = _PINNED.fullmatch(model)
    if match is None:
        return None
    return match["name"], match["prefix"].lower()


def canonical(inputs: Mapping[str, Any]) -> bytes:
    """``inputs`` as canonical JSON bytes: sorted keys, no whitespace, UTF-8."""
    return json.dumps(
        inputs, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def fingerprint_of(inputs: Mapping[str, Any]) -> str:
    """The fingerprint of ``inputs``: the first :data:`LENGTH` hex digits of the sha256 of
    their canonical JSON."""
    return hashlib.sha256(canonical(inputs)).hexdigest()[:LENGTH]


def is_fingerprint(value: str) -> bool:
    return _FINGERPRINT.fullmatch(value) is not None


def expected_prefix(value: str) -> str:
    """The fingerprint, or prefix of one, that :data:`EXPECT_HEADER`'s ``value`` gives, in
    lowercase; ``ValueError`` says why it is none."""
    text = value.strip().lower()
    if not MIN_PREFIX <= len(text) <= LENGTH or re.fullmatch(r"[0-9a-f]+", text) is None:
        shown = text[:40] if text.isprintable() else "(not printable)"
        raise ValueError(
            f"The {EXPECT_HEADER} header must be an embedding fingerprint ({LENGTH} hex "
            f"digits, as the {HEADER} header and /info's 'fingerprint' say) or a prefix of "
            f"at least {MIN_PREFIX} of them; got {shown!r}."
        )
    return text


def differing(ours: Mapping[str, Any], expected: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The inputs that differ between ``ours`` and ``expected``, each as (expected, ours)
    (None for absent); a map of inputs (the model files, the prompts) is compared entry by
    entry, as ``files[model.safetensors]``."""
    found: dict[str, tuple[Any, Any]] = {}
    for key in sorted(set(ours) | set(expected)):
        mine, theirs = ours.get(key), expected.get(key)
        if mine == theirs:
            continue
        if isinstance(mine, Mapping) and isinstance(theirs, Mapping):
            for name in sorted(set(mine) | set(theirs)):
                if mine.get(name) != theirs.get(name):
                    found[f"{key}[{name}]"] = (theirs.get(name), mine.get(name))
            continue
        found[key] = (theirs, mine)
    return found


def differences(ours: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """The inputs that differ between ``ours`` and ``expected``, one line each
    (``dtype: float32, expected bfloat16``); a file map is compared file by file."""
    return [
        f"{name}: {_shown(mine)}, expected {_shown(theirs)}"
        for name, (theirs, mine) in differing(ours, expected).items()
    ]


def _shown(value: object) -> str:
    return "absent" if value is None else json.dumps(value, sort_keys=True)


@dataclass(frozen=True)
class ExpectedFingerprint:
    """What ``--expect-fingerprint`` says: a fingerprint, and the inputs it was made of
    when the flag gave them (then a mismatch can say which inputs differ)."""

    fingerprint: str
    inputs: dict[str, Any] | None = None

    @classmethod
    def parse(cls, value: str) -> ExpectedFingerprint:
        """A fingerprint (16 hex digits), or a JSON object: the expected inputs (as
        ``/info``'s ``fingerprint_inputs``), or an object holding them under
        ``fingerprint_inputs`` (a saved ``/info`` answer). ``ValueError`` says why not."""
        text = value.strip()
        if not text.startswith("{"):
            if not is_fingerprint(text):
                raise ValueError(
                    f"must be a fingerprint ({LENGTH} lowercase hex digits, as /info's "
                    f"'fingerprint') or a JSON object of its inputs; got {text[:40]!r}"
                )
            return cls(text)
        try:
            given = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"is not valid JSON: {error}") from None
        inputs = given.get("fingerprint_inputs", given)
        if not isinstance(inputs, dict) or "schema" not in inputs:
            raise ValueError(
                "a JSON value must be the fingerprint's inputs (an object with 'schema', as "
                "/info's 'fingerprint_inputs') or an object holding them as 'fingerprint_inputs'"
            )
        computed = fingerprint_of(inputs)
        stated = given.get("fingerprint") if "fingerprint_inputs" in given else None
        if stated is not None and stated != computed:
            raise ValueError(
                f"says fingerprint {stated!r}, but its fingerprint_inputs hash to {computed!r}"
            )
        return cls(computed, inputs)

    def mismatch(self, fingerprint: str, inputs: Mapping[str, Any]) -> str | None:
        """None when ``fingerprint`` is the expected one; else one line saying both
        fingerprints and, where the expected inputs are known, which inputs differ."""
        if fingerprint == self.fingerprint:
            return None
        message = f"the embedding fingerprint is {fingerprint}, expected {self.fingerprint}"
        if self.inputs is None:
            return message + (
                " (give --expect-fingerprint the expected inputs as JSON, /info's "
                "'fingerprint_inputs', to be told which differ)"
            )
        differ = differences(inputs, self.inputs)
        return message + ": " + "; ".join(differ)
