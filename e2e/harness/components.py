"""The e2e cluster's components, one class each, in the style of envtest's Etcd and APIServer.

A component knows its command line, the files that command line names (``prepare``), and its
health probe. ``start()`` is ``spawn()`` then ``wait_ready()``: it polls ``healthy()`` under the
component's deadline, and a process that exits, or a deadline that passes, fails the wait with
the tail of the component's log. ``stop()`` ends the whole process group (SIGTERM, then SIGKILL)
plus the component's own cleanup: containerd's containers before it stops, kube-proxy's iptables
chains after. ``Cluster`` (cluster/local.py) composes them in start order and stops them in reverse,
also for a detached cluster, whose processes it knows only from its state file (``down``).

Listening addresses (ports are free ports picked per cluster): etcd, the controller manager,
the scheduler, kwok, Prometheus and every health endpoint on 127.0.0.1; the apiserver, the
kubelet, CoreDNS and prometheus-adapter on the node IP (node.py), where pods reach them.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from e2e.harness import node
from e2e.harness.pki import FRONT_PROXY_CLIENT, SERVICE_IP, KeyPair, Pki
from e2e.harness.probes import AdminApi, http_get, resolve_a
from e2e.harness.proc import ClusterError, Process, poll_until

log = logging.getLogger("e2e.cluster")

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
# kwok's fake pods get addresses no packet is ever sent to (the node's guard drops them).
FAKE_POD_CIDR = "198.18.128.1/17"
FAKE_NODE_IP = "198.18.0.2"
FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node=fake"
ADAPTER_SERVICE = "prometheus-adapter"
ADAPTER_NAMESPACE = "kube-system"
ADAPTER_API_SERVICE = "v1beta1.custom.metrics.k8s.io"
KEDA_NAMESPACE = "keda"
KEDA_METRICS_SERVICE = "keda-metrics-apiserver"


@dataclass(frozen=True)
class Launcher:
    """What the components of one cluster share: their log directory, whether they outlive
    this Python process (``detached``), and the callback that records each spawned process."""

    log_dir: Path
    _: KW_ONLY
    detached: bool
    on_spawn: Callable[[Process], None]

    def spawn(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> Process:
        process = Process.spawn(
            name, argv, self.log_dir / f"{name}.log", detached=self.detached, env=env
        )
        self.on_spawn(process)
        return process

    @staticmethod
    def wait_ready(process: Process, probe: Callable[[], object], timeout: float) -> None:
        """Poll ``probe`` until it answers; fail early if the process exits, with its log."""

        def check() -> object:
            process.ensure_running()
            return probe()

        t0 = time.monotonic()
        try:
            poll_until(check, timeout=timeout, what=f"{process.name} to become ready")
        except TimeoutError as exc:
            raise ClusterError(
                f"{exc}; last lines of {process.log_path}:\n{process.log_tail()}"
            ) from exc
        log.info("[cluster] %s ready (%.1fs)", process.name, time.monotonic() - t0)


@dataclass(frozen=True)
class Teardown:
    """What stopping needs besides the processes; a running ``Cluster`` and ``down`` (from the
    state file) both know it."""

    node_paths: node.NodePaths
    kube_proxy: Path | None


# Every component is a dataclass of its own arguments: the launcher first, then its positional
# arguments, then (keyword-only, after ``KW_ONLY``) its ports and files, and ``timeout``, the
# deadline of its readiness wait. ``eq=False``: a component is itself, never equal to another
# one with the same arguments (``Cluster.components.remove`` relies on it).


@dataclass(eq=False)
class Component:
    """One control-plane process: ``start()`` / ``stop()`` / ``healthy()``."""

    name: ClassVar[str]

    launcher: Launcher
    timeout: float = field(kw_only=True)
    process: Process | None = field(default=None, init=False, repr=False)

    def argv(self) -> list[str]:
        raise NotImplementedError

    def healthy(self) -> bool:
        raise NotImplementedError

    def prepare(self) -> None:
        """Write the files the command line names (none by default)."""

    def env(self) -> dict[str, str] | None:
        """The process's environment (None: this process's own)."""
        return None

    def spawn(self) -> Process:
        self.prepare()
        self.process = self.launcher.spawn(self.name, self.argv(), env=self.env())
        return self.process

    def running(self) -> Process:
        if self.process is None:
            raise ClusterError(f"{self.name} has not been started")
        return self.process

    def wait_ready(self) -> None:
        self.launcher.wait_ready(self.running(), self.healthy, self.timeout)

    def start(self) -> None:
        self.spawn()
        self.wait_ready()

    def stop(self, teardown: Teardown) -> list[str]:
        """Stop the process and clean up after it; the problems met (as messages)."""
        return [] if self.process is None else self.stop_process(self.process, teardown)

    @classmethod
    def stop_process(cls, process: Process, teardown: Teardown) -> list[str]:
        try:
            process.stop()
        except ClusterError as exc:
            return [str(exc)]
        return []


@dataclass(eq=False)
class Etcd(Component):
    """``--unsafe-no-fsync``: a test cluster needs no durability. Ready: ``GET /health``."""

    name = "etcd"

    binary: Path
    data_dir: Path
    _: KW_ONLY
    client_port: int
    peer_port: int

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def argv(self) -> list[str]:
        return [
            str(self.binary),
            "--name=e2e",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster=e2e={self.peer_url}",
            "--initial-cluster-state=new",
            "--unsafe-no-fsync=true",
            "--log-level=warn",
        ]

    def healthy(self) -> bool:
        body = http_get(f"{self.client_url}/health", None)
        return body is not None and json.loads(body).get("health") == "true"


@dataclass(eq=False)
class APIServer(Component):
    """TLS, Node+RBAC authorization, the default admission plugins (ServiceAccount included), a
    ServiceAccount signing key (so the TokenRequest API issues real tokens), and the
    aggregation layer's front proxy. Listens on the node IP. Ready: ``/readyz``."""

    name = "kube-apiserver"

    binary: Path
    api: AdminApi
    _: KW_ONLY
    etcd_url: str
    port: int
    service_cidr: str
    _context: ssl.SSLContext = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._context = self.api.ssl_context(client_cert=True)

    def argv(self) -> list[str]:
        pki = self.api.pki
        return [
            str(self.binary),
            f"--etcd-servers={self.etcd_url}",
            # On the node IP: pods reach it through the `kubernetes` Service, the host locally.
            f"--bind-address={node.NODE_IP}",
            f"--advertise-address={node.NODE_IP}",
            f"--secure-port={self.port}",
            f"--tls-cert-file={pki.apiserver.cert}",
            f"--tls-private-key-file={pki.apiserver.key}",
            f"--client-ca-file={pki.ca.cert}",
            "--authorization-mode=Node,RBAC",
            # PodNodeSelector and PodTolerationRestriction act only on namespaces annotated
            # with a node selector or default tolerations: the EmbeddingJob tests place their
            # namespace's pods (workers the operator makes, with no placement of their own) on
            # the tainted real node, as a platform team dedicates a namespace to a pool.
            "--enable-admission-plugins=NodeRestriction,ExtendedResourceToleration,"
            "PodNodeSelector,PodTolerationRestriction",
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={pki.apiserver_kubelet_client.cert}",
            f"--kubelet-client-key={pki.apiserver_kubelet_client.key}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={pki.service_account_pub}",
            f"--service-account-signing-key-file={pki.service_account_key}",
            f"--service-cluster-ip-range={self.service_cidr}",
            "--allow-privileged=true",
            "--profiling=false",
            f"--requestheader-client-ca-file={pki.front_proxy_ca.cert}",
            f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki.front_proxy_client.cert}",
            f"--proxy-client-key-file={pki.front_proxy_client.key}",
        ]

    def healthy(self) -> bool:
        return http_get(f"{self.api.server}/readyz", self._context) == "ok"


@dataclass(eq=False)
class SecureComponent(Component):
    """A control-plane component that authenticates to the apiserver with its own client cert
    and serves ``/healthz`` over TLS on 127.0.0.1 with a cert of the cluster CA (``serving``,
    each subclass's own)."""

    binary: Path
    api: AdminApi
    _: KW_ONLY
    kubeconfig: Path
    port: int
    _context: ssl.SSLContext = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._context = self.api.ssl_context(client_cert=False)

    @property
    def pki(self) -> Pki:
        return self.api.pki

    @property
    def serving(self) -> KeyPair:
        raise NotImplementedError

    def extra_args(self) -> list[str]:
        return []

    def argv(self) -> list[str]:
        config = self.kubeconfig
        return [
            str(self.binary),
            f"--kubeconfig={config}",
            f"--authentication-kubeconfig={config}",
            f"--authorization-kubeconfig={config}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--tls-cert-file={self.serving.cert}",
            f"--tls-private-key-file={self.serving.key}",
            "--leader-elect=false",
            *self.extra_args(),
        ]

    def healthy(self) -> bool:
        return http_get(f"https://127.0.0.1:{self.port}/healthz", self._context) == "ok"


@dataclass(eq=False)
class ControllerManager(SecureComponent):
    """Every controller authenticating as its own ServiceAccount
    (``--use-service-account-credentials``), as on kubeadm clusters; short HPA sync period."""

    name = "kube-controller-manager"

    _: KW_ONLY
    service_cidr: str
    hpa_sync_period: str

    @property
    def serving(self) -> KeyPair:
        return self.pki.controller_manager_serving

    def extra_args(self) -> list[str]:
        pki = self.pki
        return [
            "--controllers=*",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki.service_account_key}",
            f"--root-ca-file={pki.ca.cert}",
            f"--cluster-signing-cert-file={pki.ca.cert}",
            f"--cluster-signing-key-file={pki.ca.key}",
            f"--service-cluster-ip-range={self.service_cidr}",
            f"--horizontal-pod-autoscaler-sync-period={self.hpa_sync_period}",
        ]


@dataclass(eq=False)
class Scheduler(SecureComponent):
    name = "kube-scheduler"

    @property
    def serving(self) -> KeyPair:
        return self.pki.scheduler_serving


@dataclass(eq=False)
class Kwok(Component):
    """Heartbeats the fake GPU nodes (those annotated ``FAKE_NODE_ANNOTATION``) and runs their
    pods on paper. Ready: every expected node is Ready, its ``not-ready`` taint gone."""

    name = "kwok"

    binary: Path
    api: AdminApi
    _: KW_ONLY
    kubeconfig: Path
    port: int
    nodes: Sequence[str]

    def __post_init__(self) -> None:
        self.nodes = tuple(self.nodes)

    def argv(self) -> list[str]:
        return [
            str(self.binary),
            f"--kubeconfig={self.kubeconfig}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}",
            f"--cidr={FAKE_POD_CIDR}",
            f"--node-ip={FAKE_NODE_IP}",
            "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{self.port}",
        ]

    def healthy(self) -> bool:
        return self.api.nodes_ready(self.nodes)


@dataclass(eq=False)
class Containerd(Component):
    """Debian's containerd with our own root, state, socket and CNI directories (node.py).
    Ready: ``ctr version`` reaches it. Before it stops, every container is killed and deleted
    (the kubelet is gone by then and would not do it)."""

    name = "containerd"

    paths: node.NodePaths
    _: KW_ONLY
    cni_bin_dir: Path
    resolv_conf: Path

    def prepare(self) -> None:
        node.write_node_files(
            self.paths, cni_bin_dir=self.cni_bin_dir, resolv_conf=self.resolv_conf
        )

    def argv(self) -> list[str]:
        return [node.which("containerd"), "--config", str(self.paths.containerd_config)]

    def healthy(self) -> bool:
        return node.containerd_answers(self.paths)

    @classmethod
    def stop_process(cls, process: Process, teardown: Teardown) -> list[str]:
        paths = teardown.node_paths
        failed = node.remove_containers(paths)
        errors = super().stop_process(process, teardown)
        # Shims outlive containerd by design; after a containerd that did not answer (or whose
        # deletes failed) they still run their containers: end them without it.
        survivors = node.kill_shims(paths)
        if failed and not survivors:
            log.warning("containerd's own cleanup failed (%s); its shims were killed", failed)
        return errors + survivors


@dataclass(eq=False)
class KubeProxy(Component):
    """iptables mode on the node IP. Ready: its healthz, which turns 200 only once it has
    synced for its Node. After it stops, ``kube-proxy --cleanup`` removes its chains."""

    name = "kube-proxy"

    binary: Path
    _: KW_ONLY
    config_file: Path
    kubeconfig: Path
    healthz_port: int
    metrics_port: int

    def prepare(self) -> None:
        node.write_yaml(
            self.config_file,
            node.kube_proxy_config(
                self.kubeconfig, healthz_port=self.healthz_port, metrics_port=self.metrics_port
            ),
        )

    def argv(self) -> list[str]:
        return [str(self.binary), f"--config={self.config_file}"]

    def healthy(self) -> bool:
        return http_get(f"http://127.0.0.1:{self.healthz_port}/healthz", None) is not None

    @classmethod
    def stop_process(cls, process: Process, teardown: Teardown) -> list[str]:
        errors = super().stop_process(process, teardown)
        if teardown.kube_proxy is not None and teardown.kube_proxy.exists():
            try:
                node.run([str(teardown.kube_proxy), "--cleanup"], timeout=60)
            except ClusterError as exc:
                errors.append(str(exc))
        return errors


@dataclass(eq=False)
class CoreDNS(Component):
    """Cluster names from the API on the node IP, nothing forwarded upstream. Ready: its health
    endpoint; ``wait_resolving()`` then waits until it answers for the `kubernetes` Service (so
    it has synced with the API)."""

    name = "coredns"

    binary: Path
    _: KW_ONLY
    corefile: Path
    kubeconfig: Path
    health_port: int

    def prepare(self) -> None:
        self.corefile.write_text(node.corefile(self.kubeconfig, health_port=self.health_port))

    def argv(self) -> list[str]:
        return [str(self.binary), "-conf", str(self.corefile), "-dns.port", "53"]

    def healthy(self) -> bool:
        return http_get(f"http://127.0.0.1:{self.health_port}/health", None) is not None

    def resolves(self) -> bool:
        name = f"kubernetes.default.svc.{node.CLUSTER_DOMAIN}"
        return resolve_a(name, node.NODE_IP) == SERVICE_IP

    def wait_resolving(self) -> None:
        self.launcher.wait_ready(self.running(), self.resolves, self.timeout)


@dataclass(eq=False)
class Kubelet(Component):
    """The real node ``node.NODE_NAME`` on the node IP, registered with ``taints``. Ready: the
    Node is Ready and its ``not-ready`` taint is gone."""

    name = "kubelet"

    binary: Path
    api: AdminApi
    paths: node.NodePaths
    _: KW_ONLY
    config_file: Path
    kubeconfig: Path
    port: int
    healthz_port: int
    resolv_conf: Path
    taints: Sequence[str]

    def __post_init__(self) -> None:
        self.taints = tuple(self.taints)

    def prepare(self) -> None:
        node.write_yaml(
            self.config_file,
            node.kubelet_config(
                self.paths,
                self.api.pki.ca.cert,
                port=self.port,
                healthz_port=self.healthz_port,
                resolv_conf=self.resolv_conf,
            ),
        )

    def argv(self) -> list[str]:
        kubelet_dir = self.paths.kubelet_dir
        argv = [
            str(self.binary),
            f"--config={self.config_file}",
            f"--kubeconfig={self.kubeconfig}",
            f"--root-dir={kubelet_dir}",
            f"--cert-dir={kubelet_dir / 'pki'}",
            f"--volume-plugin-dir={kubelet_dir / 'volume-plugins'}",
            f"--node-ip={node.NODE_IP}",
            f"--hostname-override={node.NODE_NAME}",
            f"--node-labels=node.kubernetes.io/instance-type=real-{os.cpu_count()}cpu",
        ]
        if self.taints:
            argv.append(f"--register-with-taints={','.join(self.taints)}")
        return argv

    def healthy(self) -> bool:
        return self.api.nodes_ready([node.NODE_NAME])


@dataclass(eq=False)
class Prometheus(Component):
    """Scrapes the server and operator pods on the real node (``prometheus_config``) and
    evaluates ``rules`` (the chart's PrometheusRule groups, as YAML). Ready: ``/-/ready``."""

    name = "prometheus"

    binary: Path
    _: KW_ONLY
    state_dir: Path
    kubeconfig: Path
    port: int
    rules: str | None = None

    @property
    def config_file(self) -> Path:
        return self.state_dir / "prometheus.yaml"

    @property
    def rules_file(self) -> Path:
        return self.state_dir / "prometheus-rules.yaml"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def prepare(self) -> None:
        config = prometheus_config(self.kubeconfig)
        if self.rules is not None:
            self.rules_file.write_text(self.rules)
            config["rule_files"] = [str(self.rules_file)]
        node.write_yaml(self.config_file, config)

    def argv(self) -> list[str]:
        return [
            str(self.binary),
            f"--config.file={self.config_file}",
            f"--storage.tsdb.path={self.state_dir / 'prometheus'}",
            "--storage.tsdb.retention.time=2h",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]

    def healthy(self) -> bool:
        return http_get(f"{self.url}/-/ready", None) is not None


@dataclass(eq=False)
class PrometheusAdapter(Component):
    """Serves custom.metrics.k8s.io from Prometheus with the rules the chart renders, on the
    node IP behind an APIService (``adapter_api_objects``). Ready: the aggregated API answers
    discovery through the apiserver (the HPA controller's path), not merely an APIService
    marked Available."""

    name = "prometheus-adapter"

    binary: Path
    api: AdminApi
    _: KW_ONLY
    state_dir: Path
    kubeconfig: Path
    rules: str
    prometheus_url: str
    port: int

    @property
    def rules_file(self) -> Path:
        return self.state_dir / "adapter-rules.yaml"

    def prepare(self) -> None:
        self.rules_file.write_text(self.rules)

    def argv(self) -> list[str]:
        return [
            str(self.binary),
            *aggregated_server_flags(self.port, self.api.pki.adapter_serving, self.kubeconfig),
            f"--prometheus-url={self.prometheus_url}/",
            "--metrics-relist-interval=5s",
            f"--config={self.rules_file}",
            f"--cert-dir={self.state_dir / 'adapter-certs'}",
        ]

    def healthy(self) -> bool:
        return self.api.get("/apis/custom.metrics.k8s.io/v1beta1") is not None


@dataclass(eq=False)
class KedaOperator(Component):
    """KEDA's operator: turns each ScaledObject into an HPA of its own (``keda-hpa-<name>``),
    polls the triggers to take a target to and from zero, and serves the trigger values to
    the metrics server over gRPC on 127.0.0.1 (mutual TLS with ``pki.keda``, as KEDA's own
    certificates would be, with its certificate rotation off). Watches every namespace.
    Ready: its ``/readyz``."""

    name = "keda-operator"

    binary: Path
    keda: KeyPair
    ca: KeyPair
    _: KW_ONLY
    state_dir: Path
    kubeconfig: Path
    grpc_port: int
    metrics_port: int
    probe_port: int

    @property
    def cert_dir(self) -> Path:
        return self.state_dir / "keda-certs"

    @property
    def ca_dir(self) -> Path:
        return self.state_dir / "keda-ca"

    def prepare(self) -> None:
        write_keda_cert_dir(self.cert_dir, self.keda, self.ca)
        self.ca_dir.mkdir(parents=True, exist_ok=True)
        (self.ca_dir / "ca.crt").write_bytes(self.ca.cert.read_bytes())

    def env(self) -> dict[str, str]:
        return keda_env(self.kubeconfig)

    def argv(self) -> list[str]:
        return [
            str(self.binary),
            f"--metrics-bind-address=127.0.0.1:{self.metrics_port}",
            f"--health-probe-bind-address=127.0.0.1:{self.probe_port}",
            f"--metrics-service-bind-address=127.0.0.1:{self.grpc_port}",
            f"--cert-dir={self.cert_dir}",
            # The CAs its scalers trust (the default, /custom/ca, is a pod's mount).
            f"--ca-dir={self.ca_dir}",
            "--enable-cert-rotation=false",
            "--leader-elect=false",
        ]

    def healthy(self) -> bool:
        return http_get(f"http://127.0.0.1:{self.probe_port}/readyz", None) is not None


@dataclass(eq=False)
class KedaMetricsServer(Component):
    """KEDA's metrics API server: external.metrics.k8s.io on the node IP behind an APIService
    (``keda_api_objects``), answering the HPAs KEDA made from the operator's gRPC service.
    Ready: the aggregated API answers discovery through the apiserver."""

    name = "keda-metrics-apiserver"

    binary: Path
    api: AdminApi
    _: KW_ONLY
    state_dir: Path
    kubeconfig: Path
    grpc_port: int
    port: int
    metrics_port: int

    @property
    def cert_dir(self) -> Path:
        return self.state_dir / "keda-certs"

    def prepare(self) -> None:
        write_keda_cert_dir(self.cert_dir, self.api.pki.keda, self.api.pki.ca)

    def env(self) -> dict[str, str]:
        return keda_env(self.kubeconfig)

    def argv(self) -> list[str]:
        return [
            str(self.binary),
            *aggregated_server_flags(self.port, self.api.pki.keda, self.kubeconfig),
            # The gRPC client's certificate and CA: ca.crt, tls.crt and tls.key in here.
            f"--cert-dir={self.cert_dir}",
            f"--metrics-service-address=127.0.0.1:{self.grpc_port}",
            f"--port={self.metrics_port}",
        ]

    def healthy(self) -> bool:
        return self.api.get("/apis/external.metrics.k8s.io/v1beta1") is not None


def aggregated_server_flags(port: int, serving: KeyPair, kubeconfig: Path) -> list[str]:
    """The flags of a custom-metrics-apiserver (prometheus-adapter, KEDA's metrics server) on
    the node IP, where the aggregation layer dials it: its serving certificate, and the admin
    kubeconfig for its lister, authentication and authorization."""
    return [
        f"--bind-address={node.NODE_IP}",
        f"--secure-port={port}",
        f"--tls-cert-file={serving.cert}",
        f"--tls-private-key-file={serving.key}",
        f"--lister-kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
    ]


def keda_env(kubeconfig: Path) -> dict[str, str]:
    """What KEDA's commands read from a pod's environment: every namespace watched, its own
    namespace (for cluster-wide trigger authentications), the admin kubeconfig."""
    return {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "WATCH_NAMESPACE": "",
        "POD_NAMESPACE": KEDA_NAMESPACE,
        "KEDA_CLUSTER_OBJECT_NAMESPACE": KEDA_NAMESPACE,
    }


def write_keda_cert_dir(cert_dir: Path, keda: KeyPair, ca: KeyPair) -> None:
    """The layout KEDA's gRPC ends read (a Secret's keys in a pod): ca.crt, tls.crt, tls.key."""
    cert_dir.mkdir(parents=True, exist_ok=True)
    for name, source in (("ca.crt", ca.cert), ("tls.crt", keda.cert), ("tls.key", keda.key)):
        target = cert_dir / name
        target.write_bytes(source.read_bytes())
        target.chmod(0o600)


# Each component class by process name, so a detached cluster's processes (from its state file)
# are stopped with their component's cleanup.
COMPONENTS: dict[str, type[Component]] = {
    cls.name: cls
    for cls in (
        Etcd,
        APIServer,
        ControllerManager,
        Scheduler,
        Kwok,
        Containerd,
        KubeProxy,
        CoreDNS,
        Kubelet,
        Prometheus,
        PrometheusAdapter,
        KedaOperator,
        KedaMetricsServer,
    )
}


def stop_processes(processes: Sequence[Process], teardown: Teardown) -> list[str]:
    """Stop the components in reverse start order, each with its own cleanup."""
    errors: list[str] = []
    for process in reversed(processes):
        errors += COMPONENTS.get(process.name, Component).stop_process(process, teardown)
    return errors


OPERATOR_COMPONENT = "operator"
"""``app.kubernetes.io/component`` of the chart's operator pod."""


def prometheus_config(kubeconfig: Path) -> dict[str, Any]:
    """Scrape every pod on the real node that asks to be scraped (the prometheus.io/*
    annotations), labelled by namespace and pod as the adapter's and the chart's rules expect:
    the server pods in one job; the chart's operator pod in another that honors the scraped
    labels, as the chart's PodMonitor does, since its per-service series carry their
    EmbeddingService's own ``namespace``."""
    meta = "__meta_kubernetes_pod_"
    component = f"{meta}label_app_kubernetes_io_component"
    return {
        "global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "2s"},
        "scrape_configs": [
            {
                "job_name": "embedding-server-pods",
                "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": str(kubeconfig)}],
                "relabel_configs": [
                    {"source_labels": [component], "action": "drop", "regex": OPERATOR_COMPONENT},
                    *_annotated_pods_on_the_real_node(),
                ],
            },
            {
                "job_name": "embedding-operator",
                "honor_labels": True,
                "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": str(kubeconfig)}],
                "relabel_configs": [
                    {"source_labels": [component], "action": "keep", "regex": OPERATOR_COMPONENT},
                    *_annotated_pods_on_the_real_node(),
                ],
            },
        ],
    }


def _annotated_pods_on_the_real_node() -> list[dict[str, Any]]:
    meta = "__meta_kubernetes_pod_"
    return [
        {
            "source_labels": [f"{meta}annotation_prometheus_io_scrape"],
            "action": "keep",
            "regex": "true",
        },
        {
            "source_labels": [f"{meta}node_name"],
            "action": "keep",
            "regex": node.NODE_NAME,
        },
        {
            "source_labels": ["__address__", f"{meta}annotation_prometheus_io_port"],
            "action": "replace",
            "regex": r"([^:]+)(?::\d+)?;(\d+)",
            "replacement": "$1:$2",
            "target_label": "__address__",
        },
        {
            "source_labels": [f"{meta}annotation_prometheus_io_path"],
            "action": "replace",
            "regex": "(.+)",
            "target_label": "__metrics_path__",
        },
        {
            "source_labels": ["__meta_kubernetes_namespace"],
            "target_label": "namespace",
        },
        {"source_labels": [f"{meta}name"], "target_label": "pod"},
    ]


def adapter_api_objects(port: int, ca_bundle: str) -> str:
    """prometheus-adapter's APIService for custom.metrics.k8s.io (``aggregated_api_objects``)."""
    return aggregated_api_objects(
        ADAPTER_SERVICE, ADAPTER_NAMESPACE, "custom.metrics.k8s.io", port, ca_bundle
    )


def keda_api_objects(port: int, ca_bundle: str) -> str:
    """KEDA's namespace and its APIService for external.metrics.k8s.io."""
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KEDA_NAMESPACE}}
    return "---\n".join(
        [
            yaml.safe_dump(namespace),
            aggregated_api_objects(
                KEDA_METRICS_SERVICE, KEDA_NAMESPACE, "external.metrics.k8s.io", port, ca_bundle
            ),
        ]
    )


def aggregated_api_objects(
    service_name: str, namespace: str, group: str, port: int, ca_bundle: str
) -> str:
    """The APIService for ``group``/v1beta1, and a selector-less Service whose Endpoints name
    its server on the node IP (the EndpointSlice mirroring controller copies them)."""
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service_name, "namespace": namespace},
        "spec": {"ports": [{"name": "https", "port": port, "targetPort": port}]},
    }
    endpoints = {
        "apiVersion": "v1",
        "kind": "Endpoints",
        "metadata": {"name": service_name, "namespace": namespace},
        "subsets": [
            {"addresses": [{"ip": node.NODE_IP}], "ports": [{"name": "https", "port": port}]}
        ],
    }
    api_service = {
        "apiVersion": "apiregistration.k8s.io/v1",
        "kind": "APIService",
        "metadata": {"name": f"v1beta1.{group}"},
        "spec": {
            "service": {"name": service_name, "namespace": namespace, "port": port},
            "group": group,
            "version": "v1beta1",
            "caBundle": ca_bundle,
            "groupPriorityMinimum": 100,
            "versionPriority": 100,
        },
    }
    return yaml.safe_dump_all([service, endpoints, api_service])
