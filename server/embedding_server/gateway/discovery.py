"""Which models exist, under which names, and where they are served.

A discovery source publishes the whole catalog (every service, its names and its
endpoints) each time something changes; the gateway swaps it in at once. Publishing
snapshots rather than deltas keeps every source trivially correct, and catalogs are small
(one entry per EmbeddingService). Two sources exist: :class:`StaticDiscovery` (flags or a
file, for tests, benchmarks and users without Kubernetes) and
:class:`~embedding_server.gateway.kubernetes.KubernetesDiscovery`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import yaml

logger = logging.getLogger(__name__)


Version = Literal["active", "pending"]


class DiscoveryError(ValueError):
    """A routes file or flag that cannot be read as routes; the message says where."""


@dataclass(frozen=True)
class Service:
    """One served model: its names (the first is what ``/v1/models`` lists) and the base
    URLs of its endpoints (``http://10.1.2.3:8000``). ``key`` identifies it across snapshots
    (``namespace/name`` for an EmbeddingService). ``listed`` False keeps it out of
    ``/v1/models`` and error messages (but for ``--models-listing full``): an
    EmbeddingService whose pods need an API key, which the gateway cannot check."""

    key: str
    names: tuple[str, ...]
    endpoints: frozenset[str] = field(default_factory=frozenset)
    listed: bool = True
    version: Version | None = None
    """Set on one version of a service during (or outside) a model change: ``active``, what
    the service's own name routes to, or ``pending``, the model being prepared beside it.
    Its names are the service's, each with ``@`` and :attr:`fingerprint`."""
    fingerprint: str | None = None
    """The embedding fingerprint of the version's pods (of the active model on the
    service's own entry, where known)."""
    parent: str | None = None
    """A version's service: the :attr:`name` of the entry it is a version of."""

    @property
    def name(self) -> str:
        return self.names[0]


Publish = Callable[[Sequence[Service]], None]
"""Called with the whole catalog whenever it changes (on the event loop)."""


class Discovery(Protocol):
    """A source of the catalog. ``run`` publishes the first snapshot as soon as it has one,
    then every change, until cancelled."""

    async def run(self, publish: Publish) -> None: ...


def check_url(url: str, where: str) -> str:
    """An endpoint's base URL, without a trailing slash; scheme http(s) and a host needed."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DiscoveryError(f"{where}: {url!r} is not an http(s) URL with a host")
    return url.strip().rstrip("/")


def parse_route_flags(items: Iterable[str]) -> list[Service]:
    """``--routes`` items (``MODEL=URL``) -> services; a model repeated gets every URL."""
    endpoints: dict[str, set[str]] = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name.strip():
            raise DiscoveryError(f"--routes: {item!r} is not MODEL=URL")
        endpoints.setdefault(name.strip(), set()).add(check_url(url, "--routes"))
    return [Service(f"routes/{n}", (n,), frozenset(u)) for n, u in endpoints.items()]


def parse_routes_document(document: Any, where: str) -> list[Service]:
    """A routes file's content (``{"models": [{"name", "aliases", "endpoints"}]}``)."""
    if not isinstance(document, Mapping) or not isinstance(document.get("models"), list):
        raise DiscoveryError(f"{where}: expected a mapping with a 'models' list")
    services = []
    for index, entry in enumerate(document["models"]):
        at = f"{where}: models[{index}]"
        if not isinstance(entry, Mapping):
            raise DiscoveryError(f"{at}: expected a mapping")
        unknown = set(entry) - {"name", "aliases", "endpoints"}
        if unknown:
            raise DiscoveryError(f"{at}: unknown field(s) {', '.join(sorted(unknown))}")
        name = entry.get("name")
        aliases = entry.get("aliases") or []
        urls = entry.get("endpoints") or []
        if not isinstance(name, str) or not name:
            raise DiscoveryError(f"{at}.name: a non-empty string is required")
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise DiscoveryError(f"{at}.aliases: expected a list of names")
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise DiscoveryError(f"{at}.endpoints: expected a list of URLs")
        services.append(
            Service(
                f"file/{name}",
                (name, *[a for a in aliases if a != name]),
                frozenset(check_url(u, f"{at}.endpoints") for u in urls),
            )
        )
    return services


def read_routes_file(path: str) -> list[Service]:
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    try:
        document = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as error:
        raise DiscoveryError(f"{path}: not valid YAML/JSON: {error}") from None
    return parse_routes_document(document, path)


class StaticDiscovery:
    """Routes from ``--routes`` items and a routes file; the file is read again whenever
    its modification time changes (so endpoints can be added while the gateway runs).

    A file that becomes unreadable or invalid keeps the last good catalog, with a warning:
    a half-written file must not drop every route.
    """

    def __init__(
        self,
        routes: Iterable[str] = (),
        routes_file: str | None = None,
        *,
        check_interval: float = 1.0,
    ) -> None:
        self._flag_services = parse_route_flags(routes)
        self._file = routes_file
        self._interval = check_interval
        self._file_services: list[Service] = []
        self._stamp: tuple[int, int] | None = None
        if routes_file is not None:  # a bad file at start is a setting error: fail now
            self._file_services = read_routes_file(routes_file)
            self._stamp = _stamp(routes_file)

    def catalog(self) -> list[Service]:
        return [*self._flag_services, *self._file_services]

    async def run(self, publish: Publish) -> None:
        publish(self.catalog())
        if self._file is None:
            return
        while True:
            await asyncio.sleep(self._interval)
            if self._reload():
                publish(self.catalog())

    def _reload(self) -> bool:
        assert self._file is not None
        try:
            stamp = _stamp(self._file)
            if stamp == self._stamp:
                return False
            services = read_routes_file(self._file)
        except (OSError, DiscoveryError) as error:
            logger.warning("routes file not reloaded, keeping the last good one: %s", error)
            return False
        self._stamp = stamp
        self._file_services = services
        logger.info("routes file reloaded: %d model(s)", len(services))
        return True


def _stamp(path: str) -> tuple[int, int]:
    status = os.stat(path)
    return (status.st_mtime_ns, status.st_size)
