"""Leader election on a coordination.k8s.io Lease, so two replicas never reconcile at once.

Why not kopf's peering: it needs two extra CRDs (ClusterKopfPeering/KopfPeering), replicas of
one Deployment all get the same priority unless each is configured differently, and peering is
a pause-on-sight protocol with a window where two equal peers both run. A Lease is what
kube-controller-manager, kube-scheduler and controller-runtime use: built into every cluster,
compare-and-swap on ``resourceVersion``, visible with ``kubectl get lease``.

The algorithm follows client-go's ``leaderelection``:

* a candidate polls every ``retry_period``; it takes the Lease when there is no holder, it is
  the holder, or the holder's record has not changed for ``lease_duration`` *as observed
  locally* (a monotonic clock, so clock skew between nodes cannot make a live leader look
  expired);
* the leader renews every ``retry_period``; if it cannot renew for ``renew_deadline`` it stops
  reconciling and the process exits non-zero (Kubernetes restarts it as a candidate), the same
  "lose the lease, exit" contract as controller-runtime, which avoids a half-stopped leader;
* on a clean shutdown the leader releases the Lease (empty holder) so a standby takes over at
  its next poll instead of waiting out the lease.

kopf runs in ``standalone`` mode underneath; only the leader runs it at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from embedding_operator.kube import ApiError, ObjectRef

log = logging.getLogger(__name__)

LEASE_API_VERSION = "coordination.k8s.io/v1"


class LeaseApi(Protocol):
    def get(self, ref: ObjectRef) -> dict[str, Any] | None: ...

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]: ...

    def replace(self, manifest: dict[str, Any]) -> dict[str, Any]: ...


def _micro_time(now: datetime) -> str:
    # metav1.MicroTime wants exactly six fractional digits.
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaseConfig:
    name: str
    namespace: str
    identity: str
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0


class LeaderElector:
    """One candidate's view of the Lease; call ``try_acquire_or_renew`` every retry period."""

    def __init__(
        self,
        api: LeaseApi,
        config: LeaseConfig,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._api = api
        self.config = config
        self._monotonic = monotonic
        self._wall = wall
        self._observed: tuple[object, ...] | None = None
        self._observed_at = 0.0

    @property
    def _ref(self) -> ObjectRef:
        return ObjectRef(LEASE_API_VERSION, "Lease", self.config.namespace, self.config.name)

    def _spec(self, acquire_time: str, transitions: int) -> dict[str, Any]:
        return {
            "holderIdentity": self.config.identity,
            "leaseDurationSeconds": max(1, round(self.config.lease_duration)),
            "acquireTime": acquire_time,
            "renewTime": _micro_time(self._wall()),
            "leaseTransitions": transitions,
        }

    def try_acquire_or_renew(self) -> bool:
        """True if we hold the Lease now. API errors count as "not now" (and are logged)."""
        try:
            return self._try()
        except ApiError as exc:
            log.warning(
                "leader election: lease %s/%s: %s", self.config.namespace, self.config.name, exc
            )
            return False

    def _try(self) -> bool:
        now_mono = self._monotonic()
        lease = self._api.get(self._ref)
        if lease is None:
            spec_created = self._spec(_micro_time(self._wall()), 0)
            manifest = {
                "apiVersion": LEASE_API_VERSION,
                "kind": "Lease",
                "metadata": {"name": self.config.name, "namespace": self.config.namespace},
                "spec": spec_created,
            }
            try:
                self._api.create(manifest)
            except ApiError as exc:
                if exc.status == 409:
                    return False
                raise
            self._observe(spec_created, now_mono)
            return True

        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        self._observe(spec, now_mono)
        duration = float(spec.get("leaseDurationSeconds") or self.config.lease_duration)
        held_by_other = holder not in ("", self.config.identity)
        if held_by_other and now_mono < self._observed_at + duration:
            return False
        ours = holder == self.config.identity
        acquired = spec.get("acquireTime")
        new_spec = self._spec(
            acquire_time=str(acquired) if ours and acquired else _micro_time(self._wall()),
            transitions=int(spec.get("leaseTransitions") or 0) + (0 if ours else 1),
        )
        try:
            self._api.replace(self._manifest(new_spec, lease["metadata"]["resourceVersion"]))
        except ApiError as exc:
            if exc.status == 409:  # someone else wrote first
                return False
            raise
        if not ours:
            log.info(
                "leader election: %s acquired lease %s/%s (previous holder %r)",
                self.config.identity,
                self.config.namespace,
                self.config.name,
                holder,
            )
        self._observe(new_spec, now_mono)
        return True

    def _manifest(self, spec: dict[str, Any], resource_version: str) -> dict[str, Any]:
        """Our Lease with ``spec``, conditional on ``resource_version`` (409 if it moved on)."""
        return {
            "apiVersion": LEASE_API_VERSION,
            "kind": "Lease",
            "metadata": {
                "name": self.config.name,
                "namespace": self.config.namespace,
                "resourceVersion": resource_version,
            },
            "spec": spec,
        }

    def _observe(self, spec: dict[str, Any], now_mono: float) -> None:
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed = record
            self._observed_at = now_mono

    def release(self) -> None:
        """Give the Lease up if we hold it (clean shutdown: the standby need not wait)."""
        try:
            lease = self._api.get(self._ref)
            if (
                lease is None
                or (lease.get("spec") or {}).get("holderIdentity") != self.config.identity
            ):
                return
            spec = dict(lease["spec"])
            spec.update(
                holderIdentity=None, leaseDurationSeconds=1, renewTime=_micro_time(self._wall())
            )
            self._api.replace(self._manifest(spec, lease["metadata"]["resourceVersion"]))
            log.info(
                "leader election: released lease %s/%s", self.config.namespace, self.config.name
            )
        except ApiError as exc:
            log.warning("leader election: could not release the lease: %s", exc)


class LeadershipLostError(RuntimeError):
    """The Lease could not be renewed in time; the process must stop reconciling."""


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)


async def acquire(elector: LeaderElector, stop: asyncio.Event) -> bool:
    """Wait until we lead (True) or ``stop`` is set (False)."""
    log.info(
        "leader election: %s waiting for lease %s/%s",
        elector.config.identity,
        elector.config.namespace,
        elector.config.name,
    )
    while not stop.is_set():
        if await asyncio.to_thread(elector.try_acquire_or_renew):
            return True
        await _sleep_or_stop(stop, elector.config.retry_period)
    return False


async def keep_renewing(elector: LeaderElector, stop: asyncio.Event, lost: asyncio.Event) -> None:
    """Renew until ``stop``; set ``lost`` if renewal failed for ``renew_deadline``."""
    last_ok = time.monotonic()
    while not stop.is_set():
        await _sleep_or_stop(stop, elector.config.retry_period)
        if stop.is_set():
            return
        if await asyncio.to_thread(elector.try_acquire_or_renew):
            last_ok = time.monotonic()
        elif time.monotonic() - last_ok > elector.config.renew_deadline:
            log.error(
                "leader election: could not renew lease %s/%s for %.0fs; stopping",
                elector.config.namespace,
                elector.config.name,
                elector.config.renew_deadline,
            )
            lost.set()
            return


async def run_as_leader(
    elector: LeaderElector, stop: asyncio.Event, work: Callable[[asyncio.Event], Awaitable[None]]
) -> None:
    """Run ``work(stop_flag)`` while leading; raise LeadershipLostError if the lease is lost."""
    if not await acquire(elector, stop):
        return
    lost = asyncio.Event()
    work_stop = asyncio.Event()

    async def relay() -> None:
        waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(lost.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        work_stop.set()

    renewer = asyncio.create_task(keep_renewing(elector, work_stop, lost))
    relayer = asyncio.create_task(relay())
    try:
        await work(work_stop)
    finally:
        work_stop.set()
        relayer.cancel()
        await asyncio.gather(renewer, relayer, return_exceptions=True)
        if not lost.is_set():
            await asyncio.to_thread(elector.release)
    if lost.is_set():
        raise LeadershipLostError(f"lost lease {elector.config.namespace}/{elector.config.name}")
