"""Lease-based leader election: one leader, takeover after expiry or release, lost lease."""

from __future__ import annotations

import asyncio

from embedding_operator.kube import ApiError, ObjectRef
from embedding_operator.leader import (
    LeaderElector,
    LeadershipLostError,
    LeaseConfig,
    run_as_leader,
)

from tests.support.operator import FakeCluster

REF = ObjectRef("coordination.k8s.io/v1", "Lease", "ops", "embedding-operator")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def elector(cluster: FakeCluster, identity: str, clock: Clock, **timing: float) -> LeaderElector:
    config = LeaseConfig(name="embedding-operator", namespace="ops", identity=identity, **timing)
    return LeaderElector(cluster, config, monotonic=clock)


def test_only_one_leader_until_the_lease_expires(cluster: FakeCluster) -> None:
    clock = Clock()
    a, b = elector(cluster, "a", clock), elector(cluster, "b", clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    lease = cluster.objects[REF]["spec"]
    assert lease["holderIdentity"] == "a" and lease["leaseDurationSeconds"] == 15
    assert lease["renewTime"].endswith("Z") and len(lease["renewTime"].split(".")[1]) == 7

    clock.now += 10
    assert a.try_acquire_or_renew()  # renewal changes the record ...
    clock.now += 10
    assert not b.try_acquire_or_renew()  # ... so b restarts its expiry clock
    clock.now += 16  # a stopped renewing (crashed): b waits out the full duration
    assert b.try_acquire_or_renew()
    assert cluster.objects[REF]["spec"]["holderIdentity"] == "b"
    assert cluster.objects[REF]["spec"]["leaseTransitions"] == 1
    assert not a.try_acquire_or_renew()


def test_release_hands_over_immediately(cluster: FakeCluster) -> None:
    clock = Clock()
    a, b = elector(cluster, "a", clock), elector(cluster, "b", clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    a.release()
    assert b.try_acquire_or_renew()


def test_lost_race_is_not_leadership(cluster: FakeCluster) -> None:
    clock = Clock()
    a = elector(cluster, "a", clock)
    assert a.try_acquire_or_renew()
    real_replace = cluster.replace

    def racing_replace(manifest: dict[str, object]) -> dict[str, object]:
        raise ApiError(409, "the object has been modified")

    cluster.replace = racing_replace  # type: ignore[method-assign]
    assert not a.try_acquire_or_renew()
    cluster.replace = real_replace  # type: ignore[method-assign]
    assert a.try_acquire_or_renew()


def test_work_stops_and_raises_when_renewal_fails(cluster: FakeCluster) -> None:
    leader = elector(
        cluster, "a", Clock(), lease_duration=0.6, renew_deadline=0.3, retry_period=0.05
    )
    stopped = asyncio.Event()

    async def work(stop: asyncio.Event) -> None:
        # Someone else takes the lease away (e.g. after a long GC pause of ours).
        cluster.objects[REF]["spec"]["holderIdentity"] = "thief"
        cluster.objects[REF]["metadata"]["resourceVersion"] = "stolen"
        await asyncio.wait_for(stop.wait(), timeout=5)
        stopped.set()

    async def main() -> None:
        try:
            await run_as_leader(leader, asyncio.Event(), work)
        except LeadershipLostError:
            return
        raise AssertionError("expected LeadershipLostError")

    asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert stopped.is_set()


def test_clean_stop_releases(cluster: FakeCluster) -> None:
    leader = elector(cluster, "a", Clock(), retry_period=0.05, renew_deadline=1, lease_duration=2)

    async def main() -> None:
        stop = asyncio.Event()

        async def work(flag: asyncio.Event) -> None:
            stop.set()
            await asyncio.wait_for(flag.wait(), timeout=5)

        await run_as_leader(leader, stop, work)

    asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert not cluster.objects[REF]["spec"]["holderIdentity"]
