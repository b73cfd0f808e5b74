"""The local cluster's real node: containerd and the images, kube-proxy, CoreDNS, the kubelet.

The host side (bridges, guard rules, config files, cleanup) is node.py; this composes the
node's processes into the cluster. Ready when the node is Ready, kube-proxy has synced for it
and CoreDNS answers for the ``kubernetes`` Service. Stopping removes the containers, mounts,
network namespaces, bridges and iptables rules the node made, and only those: what existed
before the cluster (``netns_before`` and friends) is left alone.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from e2e.harness import node
from e2e.harness.cluster.context import ClusterContext
from e2e.harness.components import Containerd, CoreDNS, Kubelet, KubeProxy
from e2e.harness.images import ImportFailed

log = logging.getLogger("e2e.cluster")

# The e2e session taints the real node so the kwok-era tests never start real pods there;
# the real-node tests tolerate it (a GPU profile and the chart's operator tolerations).
REAL_NODE_TAINT_KEY = "e2e.embedding-operator.dev/real-node"
REAL_NODE_TAINT = f"{REAL_NODE_TAINT_KEY}=true:NoSchedule"


class RealNode:
    """``taints`` are registered on the node; ``image_loader`` is called with the containerd
    socket before the kubelet starts, to import the images pods will run."""

    def __init__(
        self,
        cluster: ClusterContext,
        *,
        taints: Sequence[str],
        image_loader: Callable[[Path], object] | None,
    ) -> None:
        self.cluster = cluster
        self.taints = tuple(taints)
        self.image_loader = image_loader
        self.paths = node.NodePaths(state=cluster.workdir / "node", images=node.containerd_store())
        self.network_restore: dict[str, Any] = {}
        # What existed before this cluster: cleanup() removes only what it added.
        self.netns_before = node.pod_netns_names()
        self.host_paths_before = node.existing_host_paths()
        self.chains_before = node.kube_chains()
        self.veths_before = node.veth_names()

    def network_up(self) -> None:
        """The node's address must exist before the apiserver binds to it."""
        self.network_restore = node.network_up()

    def start(self) -> None:
        cluster, paths, timeouts = self.cluster, self.paths, self.cluster.timeouts
        if self.image_loader is None:
            self._start_containerd()
        else:
            t0 = time.monotonic()
            start_containerd_with_images(
                self._start_containerd, cluster.stop_component, self.image_loader
            )
            log.info("[cluster] images loaded into containerd (%.1fs)", time.monotonic() - t0)

        # Its healthz turns 200 only once it has synced for its Node: waited for below.
        proxy = cluster.add_component(
            KubeProxy(
                cluster.launcher,
                cluster.binaries.kube_proxy,
                config_file=paths.state / "kube-proxy.yaml",
                kubeconfig=cluster.component_kubeconfig("kube-proxy"),
                healthz_port=cluster.ports.proxy_healthz,
                metrics_port=cluster.ports.proxy_metrics,
                timeout=timeouts.real_node,
            )
        )
        coredns = cluster.start_component(
            CoreDNS(
                cluster.launcher,
                cluster.binaries.coredns,
                corefile=paths.state / "Corefile",
                kubeconfig=cluster.kubeconfig,
                health_port=cluster.ports.coredns_health,
                timeout=timeouts.dns,
            )
        )
        cluster.start_component(
            Kubelet(
                cluster.launcher,
                cluster.binaries.kubelet,
                cluster.api,
                paths,
                config_file=paths.state / "kubelet.yaml",
                kubeconfig=cluster.component_kubeconfig("kubelet"),
                port=cluster.ports.kubelet,
                healthz_port=cluster.ports.kubelet_healthz,
                resolv_conf=paths.state / "resolv.conf",
                taints=self.taints,
                timeout=timeouts.real_node,
            )
        )
        proxy.wait_ready()
        coredns.wait_resolving()

    def _start_containerd(self) -> Containerd:
        return self.cluster.start_component(
            Containerd(
                self.cluster.launcher,
                self.paths,
                cni_bin_dir=self.cluster.binaries.cni_bin_dir,
                resolv_conf=self.paths.state / "resolv.conf",
                timeout=self.cluster.timeouts.containerd,
            )
        )

    def cleanup(self) -> list[str]:
        """After the processes are stopped: see ``node_cleanup``."""
        return node_cleanup(
            self.paths,
            self.network_restore,
            self.netns_before,
            self.host_paths_before,
            self.chains_before,
            self.veths_before,
        )

    def state(self) -> dict[str, Any]:
        """What ``down`` needs to clean up after a detached cluster's node (state.py)."""
        return {
            "containerd_socket": str(self.paths.containerd_socket),
            "node_state": str(self.paths.state),
            "node_images": str(self.paths.images),
            "kube_proxy": str(self.cluster.binaries.kube_proxy),
            "network_restore": self.network_restore,
            "netns_before": sorted(self.netns_before),
            "host_paths_before": self.host_paths_before,
            "chains_before": self.chains_before,
            "veths_before": sorted(self.veths_before),
        }


def node_cleanup(
    paths: node.NodePaths,
    network_restore: Mapping[str, Any],
    netns_before: Iterable[str],
    host_paths_before: Sequence[str],
    chains_before: Sequence[str],
    veths_before: Iterable[str] | None = None,
) -> list[str]:
    """Unmount what containerd mounted, delete the pods' network namespaces and veths, the
    bridges and the guard rules, the kubelet's and kube-proxy's chains (iptables and
    ip6tables); then check that none of it, and no shim of this node's containerd, is left.
    The problems met and everything left behind, as messages. ``veths_before`` None (a state
    file of an older harness): the veths are not checked."""
    netns_before = set(netns_before)
    errors = pod_cleanup(paths, netns_before, veths_before)
    errors += node.network_down(dict(network_restore))
    node.remove_host_paths(host_paths_before)
    node.remove_kube_chains(chains_before)
    shutil.rmtree(paths.state, ignore_errors=True)
    errors += leftovers(paths, netns_before, chains_before, veths_before)
    return errors


def pod_cleanup(
    paths: node.NodePaths, netns_before: Iterable[str], veths_before: Iterable[str] | None
) -> list[str]:
    """What the node's containers leave: the shims and their processes (normally gone with
    containerd's stop; after a containerd that was killed, or a stop interrupted before it,
    they would hold the rest), the mounts under the node's directories, the pods' network
    namespaces and veths that did not exist before. The problems met, as messages."""
    errors = node.kill_shims(paths)
    stuck = node.unmount_under(paths.state, paths.images)
    if stuck:
        errors.append(f"could not unmount {stuck}")
    node.remove_netns(node.pod_netns_names() - set(netns_before))
    if veths_before is not None:
        errors += node.remove_veths(node.veth_names() - set(veths_before))
    return errors


def leftovers(
    paths: node.NodePaths,
    netns_before: Iterable[str],
    chains_before: Sequence[str],
    veths_before: Iterable[str] | None,
) -> list[str]:
    """What this node made that is still there: shims and their processes, network
    namespaces, veths, KUBE-* chains (v4 and v6), mounts under its directories."""
    found = []
    for shim, tree in node.shim_trees(paths).items():
        found.append(f"left behind: containerd shim {shim} with {len(tree)} process(es)")
    netns = node.pod_netns_names() - set(netns_before)
    if netns:
        found.append(f"left behind: network namespaces {sorted(netns)}")
    if veths_before is not None:
        veths = node.veth_names() - set(veths_before)
        if veths:
            found.append(f"left behind: veths {sorted(veths)}")
    chains = [c for c in node.kube_chains() if c not in set(chains_before)]
    if chains:
        found.append(f"left behind: chains {chains}")
    mounts = node.mounts_under(paths.state, paths.images)
    if mounts:
        found.append(f"left behind: mounts {mounts}")
    return found


def start_containerd_with_images(
    start: Callable[[], Containerd],
    stop: Callable[[Containerd], None],
    load: Callable[[Path], object],
) -> Containerd:
    """Start containerd, then import the node's images into its store (``load(socket)``).

    The store outlives clusters (it is in the cache), and a store whose two databases disagree
    about a snapshot (containerd's and the snapshotter's) refuses imports that touch it; CI met
    one ("parent snapshot ... does not exist"). Removing every image and letting containerd
    collect does not mend it: the same import fails the same way (tried). So an import the
    store refuses is retried once on an empty store: containerd stops, its root is deleted, a
    new one starts and imports everything (minutes for the server's layers, once)."""
    containerd = start()
    try:
        load(containerd.paths.containerd_socket)
    except ImportFailed as exc:
        store = containerd.paths.images
        log.warning(
            "[cluster] containerd's store %s refused the import; starting containerd over an "
            "empty store and importing once more. The refusal: %s",
            store,
            exc,
        )
        stop(containerd)
        node.discard_store(store)
        containerd = start()
        load(containerd.paths.containerd_socket)
    return containerd
