"""What the parts of the local cluster (control_plane, fake_nodes, real_node, monitoring) use of
it: ``ClusterContext``, a Protocol that ``Cluster`` (local.py) satisfies, with its ``Ports`` and
``Timeouts``. The parts import this module, never local.py, so local.py composes them and no
import goes back up."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Protocol, TypeVar

from e2e.harness import node
from e2e.harness.binaries import Binaries
from e2e.harness.components import Component, Launcher
from e2e.harness.pki import Pki
from e2e.harness.probes import AdminApi
from e2e.harness.proc import free_ports


@dataclass(frozen=True)
class Timeouts:
    """Deadlines in seconds. Generous: the machines running e2e may have 2 busy cores."""

    etcd: float = 30
    apiserver: float = 120
    crds: float = 60
    controller_manager: float = 60
    scheduler: float = 60
    nodes: float = 90
    service_account: float = 60
    command: float = 120
    containerd: float = 60
    real_node: float = 180
    dns: float = 60
    prometheus: float = 60
    adapter: float = 120
    keda: float = 120


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int
    kubelet: int
    kubelet_healthz: int
    proxy_healthz: int
    proxy_metrics: int
    coredns_health: int
    prometheus: int
    adapter: int
    keda_grpc: int
    keda_metrics: int
    keda_probe: int
    keda_apiserver: int
    keda_apiserver_metrics: int

    @classmethod
    def pick_free(cls) -> Ports:
        # Distinct, and below the ephemeral range: see free_ports.
        return cls(*free_ports(len(fields(cls))))


C = TypeVar("C", bound=Component)


class KubeCommands(Protocol):
    """kubectl and helm against a cluster as its admin, as much of ``KubeClient`` as the parts
    use."""

    def kubectl(
        self, *args: str, input: str | None = None, timeout: float | None = None
    ) -> subprocess.CompletedProcess[str]: ...

    def apply(self, manifest: str) -> str: ...

    def helm(self, *args: str) -> subprocess.CompletedProcess[str]: ...


class CrdApplier(Protocol):
    """The control plane, as the metrics pipeline uses it (KEDA's CRDs)."""

    def apply_crds(self, files: list[Path] | None = None) -> None: ...


class NodeDirectories(Protocol):
    """The real node, as the metrics pipeline uses it (its files go in the node's state)."""

    @property
    def paths(self) -> node.NodePaths: ...


class ClusterContext(KubeCommands, Protocol):
    """The cluster a part starts its components into: its binaries, ports, deadlines, files
    and credentials, the components started so far (``start_component`` and friends), and
    kubectl / helm against it. ``pki`` and ``api`` exist once the cluster has started; the
    other parts, ``control_plane`` and ``real_node``, as far as one part uses another."""

    binaries: Binaries
    ports: Ports
    timeouts: Timeouts
    launcher: Launcher
    workdir: Path
    kubeconfig: Path

    @property
    def pki(self) -> Pki: ...

    @property
    def api(self) -> AdminApi: ...

    @property
    def control_plane(self) -> CrdApplier: ...

    @property
    def real_node(self) -> NodeDirectories: ...

    def component_kubeconfig(self, name: str) -> Path: ...

    def start_component(self, component: C) -> C: ...

    def add_component(self, component: C) -> C: ...

    def stop_component(self, component: Component) -> None: ...
