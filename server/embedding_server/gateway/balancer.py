"""Each endpoint's load, and the pick of the least-loaded one.

The load of an endpoint is what its server reports on ``GET /load`` (tokens queued and
running, polled every ``--poll-interval``) plus what this gateway has sent it since and not
had answered (its in-flight tokens). The poll alone lags by up to one interval, so a burst
would all go to the pod that looked idle at the last poll; the in-flight count alone misses
what other gateway replicas and direct clients sent. Together they are current for this
gateway's own traffic and at most one interval stale for everyone else's.

The pick is power of two choices: two ready endpoints drawn at random, the less loaded one
wins. Always taking the global minimum sends every gateway replica's next requests to the
same pod between polls (herding); two random choices keep most of the benefit without it
(Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing", 2001).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import aiohttp
import orjson

logger = logging.getLogger(__name__)

FAILURES_BEFORE_UNREADY = 2
"""Consecutive failed polls after which an endpoint stops getting new requests. One failure
can be a blip (a GC pause past the poll timeout); a pod that is gone refuses every poll."""


@dataclass
class EndpointState:
    """What the gateway knows of one endpoint (``url``: its base URL)."""

    url: str
    ready: bool = False
    polled: bool = False
    queued_tokens: int = 0
    running_tokens: int = 0
    backlog_seconds: float = 0.0
    in_flight_requests: int = 0
    in_flight_tokens: int = 0
    failures: int = 0
    last_poll: float = 0.0
    refused_at: float = 0.0
    """When a forwarded request last found it gone (``time.monotonic()``)."""

    @property
    def load_tokens(self) -> int:
        """Tokens ahead of a new request: the server's queue and batches, plus this
        gateway's requests not yet answered."""
        return self.queued_tokens + self.running_tokens + self.in_flight_tokens

    def apply_load(self, report: dict[str, object]) -> None:
        """Take a ``/load`` answer (unknown or mistyped fields read as 0)."""
        self.polled = True
        self.failures = 0
        self.last_poll = time.monotonic()
        self.ready = report.get("ready") is True
        self.queued_tokens = _int(report.get("queued_tokens"))
        self.running_tokens = _int(report.get("running_tokens"))
        backlog = report.get("backlog_seconds")
        self.backlog_seconds = float(backlog) if isinstance(backlog, int | float) else 0.0

    def poll_failed(self) -> None:
        self.failures += 1
        self.last_poll = time.monotonic()
        if self.failures >= FAILURES_BEFORE_UNREADY:
            self.ready = False

    def refused(self) -> None:
        """A forwarded request found the endpoint gone (connection refused, reset, or 503
        draining): stop sending it more until a poll begun after this says it is ready
        again (a pod restarted on its address is then routed to again, retries included)."""
        self.ready = False
        self.refused_at = time.monotonic()


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


Choose = Callable[[Sequence[EndpointState]], EndpointState]


def least_backlog(rng: random.Random) -> Choose:
    """Power of two choices on :attr:`EndpointState.load_tokens` (ties: fewer in flight)."""

    def choose(candidates: Sequence[EndpointState]) -> EndpointState:
        if len(candidates) == 1:
            return candidates[0]
        a, b = rng.sample(candidates, 2)
        key_a = (a.load_tokens, a.in_flight_requests)
        key_b = (b.load_tokens, b.in_flight_requests)
        return a if key_a <= key_b else b

    return choose


def random_choice(rng: random.Random) -> Choose:
    """Uniform random, as kube-proxy's iptables/IPVS random mode does (for comparison)."""

    def choose(candidates: Sequence[EndpointState]) -> EndpointState:
        return rng.choice(candidates)

    return choose


class LoadPoller:
    """Polls ``GET /load`` of every known endpoint every ``interval`` seconds, at most
    ``concurrency`` at once, each within ``timeout``; ``on_change`` is called when an
    endpoint's readiness flips (the gateway releases held requests then)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        interval: float,
        timeout: float,
        concurrency: int,
        on_change: Callable[[EndpointState], None],
    ) -> None:
        self._session = session
        self._interval = interval
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._limit = asyncio.Semaphore(concurrency)
        self._on_change = on_change
        self.endpoints: dict[str, EndpointState] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def track(self, urls: Iterable[str]) -> None:
        """Set the endpoints to poll: new ones are polled at once, gone ones forgotten."""
        wanted = set(urls)
        for url in list(self.endpoints):
            if url not in wanted:
                del self.endpoints[url]
        new = [url for url in wanted if url not in self.endpoints]
        for url in new:
            self.endpoints[url] = EndpointState(url)
        if new:
            self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="load-poller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            states = list(self.endpoints.values())
            if states:
                await asyncio.gather(*(self.poll(state) for state in states))
            self._wake.clear()
            remaining = self._interval - (time.monotonic() - started)
            if remaining > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), remaining)

    async def poll(self, state: EndpointState) -> None:
        """One poll of one endpoint."""
        was_ready = state.ready
        async with self._limit:
            started = time.monotonic()
            try:
                async with self._session.get(state.url + "/load", timeout=self._timeout) as resp:
                    body = await resp.read()
                report = orjson.loads(body) if resp.status in (200, 503) else None
            except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
                report = None
        if isinstance(report, dict):
            state.apply_load(report)
            if started < state.refused_at:
                # Asked before a request found the endpoint gone: it says nothing of now.
                state.ready = False
        else:
            state.poll_failed()
        if state.ready != was_ready:
            logger.info("endpoint %s is %s", state.url, "ready" if state.ready else "not ready")
            self._on_change(state)
