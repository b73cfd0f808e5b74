"""``Cluster``: the harness's own cluster, its parts started in order on this machine.

1. the control plane (control_plane.py): etcd, kube-apiserver, the CRDs, kube-controller-manager
   and kube-scheduler;
2. kwok's fake GPU nodes (fake_nodes.py);
3. the real node (real_node.py): containerd, the images, kube-proxy, CoreDNS, the kubelet;
4. the metrics pipeline (monitoring.py): Prometheus, prometheus-adapter and KEDA;

and the cluster is ready when the ``default`` ServiceAccount exists (proof that the controllers
reconcile). Each process is one class in components.py (command line, files, health probe), as
envtest has one per binary; each step is polled to readiness under a deadline before the next
starts.

``stop()`` (and any failure during ``start()``) stops the components in reverse order, SIGTERM
then SIGKILL, whole process groups, then cleans up after the node. Ports are free ports on
127.0.0.1 picked at start, below the kernel's ephemeral range (``free_ports``). The parts know
the cluster only as a ``ClusterContext`` (context.py), which ``Cluster`` satisfies.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from types import TracebackType

from e2e.harness import node
from e2e.harness.binaries import Binaries
from e2e.harness.cluster.client import (
    KubeClient,
    b64,
    cert_user,
    kubeconfig_dict,
    write_kubeconfig,
)
from e2e.harness.cluster.context import C, Ports, Timeouts
from e2e.harness.cluster.control_plane import ControlPlane
from e2e.harness.cluster.fake_nodes import FakeNodes
from e2e.harness.cluster.monitoring import MetricsPipeline
from e2e.harness.cluster.real_node import RealNode
from e2e.harness.cluster.state import STATE_FILE, write_state
from e2e.harness.components import Component, Launcher, Teardown, stop_processes
from e2e.harness.host_packages import ensure_packages
from e2e.harness.pki import Pki, create_pki
from e2e.harness.probes import AdminApi
from e2e.harness.proc import ClusterError, Process

log = logging.getLogger("e2e.cluster")

E2E_DIR = Path(__file__).resolve().parents[2]
REPO_ROOT = E2E_DIR.parent
DEFAULT_CRD_DIR = REPO_ROOT / "crds"
DEFAULT_NODES_FILE = E2E_DIR / "nodes.yaml"


class Cluster(KubeClient):
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok's fake GPU
    nodes + one real node (see ``node.py``) + Prometheus, prometheus-adapter and KEDA, each a
    ``Component`` (components.py) in ``components``, in start order; and, as a
    ``KubeClient``, kubectl and helm against it as its admin.

    Use as a context manager, or call ``start()`` / ``stop()``. ``detached=True`` leaves the
    processes running after this Python process exits (see ``state.stop_detached``).
    ``fake_nodes`` picks which nodes of ``nodes.yaml`` to create (default: all);
    ``node_taints`` are registered on the real node; ``image_loader`` is called with the
    containerd socket before the kubelet starts, to import the images pods will run.
    ``keda=False`` leaves KEDA out (``bench.operator_scale``: its watches of every HPA and
    ScaledObject would load the control plane being measured).
    """

    def __init__(
        self,
        binaries: Binaries,
        workdir: Path,
        *,
        crd_dir: Path | None = DEFAULT_CRD_DIR,
        nodes_file: Path | None = DEFAULT_NODES_FILE,
        detached: bool = False,
        hpa_sync_period: str = "5s",
        timeouts: Timeouts | None = None,
        fake_nodes: Collection[str] | None = None,
        node_taints: Sequence[str] = (),
        image_loader: Callable[[Path], object] | None = None,
        keda: bool = True,
    ) -> None:
        self.timeouts = timeouts or Timeouts()
        workdir = workdir.resolve()
        super().__init__(
            workdir / "kubeconfig",
            kubectl=binaries.kubectl,
            helm=binaries.helm,
            workdir=workdir,
            bin_dirs=binaries.bin_dirs(),
            command_timeout=self.timeouts.command,
            service_account_timeout=self.timeouts.service_account,
        )
        self.binaries = binaries
        self.detached = detached
        self.ports = Ports.pick_free()
        self.server = f"https://{node.NODE_IP}:{self.ports.apiserver}"
        self.log_dir = self.workdir / "logs"
        self.launcher = Launcher(self.log_dir, detached=detached, on_spawn=self._record)
        self.components: list[Component] = []
        self.processes: list[Process] = []
        self.startup_seconds: float | None = None
        self._pki: Pki | None = None
        self._api: AdminApi | None = None
        self.control_plane = ControlPlane(self, crd_dir=crd_dir, hpa_sync_period=hpa_sync_period)
        self.fake_nodes = FakeNodes(self, nodes_file=nodes_file, names=fake_nodes)
        self.real_node = RealNode(self, taints=node_taints, image_loader=image_loader)
        self.metrics = MetricsPipeline(self, keda=keda)

    @property
    def ca_file(self) -> Path:
        return self.pki.ca.cert

    @property
    def pki(self) -> Pki:
        if self._pki is None:
            raise ClusterError("the cluster has not been started")
        return self._pki

    @property
    def api(self) -> AdminApi:
        if self._api is None:
            raise ClusterError("the cluster has not been started")
        return self._api

    def start(self) -> Cluster:
        started = time.monotonic()
        log.info("[cluster] starting in %s (apiserver %s)", self.workdir, self.server)
        try:
            self._prepare()
            self.control_plane.start()
            self.fake_nodes.start()
            self.real_node.start()
            self.metrics.start()
            self.wait_for_service_account("default", "default")
        except BaseException:
            log.error("[cluster] start failed; stopping what was started (logs: %s)", self.log_dir)
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        log.info("[cluster] ready in %.1fs", self.startup_seconds)
        return self

    def stop(self) -> None:
        """Stop every component in reverse start order, remove the containers, mounts, network
        namespaces, bridges and iptables rules the node made; drop etcd's data (logs stay)."""
        errors = stop_processes(self.processes, self._teardown())
        errors += self.real_node.cleanup()
        self.processes.clear()
        self.components.clear()
        shutil.rmtree(self.workdir / "etcd", ignore_errors=True)
        (self.workdir / STATE_FILE).unlink(missing_ok=True)
        if errors:
            raise ClusterError("; ".join(errors))

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- what the parts use ----------------------------------------------------------------

    @property
    def prometheus_url(self) -> str:
        """The metrics pipeline's Prometheus (on 127.0.0.1)."""
        return f"http://127.0.0.1:{self.ports.prometheus}"

    def start_component(self, component: C) -> C:
        """Start ``component`` (spawn, then wait until ready) as the next one in order."""
        self.components.append(component)
        component.start()
        return component

    def add_component(self, component: C) -> C:
        """Spawn ``component`` as the next one in order; the caller waits for it later."""
        self.components.append(component)
        component.spawn()
        return component

    def stop_component(self, component: Component) -> None:
        """Stop one component before the others (they stay up); it is forgotten."""
        errors = component.stop(self._teardown())
        if component.process is not None and component.process in self.processes:
            self.processes.remove(component.process)
        self.components.remove(component)
        if self.detached:
            self._write_state()
        if errors:
            raise ClusterError("; ".join(errors))

    def component_kubeconfig(self, name: str) -> Path:
        return self.workdir / "kubeconfigs" / f"{name}.kubeconfig"

    # -- KubeClient, answered locally --------------------------------------------------------

    def service_account_exists(self, namespace: str, name: str) -> bool:
        return bool(self.api.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}"))

    def cluster_entry(self) -> dict[str, str]:
        return {"server": self.server, "certificate-authority-data": b64(self.ca_file)}

    # -- internals --------------------------------------------------------------------------

    def _record(self, process: Process) -> None:
        self.processes.append(process)
        if self.detached:
            self._write_state()

    def _teardown(self) -> Teardown:
        return Teardown(node_paths=self.real_node.paths, kube_proxy=self.binaries.kube_proxy)

    def _write_state(self) -> None:
        write_state(
            self.workdir,
            {
                "server": self.server,
                "kubeconfig": str(self.kubeconfig),
                "bin_dirs": [str(d) for d in self.binaries.bin_dirs()],
                "processes": [p.to_json() for p in self.processes],
                **self.real_node.state(),
            },
        )

    def _prepare(self) -> None:
        for field_name, binary in vars(self.binaries).items():
            if field_name != "cni_bin_dir" and not os.access(binary, os.X_OK):
                raise ClusterError(f"missing binary {binary}; run `python -m e2e.harness.binaries`")
        node.require_root()
        ensure_packages(node.NODE_PACKAGES)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.real_node.network_up()
        self._pki = create_pki(self.workdir / "pki")
        pki = self._pki
        self._api = AdminApi(self.server, pki)
        write_kubeconfig(
            self.kubeconfig,
            kubeconfig_dict(self.server, pki.ca.cert, cert_user(pki.admin.cert, pki.admin.key)),
        )
        for name, pair in (
            ("controller-manager", pki.controller_manager),
            ("scheduler", pki.scheduler),
            ("kubelet", pki.node),
            ("kube-proxy", pki.kube_proxy),
        ):
            write_kubeconfig(
                self.component_kubeconfig(name),
                kubeconfig_dict(self.server, pki.ca.cert, cert_user(pair.cert, pair.key)),
            )
