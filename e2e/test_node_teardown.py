"""A node whose containerd dies mid-run is still torn down to nothing.

A stopped benchmark once left 60 containerd shims with 119 container processes, their veths
and kube-proxy's NAT rules behind: containerd did not answer in time, was killed, and the
teardown's `ctr` calls failed in silence. Here a real containerd of its own (beside the session
cluster's) runs containers in pod network namespaces with veths, as the CNI bridge plugin makes
them, and the kubelet-style KUBE-* chains exist in iptables and ip6tables. containerd is then
SIGKILLed, so its shims and containers run on without it, and the node's teardown
(``Containerd.stop_process``, ``pod_cleanup``, ``remove_kube_chains``) must leave no shim,
container process, network namespace, veth, chain or mount, as ``leftovers`` checks.

Only what this test made is in scope: the "before" sets given to the cleanup are everything
that exists except its own, so the session cluster's pods and chains are never touched.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.harness import node
from e2e.harness.binaries import Binaries
from e2e.harness.cluster.real_node import leftovers, pod_cleanup
from e2e.harness.components import Containerd, Launcher, Teardown
from e2e.harness.images import import_stream
from e2e.harness.images.archive import docker_archive, tar
from e2e.harness.proc import Process, poll_until

# A containerd of this machine, run containers and host network namespaces: the local cluster.
pytestmark = pytest.mark.local_node

REPO = Path(__file__).resolve().parent.parent
PAUSE_SOURCE = REPO / "images" / "pause" / "pause.c"
TAG = "embedding-operator.local/teardown-check:1"
PODS = 2


@pytest.fixture
def standalone(tmp_path: Path) -> Iterator[tuple[node.NodePaths, Launcher, list[Process]]]:
    """A containerd of its own (socket, root and state under tmp_path); anything still running
    afterwards is stopped, as a failed test would leave it."""
    paths = node.NodePaths(state=tmp_path / "state", images=tmp_path / "store")
    spawned: list[Process] = []
    (tmp_path / "logs").mkdir()
    launcher = Launcher(tmp_path / "logs", detached=False, on_spawn=spawned.append)
    yield paths, launcher, spawned
    for process in spawned:
        if process.alive():
            Containerd.stop_process(process, Teardown(node_paths=paths, kube_proxy=None))
    node.kill_shims(paths)
    node.unmount_under(tmp_path)


def test_a_killed_containerd_leaves_no_shim_process_netns_veth_chain_or_mount(
    standalone: tuple[node.NodePaths, Launcher, list[Process]],
    e2e_binaries: Binaries,
    tmp_path: Path,
) -> None:
    paths, launcher, spawned = standalone
    pause = tmp_path / "pause"
    subprocess.run(
        ["gcc", "-Os", "-static", "-o", str(pause), str(PAUSE_SOURCE)], check=True, timeout=120
    )
    archive = tmp_path / "image.tar"
    docker_archive(
        archive, [tar({"pause": pause.read_bytes()}, mode=0o755)], tag=TAG, cmd=["/pause"]
    )

    containerd = Containerd(
        launcher,
        paths,
        cni_bin_dir=e2e_binaries.cni_bin_dir,
        resolv_conf=paths.state / "resolv.conf",
        timeout=60,
    )
    containerd.start()
    import_stream(paths.containerd_socket, ["cat", str(archive)], os.environ)

    token = secrets.token_hex(3)
    netns = {f"cni-e2e-teardown-{token}-{i}" for i in range(PODS)}
    veths = {f"vethtd{token}{i}" for i in range(PODS)}
    chains = {f"KUBE-E2E-TD-{token.upper()}"}
    made_chains: set[str] = set()
    try:
        for i, (ns, veth) in enumerate(zip(sorted(netns), sorted(veths), strict=True)):
            node.run(["ip", "netns", "add", ns])
            node.run(
                ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns]
            )
            node.run(["ip", "link", "set", veth, "up"])
            node.ctr(
                paths,
                "run",
                "-d",
                "--with-ns",
                f"network:{node.NETNS_DIR / ns}",
                TAG,
                f"teardown-{token}-{i}",
            )
        for binary in node.IPTABLES:
            for chain in chains:
                node.run([binary, "-w", "-t", "filter", "-N", chain])
                made_chains.add(f"{binary}/filter/{chain}")

        trees = poll_until(
            lambda: (t := node.shim_trees(paths)) and all(t.values()) and len(t) == PODS and t,
            timeout=60,
            what="a shim with its container per pod",
        )
        pids = [pid for shim, tree in trees.items() for pid in (shim, *tree)]

        # containerd dies mid-run: its shims and their containers run on without it.
        os.kill(containerd.running().pid, signal.SIGKILL)
        poll_until(lambda: not containerd.running().alive(), timeout=30, what="containerd's end")
        assert node.shim_trees(paths), "the shims ended with containerd: nothing to test"
        assert not node.containerd_answers(paths)

        netns_before = node.pod_netns_names() - netns
        veths_before = node.veth_names() - veths
        chains_before = [c for c in node.kube_chains() if c not in made_chains]
        errors = Containerd.stop_process(
            containerd.running(), Teardown(node_paths=paths, kube_proxy=None)
        )
        errors += pod_cleanup(paths, netns_before, veths_before)
        node.remove_kube_chains(chains_before)
        left = leftovers(paths, netns_before, chains_before, veths_before)
    finally:
        for ns in netns & node.pod_netns_names():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        for entry in made_chains & set(node.kube_chains()):
            binary, table, chain = entry.split("/")
            subprocess.run([binary, "-w", "-t", table, "-X", chain], capture_output=True)

    assert errors == [], errors
    assert left == [], left
    assert not [pid for pid in pids if node.process_running(pid)], "container processes outlived it"
    assert not node.mounts_under(paths.state, paths.images)
    assert spawned and not any(p.alive() for p in spawned)
