"""Who owns a model name: one EmbeddingService per name, the oldest claim (issue 48, H3).

The gateway routes a request by its ``model`` to the one EmbeddingService that answers to that
name. Before, two claims of one name went to the first by ``namespace/name``, so a CR author in
any namespace could add another team's model name to ``servedModelAliases`` and receive that
team's texts and ``Authorization`` headers. Now a name is owned by its oldest claim
(``metadata.creationTimestamp``, then ``(namespace, name)`` for objects created in the same
second), which a newer object can never beat, so no edit or new object takes a name that
already routes someone's traffic. Names that :class:`ReservedNames` reserves
(``--reserved-model-names``, the chart's ``modelNames.reserved``) may be claimed only from the
namespaces listed for them, whatever the age of the claim: the way to keep a name for a team
before anyone else claims it.

The names an object claims, and the rule, are the gateway's
(``embedding_server/gateway/kubernetes.py``: ``model_names``, ``ReservedNames``,
``name_owners``); the operator image does not ship the server package, so they are written
twice and ``tests/operator/test_op_names.py`` checks that both decide alike. The operator sees
every EmbeddingService it watches (its event handler keeps :class:`NameClaims`), which is the
gateway's scope too (the chart gives both the same namespace, or all); a refused claim gets
condition ``NamesOwned`` False (``NameTaken`` or ``NameReserved``) naming each name and its
owner, with a Warning Event, and the gateway does not route those names to it.

Written by the kopf event handler on the event loop, read by reconcile threads: one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from embedding_operator.spec import ALIASES_ANNOTATION

HF_PREFIX = "hf://"

Key = tuple[str, str]  # (namespace, name) of an EmbeddingService


def claimed_names(resource: Mapping[str, Any]) -> tuple[str, ...]:
    """The names an EmbeddingService answers to behind the gateway, the served name first:
    ``status.model.servedModelName``, ``spec.servedModelName``, the last path component of
    ``spec.model.name``, ``spec.model.name``, ``spec.servedModelAliases`` and the deprecated
    aliases annotation."""
    spec = resource.get("spec") or {}
    status = resource.get("status") or {}
    model = str((spec.get("model") or {}).get("name") or "").removeprefix(HF_PREFIX)
    annotations = (resource.get("metadata") or {}).get("annotations") or {}
    candidates = [
        (status.get("model") or {}).get("servedModelName"),
        spec.get("servedModelName"),
        model.rstrip("/").rsplit("/", 1)[-1] if model else None,
        model or None,
        *(spec.get("servedModelAliases") or []),
        *str(annotations.get(ALIASES_ANNOTATION, "")).split(","),
    ]
    names: list[str] = []
    for candidate in candidates:
        name = str(candidate).strip() if candidate else ""
        if name and name not in names:
            names.append(name)
    return tuple(names)


def written_names(resource: Mapping[str, Any]) -> frozenset[str]:
    """The names the CR's author wrote (``spec.servedModelName``, ``spec.servedModelAliases``,
    the aliases annotation), as opposed to those every service of a model answers to (the
    model's name and its last path component): only a written name that another service owns
    is reported as refused. Two teams serving one model share its default names; the gateway
    routes those to the older service, and neither is told it did wrong."""
    spec = resource.get("spec") or {}
    annotations = (resource.get("metadata") or {}).get("annotations") or {}
    candidates = [
        spec.get("servedModelName"),
        *(spec.get("servedModelAliases") or []),
        *str(annotations.get(ALIASES_ANNOTATION, "")).split(","),
    ]
    return frozenset(str(c).strip() for c in candidates if c and str(c).strip())


class ReservedNames:
    """Model names that only some namespaces may claim: ``PATTERN=NAMESPACE|NAMESPACE``
    items (shell patterns); the first pattern that matches a name decides, and a name no
    pattern matches may be claimed from any namespace."""

    def __init__(self, items: Iterable[str] = ()) -> None:
        rules: list[tuple[str, frozenset[str]]] = []
        for item in items:
            pattern, sep, namespaces = item.partition("=")
            allowed = frozenset(n.strip() for n in namespaces.split("|") if n.strip())
            if not sep or not pattern.strip() or not allowed:
                raise ValueError(
                    f"--reserved-model-names: {item!r} is not PATTERN=NAMESPACE[|NAMESPACE...]"
                )
            rules.append((pattern.strip(), allowed))
        self.rules = tuple(rules)

    def allows(self, name: str, namespace: str) -> bool:
        for pattern, allowed in self.rules:
            if fnmatchcase(name, pattern):
                return namespace in allowed
        return True


@dataclass(frozen=True)
class Refusal:
    """A name an EmbeddingService claims and does not own; ``owner`` None: reserved for
    other namespaces (and claimed by none of them)."""

    name: str
    owner: Key | None


def _created(resource: Mapping[str, Any]) -> str:
    # RFC 3339 in UTC to the second, as the API server writes it: ordered as strings.
    return str((resource.get("metadata") or {}).get("creationTimestamp") or "~")


class NameClaims:
    """Every watched EmbeddingService's names and age, and so each name's owner."""

    def __init__(self, reserved: ReservedNames | None = None) -> None:
        self.reserved = reserved or ReservedNames()
        self._lock = threading.Lock()
        self._claims: dict[Key, tuple[tuple[str, ...], str]] = {}
        self._written: dict[Key, frozenset[str]] = {}
        self._by_name: dict[str, set[Key]] = {}

    def update(self, namespace: str, name: str, body: Mapping[str, Any] | None) -> set[Key]:
        """The object was seen with ``body`` (None: deleted); the other objects whose
        refusals this may have changed (every other claimant of a name it claims or claimed),
        to reconcile again."""
        key = (namespace, name)
        with self._lock:
            before = self._claims.get(key, ((), ""))[0]
            if body is None:
                self._claims.pop(key, None)
                self._written.pop(key, None)
                after: tuple[str, ...] = ()
            else:
                after = claimed_names(body)
                self._claims[key] = (after, _created(body))
                self._written[key] = written_names(body)
            for gone in set(before) - set(after):
                claimants = self._by_name.get(gone, set())
                claimants.discard(key)
                if not claimants:
                    self._by_name.pop(gone, None)
            for added in after:
                self._by_name.setdefault(added, set()).add(key)
            touched = set(before) | set(after)
            return {k for n in touched for k in self._by_name.get(n, ())} - {key}

    def _owner(self, name: str) -> Key | None:
        allowed = [k for k in self._by_name.get(name, ()) if self.reserved.allows(name, k[0])]
        return min(allowed, key=lambda k: (self._claims[k][1], k), default=None)

    def refused(self, namespace: str, name: str) -> tuple[Refusal, ...]:
        """The names the object claims and does not own, in its names' order."""
        key = (namespace, name)
        with self._lock:
            written = self._written.get(key, frozenset())
            names = [n for n in self._claims.get(key, ((), ""))[0] if n in written]
            owners = {n: self._owner(n) for n in names}
        return tuple(Refusal(n, owner) for n, owner in owners.items() if owner != key)
