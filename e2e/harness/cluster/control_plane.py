"""The control plane of the local cluster: etcd, kube-apiserver, the CRDs, the controllers.

1. etcd (``--unsafe-no-fsync``: a test cluster needs no durability) -> ``GET /health``.
2. kube-apiserver with TLS, RBAC, the default admission plugins (ServiceAccount included) and
   a ServiceAccount signing key, so the TokenRequest API issues real tokens -> ``/readyz``.
3. Every CRD in ``crds/*.yaml`` is applied and waited for ``Established`` *before* the
   controller manager starts: its garbage collector only re-reads discovery every 30s, so a
   CRD created later would not have its dependents collected for that long.
4. kube-controller-manager, every controller authenticating as its own ServiceAccount
   (``--use-service-account-credentials``) as on kubeadm clusters; short HPA sync period.
5. kube-scheduler.
"""

from __future__ import annotations

import logging
from pathlib import Path

from e2e.harness import node
from e2e.harness.cluster.context import ClusterContext
from e2e.harness.components import APIServer, ControllerManager, Etcd, Scheduler

log = logging.getLogger("e2e.cluster")


class ControlPlane:
    """Starts the control plane's components into ``cluster``, in order."""

    def __init__(
        self, cluster: ClusterContext, *, crd_dir: Path | None, hpa_sync_period: str
    ) -> None:
        self.cluster = cluster
        self.crd_dir = crd_dir
        self.hpa_sync_period = hpa_sync_period

    def start(self) -> None:
        cluster = self.cluster
        binaries, ports, timeouts = cluster.binaries, cluster.ports, cluster.timeouts
        etcd = cluster.start_component(
            Etcd(
                cluster.launcher,
                binaries.etcd,
                cluster.workdir / "etcd",
                client_port=ports.etcd_client,
                peer_port=ports.etcd_peer,
                timeout=timeouts.etcd,
            )
        )
        cluster.start_component(
            APIServer(
                cluster.launcher,
                binaries.kube_apiserver,
                cluster.api,
                etcd_url=etcd.client_url,
                port=ports.apiserver,
                service_cidr=node.SERVICE_CIDR,
                timeout=timeouts.apiserver,
            )
        )
        self.apply_crds()
        cluster.start_component(
            ControllerManager(
                cluster.launcher,
                binaries.kube_controller_manager,
                cluster.api,
                kubeconfig=cluster.component_kubeconfig("controller-manager"),
                port=ports.controller_manager,
                service_cidr=node.SERVICE_CIDR,
                hpa_sync_period=self.hpa_sync_period,
                timeout=timeouts.controller_manager,
            )
        )
        cluster.start_component(
            Scheduler(
                cluster.launcher,
                binaries.kube_scheduler,
                cluster.api,
                kubeconfig=cluster.component_kubeconfig("scheduler"),
                port=ports.scheduler,
                timeout=timeouts.scheduler,
            )
        )

    def crd_files(self) -> list[Path]:
        if self.crd_dir is None or not self.crd_dir.is_dir():
            return []
        return sorted(p for p in self.crd_dir.iterdir() if p.suffix in (".yaml", ".yml", ".json"))

    def apply_crds(self, files: list[Path] | None = None) -> None:
        """Apply ``files`` (default: ``crd_dir``'s) and wait until their CRDs are Established."""
        files = self.crd_files() if files is None else files
        if not files:
            log.info("[cluster] no CRDs in %s", self.crd_dir)
            return
        cluster = self.cluster
        names: list[str] = []
        for path in files:
            out = cluster.kubectl("apply", "--server-side", "-f", str(path), "-o", "name").stdout
            names += out.split()
        crds = [n for n in names if n.startswith("customresourcedefinition")]
        if crds:
            cluster.kubectl(
                "wait",
                "--for=condition=Established",
                f"--timeout={cluster.timeouts.crds:.0f}s",
                *crds,
                timeout=cluster.timeouts.crds + 30,
            )
        log.info("[cluster] applied and established: %s", ", ".join(crds) or "(no CRDs)")
