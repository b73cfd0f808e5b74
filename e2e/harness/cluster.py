"""A real local Kubernetes control plane for e2e tests, from real binaries on 127.0.0.1.

Start order, each step polled to readiness under a deadline before the next one starts:

1. etcd (``--unsafe-no-fsync``: a test cluster needs no durability) -> ``GET /health``.
2. kube-apiserver with TLS, RBAC, the default admission plugins (ServiceAccount included) and
   a ServiceAccount signing key, so the TokenRequest API issues real tokens -> ``/readyz``.
3. Every CRD in ``crds/*.yaml`` is applied and waited for ``Established`` *before* the
   controller manager starts: its garbage collector only re-reads discovery every 30s, so a
   CRD created later would not have its dependents collected for that long.
4. kube-controller-manager, every controller authenticating as its own ServiceAccount
   (``--use-service-account-credentials``) as on kubeadm clusters; short HPA sync period.
5. kube-scheduler.
6. The fake nodes of ``e2e/nodes.yaml``, then kwok, which heartbeats them and runs their pods;
   ready when every node is Ready and its ``not-ready`` taint is gone.
7. The real node (node.py): containerd, the images, kube-proxy, CoreDNS, the kubelet.
8. Prometheus and prometheus-adapter behind the custom.metrics.k8s.io APIService; the cluster
   is ready when the ``default`` ServiceAccount exists (proof that the controllers reconcile).

Each component is one class in components.py (command line, files, health probe), as envtest
has one per binary; ``Cluster`` composes them and offers kubectl, helm and ServiceAccount
kubeconfigs to the tests.

``stop()`` (and any failure during ``start()``) stops the components in reverse order, SIGTERM
then SIGKILL, whole process groups. Ports are free ports on 127.0.0.1 picked at start.

CLI for manual use (state in ``.cluster/`` at the repository root)::

    python -m e2e.harness.cluster up     # builds missing binaries, starts detached, prints exports
    python -m e2e.harness.cluster env    # prints the export lines again
    python -m e2e.harness.cluster down   # stops everything and removes the state
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import yaml

from e2e.harness import node
from e2e.harness.binaries import Binaries, BuildError, ensure_binaries
from e2e.harness.components import (
    APIServer,
    Component,
    Containerd,
    ControllerManager,
    CoreDNS,
    Etcd,
    Kubelet,
    KubeProxy,
    Kwok,
    Launcher,
    Prometheus,
    PrometheusAdapter,
    Scheduler,
    Teardown,
    adapter_api_objects,
    stop_processes,
)
from e2e.harness.host_packages import HostPackageError, ensure_packages
from e2e.harness.images import ImageError, ImportFailed, build_images, load_images
from e2e.harness.pki import Pki, create_pki
from e2e.harness.probes import AdminApi, http_get
from e2e.harness.proc import ClusterError, Process, poll_until

__all__ = ["Binaries", "BuildError", "Cluster", "ClusterError", "Timeouts", "poll_until"]

log = logging.getLogger("e2e.cluster")

E2E_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = E2E_DIR.parent
DEFAULT_CRD_DIR = REPO_ROOT / "crds"
DEFAULT_NODES_FILE = E2E_DIR / "nodes.yaml"
CLI_WORKDIR = REPO_ROOT / ".cluster"
STATE_FILE = "state.json"
SERVICE_CIDR = node.SERVICE_CIDR
# The e2e session taints the real node so the kwok-era tests never start real pods there;
# the real-node tests tolerate it (a GPU profile and the chart's operator tolerations).
REAL_NODE_TAINT_KEY = "e2e.embedding-operator.dev/real-node"
REAL_NODE_TAINT = f"{REAL_NODE_TAINT_KEY}=true:NoSchedule"
CHART_DIR = REPO_ROOT / "charts" / "embedding-operator"


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

    @classmethod
    def pick_free(cls) -> Ports:
        # Hold every socket open until all are bound, so no two ports coincide.
        with contextlib.ExitStack() as stack:
            ports = []
            for _ in fields(cls):
                sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                sock.bind(("127.0.0.1", 0))
                ports.append(sock.getsockname()[1])
        return cls(*ports)


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def kubeconfig_dict(
    server: str, ca_file: Path, user: Mapping[str, str], *, namespace: str = "default"
) -> dict[str, Any]:
    """A self-contained kubeconfig (certificates embedded) for one user."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "e2e",
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_file)},
            }
        ],
        "users": [{"name": "e2e-user", "user": dict(user)}],
        "contexts": [
            {
                "name": "e2e",
                "context": {"cluster": "e2e", "user": "e2e-user", "namespace": namespace},
            }
        ],
        "current-context": "e2e",
    }


def _write_kubeconfig(path: Path, config: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
    path.chmod(0o600)
    return path


def _cert_user(cert: Path, key: Path) -> dict[str, str]:
    return {"client-certificate-data": _b64(cert), "client-key-data": _b64(key)}


C = TypeVar("C", bound=Component)


class Cluster:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok's fake GPU
    nodes + one real node (see ``node.py``) + Prometheus and prometheus-adapter, each a
    ``Component`` (components.py) in ``components``, in start order.

    Use as a context manager, or call ``start()`` / ``stop()``. ``detached=True`` leaves the
    processes running after this Python process exits (see ``stop_detached``).
    ``fake_nodes`` picks which nodes of ``nodes.yaml`` to create (default: all);
    ``node_taints`` are registered on the real node; ``image_loader`` is called with the
    containerd socket before the kubelet starts, to import the images pods will run.
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
    ) -> None:
        self.binaries = binaries
        self.workdir = workdir.resolve()
        self.crd_dir = crd_dir
        self.nodes_file = nodes_file
        self.detached = detached
        self.hpa_sync_period = hpa_sync_period
        self.timeouts = timeouts or Timeouts()
        self.ports = Ports.pick_free()
        self.server = f"https://{node.NODE_IP}:{self.ports.apiserver}"
        self.fake_nodes = fake_nodes
        self.node_taints = tuple(node_taints)
        self.image_loader = image_loader
        self.node_paths = node.NodePaths(
            state=self.workdir / "node", images=node.containerd_store()
        )
        self._network_restore: dict[str, Any] = {}
        # What existed before this cluster: stop() removes only what it added.
        self._netns_before = node.pod_netns_names()
        self._host_paths_before = node.existing_host_paths()
        self._chains_before = node.kube_chains()
        self.kubeconfig = self.workdir / "kubeconfig"
        self.log_dir = self.workdir / "logs"
        self.launcher = Launcher(self.log_dir, detached=detached, on_spawn=self._record)
        self.components: list[Component] = []
        self.processes: list[Process] = []
        self.startup_seconds: float | None = None
        self._pki: Pki | None = None
        self._api: AdminApi | None = None

    # -- public API -------------------------------------------------------------------------

    @property
    def kubectl_bin(self) -> Path:
        return self.binaries.kubectl

    @property
    def helm_bin(self) -> Path:
        return self.binaries.helm

    @property
    def ca_file(self) -> Path:
        return self.pki.ca.cert

    @property
    def pki(self) -> Pki:
        if self._pki is None:
            raise ClusterError("the cluster has not been started")
        return self._pki

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for subprocesses: KUBECONFIG, our binaries first on PATH, and helm
        state kept inside the workdir (never the user's ~/.config/helm)."""
        env = dict(os.environ if base is None else base)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = os.pathsep.join(
            [*(str(d) for d in self.binaries.bin_dirs()), env.get("PATH", "")]
        )
        for kind in ("CACHE", "CONFIG", "DATA"):
            env[f"HELM_{kind}_HOME"] = str(self.workdir / "helm" / kind.lower())
        return env

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float | None = None,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run our kubectl against this cluster (admin unless ``kubeconfig`` is given)."""
        config = kubeconfig or self.kubeconfig
        return self._run(
            self.kubectl_bin,
            [f"--kubeconfig={config}", *args],
            input=input,
            check=check,
            timeout=timeout,
        )

    def kubectl_json(self, *args: str, kubeconfig: Path | None = None) -> Any:
        """``kubectl <args> -o json``, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json", kubeconfig=kubeconfig).stdout)

    def apply(self, manifest: str | Mapping[str, Any], *, namespace: str | None = None) -> str:
        """``kubectl apply`` a YAML document (or a dict); returns kubectl's output."""
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(dict(manifest))
        ns = ["--namespace", namespace] if namespace else []
        return self.kubectl("apply", *ns, "-f", "-", input=text).stdout

    def helm(
        self,
        *args: str,
        check: bool = True,
        timeout: float | None = None,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run our helm against this cluster (admin unless ``kubeconfig`` is given)."""
        config = kubeconfig or self.kubeconfig
        return self._run(
            self.helm_bin, [f"--kubeconfig={config}", *args], check=check, timeout=timeout
        )

    def create_namespace(self, name: str, *, labels: Mapping[str, str] | None = None) -> str:
        """Create a namespace and wait until its ``default`` ServiceAccount exists (the
        ServiceAccount admission plugin rejects pods until it does)."""
        meta: dict[str, Any] = {"name": name}
        if labels:
            meta["labels"] = dict(labels)
        self.kubectl(
            "create",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": meta}),
        )
        self.wait_for_service_account(name, "default")
        return name

    def wait_for_service_account(self, namespace: str, name: str) -> None:
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}"
        poll_until(
            lambda: self.api.get(path),
            timeout=self.timeouts.service_account,
            what=f"ServiceAccount {namespace}/{name}",
        )

    def service_account_token(
        self,
        namespace: str,
        name: str,
        *,
        duration_s: int = 3600,
        audiences: Sequence[str] = (),
    ) -> str:
        """A bound token for the ServiceAccount from the TokenRequest API."""
        args = ["create", "token", name, "--namespace", namespace, f"--duration={duration_s}s"]
        args += [f"--audience={audience}" for audience in audiences]
        return self.kubectl(*args).stdout.strip()

    def service_account_kubeconfig(
        self, namespace: str, name: str, *, path: Path | None = None, duration_s: int = 3600
    ) -> Path:
        """Write a kubeconfig that authenticates as ServiceAccount ``namespace/name`` with a
        TokenRequest token, so a program runs with exactly that account's RBAC."""
        token = self.service_account_token(namespace, name, duration_s=duration_s)
        path = path or self.workdir / "kubeconfigs" / f"sa-{namespace}-{name}.kubeconfig"
        return _write_kubeconfig(
            path, kubeconfig_dict(self.server, self.ca_file, {"token": token}, namespace=namespace)
        )

    def start(self) -> Cluster:
        started = time.monotonic()
        log.info("[cluster] starting in %s (apiserver %s)", self.workdir, self.server)
        try:
            self._prepare()
            self._start_control_plane()
            self._start_fake_nodes()
            self._start_real_node()
            self._start_metrics_pipeline()
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
        errors += node_cleanup(
            self.node_paths,
            self._network_restore,
            self._netns_before,
            self._host_paths_before,
            self._chains_before,
        )
        self.processes.clear()
        self.components.clear()
        shutil.rmtree(self.workdir / "etcd", ignore_errors=True)
        (self.workdir / STATE_FILE).unlink(missing_ok=True)
        if errors:
            raise ClusterError("; ".join(errors))

    def check_running(self) -> None:
        """Raise ClusterError naming the first component that has exited."""
        for process in self.processes:
            process.ensure_running()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals --------------------------------------------------------------------------

    def _run(
        self,
        binary: Path,
        args: Sequence[str],
        *,
        input: str | None = None,
        check: bool,
        timeout: float | None,
    ) -> subprocess.CompletedProcess[str]:
        timeout = timeout if timeout is not None else self.timeouts.command
        try:
            proc = subprocess.run(
                [str(binary), *args],
                input=input,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=self.env(),
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(
                f"`{binary.name} {' '.join(args)}` timed out after {timeout}s"
            ) from exc
        if check and proc.returncode != 0:
            raise ClusterError(
                f"`{binary.name} {' '.join(args)}` failed (rc={proc.returncode}):\n"
                f"{proc.stderr.strip() or proc.stdout.strip()}"
            )
        return proc

    @property
    def api(self) -> AdminApi:
        if self._api is None:
            raise ClusterError("the cluster has not been started")
        return self._api

    def _record(self, process: Process) -> None:
        self.processes.append(process)
        if self.detached:
            self._write_state()

    def _start(self, component: C) -> C:
        self.components.append(component)
        component.start()
        return component

    def _teardown(self) -> Teardown:
        return Teardown(node_paths=self.node_paths, kube_proxy=self.binaries.kube_proxy)

    def _write_state(self) -> None:
        state = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "bin_dirs": [str(d) for d in self.binaries.bin_dirs()],
            "processes": [p.to_json() for p in self.processes],
            "containerd_socket": str(self.node_paths.containerd_socket),
            "node_state": str(self.node_paths.state),
            "node_images": str(self.node_paths.images),
            "kube_proxy": str(self.binaries.kube_proxy),
            "network_restore": self._network_restore,
            "netns_before": sorted(self._netns_before),
            "host_paths_before": self._host_paths_before,
            "chains_before": self._chains_before,
        }
        (self.workdir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    def _prepare(self) -> None:
        for field_name, binary in vars(self.binaries).items():
            if field_name != "cni_bin_dir" and not os.access(binary, os.X_OK):
                raise ClusterError(f"missing binary {binary}; run `python -m e2e.harness.binaries`")
        node.require_root()
        ensure_packages(node.NODE_PACKAGES)
        self.workdir.mkdir(parents=True, exist_ok=True)
        # The node's address must exist before the apiserver binds to it.
        self._network_restore = node.network_up()
        self._pki = create_pki(self.workdir / "pki")
        pki = self._pki
        self._api = AdminApi(self.server, pki)
        _write_kubeconfig(
            self.kubeconfig,
            kubeconfig_dict(self.server, pki.ca.cert, _cert_user(pki.admin.cert, pki.admin.key)),
        )
        for name, pair in (
            ("controller-manager", pki.controller_manager),
            ("scheduler", pki.scheduler),
            ("kubelet", pki.node),
            ("kube-proxy", pki.kube_proxy),
        ):
            _write_kubeconfig(
                self._component_kubeconfig(name),
                kubeconfig_dict(self.server, pki.ca.cert, _cert_user(pair.cert, pair.key)),
            )

    def _component_kubeconfig(self, name: str) -> Path:
        return self.workdir / "kubeconfigs" / f"{name}.kubeconfig"

    def _start_control_plane(self) -> None:
        """etcd, then the apiserver, the CRDs (Established before the controller manager starts,
        whose garbage collector re-reads discovery only every 30s), the controller manager and
        the scheduler."""
        etcd = self._start(
            Etcd(
                self.launcher,
                self.binaries.etcd,
                self.workdir / "etcd",
                client_port=self.ports.etcd_client,
                peer_port=self.ports.etcd_peer,
                timeout=self.timeouts.etcd,
            )
        )
        self._start(
            APIServer(
                self.launcher,
                self.binaries.kube_apiserver,
                self.api,
                etcd_url=etcd.client_url,
                port=self.ports.apiserver,
                service_cidr=SERVICE_CIDR,
                timeout=self.timeouts.apiserver,
            )
        )
        self._apply_crds()
        self._start(
            ControllerManager(
                self.launcher,
                self.binaries.kube_controller_manager,
                self.api,
                kubeconfig=self._component_kubeconfig("controller-manager"),
                port=self.ports.controller_manager,
                service_cidr=SERVICE_CIDR,
                hpa_sync_period=self.hpa_sync_period,
                timeout=self.timeouts.controller_manager,
            )
        )
        self._start(
            Scheduler(
                self.launcher,
                self.binaries.kube_scheduler,
                self.api,
                kubeconfig=self._component_kubeconfig("scheduler"),
                port=self.ports.scheduler,
                timeout=self.timeouts.scheduler,
            )
        )

    def _crd_files(self) -> list[Path]:
        if self.crd_dir is None or not self.crd_dir.is_dir():
            return []
        return sorted(p for p in self.crd_dir.iterdir() if p.suffix in (".yaml", ".yml", ".json"))

    def _apply_crds(self) -> None:
        files = self._crd_files()
        if not files:
            log.info("[cluster] no CRDs in %s", self.crd_dir)
            return
        names: list[str] = []
        for path in files:
            out = self.kubectl("apply", "--server-side", "-f", str(path), "-o", "name").stdout
            names += out.split()
        crds = [n for n in names if n.startswith("customresourcedefinition")]
        if crds:
            self.kubectl(
                "wait",
                "--for=condition=Established",
                f"--timeout={self.timeouts.crds:.0f}s",
                *crds,
                timeout=self.timeouts.crds + 30,
            )
        log.info("[cluster] applied and established: %s", ", ".join(crds) or "(no CRDs)")

    def _fake_node_documents(self) -> list[dict[str, Any]]:
        if self.nodes_file is None:
            return []
        docs = yaml.safe_load_all(self.nodes_file.read_text())
        nodes = [d for d in docs if d and d.get("kind") == "Node"]
        if self.fake_nodes is not None:
            nodes = [d for d in nodes if d["metadata"]["name"] in self.fake_nodes]
        return nodes

    def _start_fake_nodes(self) -> None:
        """The fake nodes of ``nodes.yaml``, then kwok, which heartbeats them."""
        documents = self._fake_node_documents()
        if documents:
            self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(documents))
        self._start(
            Kwok(
                self.launcher,
                self.binaries.kwok,
                self.api,
                kubeconfig=self.kubeconfig,
                port=self.ports.kwok,
                nodes=[d["metadata"]["name"] for d in documents],
                timeout=self.timeouts.nodes,
            )
        )

    # -- the real node ---------------------------------------------------------------------

    def _start_containerd(self) -> Containerd:
        return self._start(
            Containerd(
                self.launcher,
                self.node_paths,
                cni_bin_dir=self.binaries.cni_bin_dir,
                resolv_conf=self.node_paths.state / "resolv.conf",
                timeout=self.timeouts.containerd,
            )
        )

    def _stop_component(self, component: Component) -> None:
        """Stop one component before the others (they stay up); it is forgotten."""
        errors = component.stop(self._teardown())
        if component.process is not None and component.process in self.processes:
            self.processes.remove(component.process)
        self.components.remove(component)
        if self.detached:
            self._write_state()
        if errors:
            raise ClusterError("; ".join(errors))

    def _start_real_node(self) -> None:
        """containerd, then the images, kube-proxy, CoreDNS and the kubelet; ready when the
        node is Ready, kube-proxy has synced for it and CoreDNS answers for the `kubernetes`
        Service."""
        paths = self.node_paths
        if self.image_loader is None:
            self._start_containerd()
        else:
            t0 = time.monotonic()
            start_containerd_with_images(
                self._start_containerd, self._stop_component, self.image_loader
            )
            log.info("[cluster] images loaded into containerd (%.1fs)", time.monotonic() - t0)

        # Its healthz turns 200 only once it has synced for its Node: waited for below.
        proxy = KubeProxy(
            self.launcher,
            self.binaries.kube_proxy,
            config_file=paths.state / "kube-proxy.yaml",
            kubeconfig=self._component_kubeconfig("kube-proxy"),
            healthz_port=self.ports.proxy_healthz,
            metrics_port=self.ports.proxy_metrics,
            timeout=self.timeouts.real_node,
        )
        self.components.append(proxy)
        proxy.spawn()
        coredns = self._start(
            CoreDNS(
                self.launcher,
                self.binaries.coredns,
                corefile=paths.state / "Corefile",
                kubeconfig=self.kubeconfig,
                health_port=self.ports.coredns_health,
                timeout=self.timeouts.dns,
            )
        )
        self._start(
            Kubelet(
                self.launcher,
                self.binaries.kubelet,
                self.api,
                paths,
                config_file=paths.state / "kubelet.yaml",
                kubeconfig=self._component_kubeconfig("kubelet"),
                port=self.ports.kubelet,
                healthz_port=self.ports.kubelet_healthz,
                resolv_conf=paths.state / "resolv.conf",
                taints=self.node_taints,
                timeout=self.timeouts.real_node,
            )
        )
        proxy.wait_ready()
        coredns.wait_resolving()

    # -- Prometheus and prometheus-adapter ---------------------------------------------------

    def _start_metrics_pipeline(self) -> None:
        """Prometheus scrapes the server pods on the real node; prometheus-adapter serves
        custom.metrics.k8s.io from it with the rules the chart renders; the APIService points
        the aggregation layer at the adapter on the node IP."""
        state = self.node_paths.state
        prometheus = self._start(
            Prometheus(
                self.launcher,
                self.binaries.prometheus,
                state_dir=state,
                kubeconfig=self.kubeconfig,
                port=self.ports.prometheus,
                timeout=self.timeouts.prometheus,
            )
        )
        adapter = PrometheusAdapter(
            self.launcher,
            self.binaries.prometheus_adapter,
            self.api,
            state_dir=state,
            kubeconfig=self.kubeconfig,
            rules=self.chart_adapter_rules(),
            prometheus_url=prometheus.url,
            port=self.ports.adapter,
            timeout=self.timeouts.adapter,
        )
        self.components.append(adapter)
        adapter.spawn()
        self.apply(adapter_api_objects(self.ports.adapter, _b64(self.pki.ca.cert)))
        adapter.wait_ready()

    def chart_adapter_rules(self) -> str:
        """prometheus-adapter's config as the chart renders it (its rules ConfigMap)."""
        rendered = self.helm(
            "template",
            "e2e",
            str(CHART_DIR),
            "--show-only",
            "templates/prometheus-adapter-rules.yaml",
            "--set",
            "prometheusAdapter.rulesConfigMap.enabled=true",
        ).stdout
        config_map = yaml.safe_load(rendered)
        config: str = config_map["data"]["config.yaml"]
        return config

    def prometheus_query(self, query: str) -> list[dict[str, Any]]:
        """An instant PromQL query against the cluster's Prometheus; the result vector."""
        url = f"http://127.0.0.1:{self.ports.prometheus}/api/v1/query?" + urllib.parse.urlencode(
            {"query": query}
        )
        body = http_get(url, None)
        if body is None:
            return []
        result: list[dict[str, Any]] = json.loads(body)["data"]["result"]
        return result


def node_cleanup(
    paths: node.NodePaths,
    network_restore: Mapping[str, Any],
    netns_before: Iterable[str],
    host_paths_before: Sequence[str],
    chains_before: Sequence[str],
) -> list[str]:
    """Unmount what containerd mounted, delete the pods' network namespaces, the bridges and
    the guard rules; the problems met (as messages)."""
    errors: list[str] = []
    stuck = node.unmount_under(paths.state, paths.images)
    if stuck:
        errors.append(f"could not unmount {stuck}")
    node.remove_netns(node.pod_netns_names() - set(netns_before))
    errors += node.network_down(dict(network_restore))
    node.remove_host_paths(host_paths_before)
    node.remove_kube_chains(chains_before)
    shutil.rmtree(paths.state, ignore_errors=True)
    return errors


def read_state(workdir: Path) -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads((workdir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state


def detached_processes(workdir: Path) -> list[Process]:
    state = read_state(workdir)
    return [Process.from_json(p) for p in state["processes"]] if state else []


def stop_detached(workdir: Path) -> int:
    """Stop the processes an earlier ``up`` recorded in ``workdir``; returns how many ran."""
    processes = detached_processes(workdir)
    running = sum(p.alive() for p in processes)
    state = read_state(workdir) or {}
    paths = node.NodePaths(
        state=Path(state.get("node_state") or workdir / "node"),
        images=Path(state.get("node_images") or node.containerd_store()),
    )
    kube_proxy = state.get("kube_proxy")
    errors = stop_processes(
        processes, Teardown(node_paths=paths, kube_proxy=Path(kube_proxy) if kube_proxy else None)
    )
    if state:
        errors += node_cleanup(
            paths,
            state.get("network_restore") or {},
            state.get("netns_before") or [],
            state.get("host_paths_before", list(node.HOST_PATHS)),
            state.get("chains_before", node.kube_chains()),
        )
    if errors:
        raise ClusterError("; ".join(errors))
    for name in ("etcd", "pki", "kubeconfigs", "helm", STATE_FILE, "kubeconfig"):
        path = workdir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return running


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


def _export_lines(state: Mapping[str, Any]) -> list[str]:
    path = os.pathsep.join([*state["bin_dirs"], "$PATH"])
    return [f'export PATH="{path}"', f"export KUBECONFIG={state['kubeconfig']}"]


USER_FAKE_NODES = ("gpu-h100-0", "gpu-l4-0")


def _image_loader() -> Callable[[Path], object]:
    """Build (or take from the cache) the project's images; load them once containerd is up."""
    images = build_images()
    return lambda socket_path: load_images(socket_path, images, store=node.containerd_store())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Local Kubernetes control plane for e2e tests.")
    parser.add_argument("command", choices=["up", "down", "env"])
    parser.add_argument(
        "--workdir",
        type=Path,
        default=CLI_WORKDIR,
        help=f"state directory (default: {CLI_WORKDIR})",
    )
    parser.add_argument(
        "--crds",
        action="store_true",
        help=f"also apply the CRDs in {DEFAULT_CRD_DIR} (off by default: `helm install` of the "
        "chart installs them, and refuses a CRD it did not create)",
    )
    parser.add_argument(
        "--no-images",
        action="store_true",
        help="do not build and load the project's images into the real node (`make images` "
        "loads them later)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    workdir: Path = args.workdir.resolve()

    processes = detached_processes(workdir)
    running = bool(processes) and all(p.alive() for p in processes)
    state = read_state(workdir)
    try:
        if args.command == "down":
            count = stop_detached(workdir)
            print(f"stopped {count} running component(s) from {workdir}")
            return 0
        if args.command == "env":
            if not running or state is None:
                print(
                    f"no running cluster in {workdir}; run `python -m e2e.harness.cluster up`",
                    file=sys.stderr,
                )
                return 1
            print("\n".join(_export_lines(state)))
            return 0
        # up
        if running and state is not None:
            print(f"already running in {workdir}", file=sys.stderr)
            print("\n".join(_export_lines(state)))
            return 0
        stop_detached(workdir)  # clear a half-dead earlier cluster
        binaries = ensure_binaries()
        crd_dir = DEFAULT_CRD_DIR if args.crds else None
        loader = None if args.no_images else _image_loader()
        cluster = Cluster(
            binaries,
            workdir,
            crd_dir=crd_dir,
            detached=True,
            # The GPU nodes are fake; CPU pods go to the real node (no fake CPU node to
            # compete with it, so `kubectl apply -f examples/minilm-cpu.yaml` really serves).
            fake_nodes=USER_FAKE_NODES,
            image_loader=loader,
        ).start()
        print(
            f"cluster up in {cluster.startup_seconds:.1f}s: {cluster.server}; "
            f"logs in {cluster.log_dir}; stop with `python -m e2e.harness.cluster down`"
        )
        print("\n".join(_export_lines(read_state(workdir) or {})))
        return 0
    except (BuildError, ClusterError, HostPackageError, ImageError, TimeoutError) as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
