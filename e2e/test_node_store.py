"""The real node's image store outlives clusters (it is in the cache), so it must mend itself.

CI once met a kept store that refused an import ("failed to prepare extraction snapshot ...:
parent snapshot ... does not exist"): containerd's database and the overlayfs snapshotter's
disagreed about a layer, and every e2e test errored at setup. Here a real containerd gets such
a store (the snapshotter's database deleted while containerd's keeps its records) and the
node's start has to end with the image ready.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.harness import node
from e2e.harness.binaries import Binaries
from e2e.harness.cluster import start_containerd_with_images
from e2e.harness.components import Containerd, Launcher, Teardown
from e2e.harness.images import containerd_images, import_stream
from e2e.harness.images.archive import docker_archive, tar
from e2e.harness.proc import Process

# A containerd of this machine, and the node's store-mending start: the local cluster only.
pytestmark = pytest.mark.local_node

TAG = "embedding-operator.local/store-check:1"


@pytest.fixture
def standalone(tmp_path: Path, e2e_binaries: Binaries) -> Iterator[tuple[node.NodePaths, Launcher]]:
    """A containerd of its own (socket, root and state under tmp_path), beside any cluster's;
    whatever it started is stopped afterwards."""
    paths = node.NodePaths(state=tmp_path / "state", images=tmp_path / "store")
    spawned: list[Process] = []
    launcher = Launcher(tmp_path / "logs", detached=False, on_spawn=spawned.append)
    (tmp_path / "logs").mkdir()
    yield paths, launcher
    for process in spawned:
        if process.alive():
            Containerd.stop_process(process, Teardown(node_paths=paths, kube_proxy=None))
    assert node.unmount_under(tmp_path) == []


def test_a_kept_store_that_refuses_the_import_is_replaced_by_an_empty_one(
    standalone: tuple[node.NodePaths, Launcher],
    e2e_binaries: Binaries,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    paths, launcher = standalone
    base = tar({"first": b"1" * 4096})
    old = tmp_path / "old.tar"
    new = tmp_path / "new.tar"
    docker_archive(old, [base, tar({"second": b"2"})], tag=TAG, cmd=["/first"])
    docker_archive(
        new, [base, tar({"second": b"2"}), tar({"third": b"3"})], tag=TAG, cmd=["/first"]
    )

    def start() -> Containerd:
        containerd = Containerd(
            launcher,
            paths,
            cni_bin_dir=e2e_binaries.cni_bin_dir,
            resolv_conf=paths.state / "resolv.conf",
            timeout=60,
        )
        containerd.start()
        return containerd

    def stop(containerd: Containerd) -> None:
        assert containerd.stop(Teardown(node_paths=paths, kube_proxy=None)) == []

    # A store as a cache keeps it: the old image imported, containerd stopped.
    first = start()
    import_stream(paths.containerd_socket, ["cat", str(old)], os.environ)
    assert TAG in containerd_images(paths.containerd_socket)[1]
    stop(first)
    # The snapshotter forgets its snapshots; containerd's database still lists them.
    (paths.images / "io.containerd.snapshotter.v1.overlayfs" / "metadata.db").unlink()

    listed_before: list[set[str]] = []
    ready_before: list[set[str]] = []

    def load(socket: Path) -> None:
        listed, ready = containerd_images(socket)
        listed_before.append(listed)
        ready_before.append(ready)
        import_stream(socket, ["cat", str(new)], os.environ)

    with caplog.at_level(logging.WARNING, logger="e2e.cluster"):
        containerd = start_containerd_with_images(start, stop, load)
    try:
        # The broken store still lists the old image but does not call it ready, so the
        # loader re-imports it rather than trusting it; the import was refused, and the
        # second try met an empty store.
        assert len(ready_before) == 2, ready_before
        assert TAG in listed_before[0]
        assert TAG not in ready_before[0]
        assert ready_before[1] == set()
        assert f"containerd's store {paths.images} refused the import" in caplog.text

        assert TAG in containerd_images(paths.containerd_socket)[1]
        # Only the new image's three layers: nothing of the old store survived.
        snapshots = node.ctr(paths, "snapshots", "ls").splitlines()[1:]
        assert len(snapshots) == 3, snapshots
    finally:
        stop(containerd)
