"""One real Kubernetes node beside the control plane: containerd, kubelet, CNI, kube-proxy, DNS.

The kwok nodes of ``nodes.yaml`` stand in for GPU machines; this node runs the images the
project builds, so pods really start, readiness probes really gate Service traffic and the
HPA reads metrics that real server pods export. It needs root and Debian's ``containerd`` and
``runc`` (``NODE_PACKAGES``, installed by ``host_packages``); the Go-built pieces come from
``binaries``.

Addresses. Everything lives in 198.18.0.0/15 (RFC 2544's benchmarking range, never routed on
the internet), on interfaces this module creates:

* ``NODE_IP`` (198.18.0.1/32) on the bridge ``eonode0``: the node's InternalIP. The apiserver,
  the kubelet, CoreDNS and prometheus-adapter listen on it, so pods reach them through their
  default route and the host reaches them locally.
* ``POD_SUBNET`` (198.18.1.0/24) on the CNI bridge ``eocni0``: pod IPs.
* ``SERVICE_CIDR`` (198.19.0.0/20): ClusterIPs, which kube-proxy DNATs to pod IPs (4094 of
  them: bench.operator_scale creates a Service per EmbeddingService, 1,000 at once).

A guard rule drops anything addressed to 198.18.0.0/15 that would leave through the host's
default interface (a ClusterIP kube-proxy has not programmed yet, say), so no test traffic ever
leaves the machine. Every rule this module adds carries the comment ``GUARD_COMMENT`` and is
removed on ``down``, as are the bridges, the pod network namespaces and the mounts containerd
made, and kube-proxy's own chains (``kube-proxy --cleanup``).

Workarounds this machine needs (see shared/research/real-node.md):

* no CAP_SYS_RESOURCE: runc cannot give the sandbox a negative oom_score_adj, so containerd runs
  with ``restrict_oom_score_adj``;
* cgroup v1 and containerd 1.6: the kubelet uses the ``cgroupfs`` driver;
* the kubelet writes outside ``--root-dir`` unless told: cert dir and pod logs are pointed into
  the node's directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.harness.binaries import cache_root
from e2e.harness.images import PAUSE_IMAGE
from e2e.harness.mounts import mounts_under as mounts_under
from e2e.harness.mounts import unmount_under as unmount_under
from e2e.harness.proc import ClusterError, run_command

log = logging.getLogger("e2e.node")

NODE_NAME = "eo-node"
NODE_BRIDGE = "eonode0"
NODE_IP = "198.18.0.1"
POD_BRIDGE = "eocni0"
POD_SUBNET = "198.18.1.0/24"
POD_GATEWAY = "198.18.1.1"
SERVICE_CIDR = "198.19.0.0/20"
CLUSTER_RANGE = "198.18.0.0/15"
CLUSTER_DOMAIN = "cluster.local"
GUARD_COMMENT = "embedding-operator-e2e"
NETNS_DIR = Path("/var/run/netns")
# Debian packages the node needs (conntrack lets kube-proxy flush stale UDP entries).
NODE_PACKAGES = ("containerd", "runc", "iptables", "conntrack")
COMMAND_TIMEOUT_S = 60


def containerd_store() -> Path:
    """containerd's root: in the cache, so images imported once are there for later clusters."""
    return cache_root() / "containerd"


def run(argv: Sequence[str], *, timeout: float = COMMAND_TIMEOUT_S, check: bool = True) -> str:
    """Run a host command (``proc.run_command``); its stdout. A failure is a ``ClusterError``
    that names the command, with its output."""
    return run_command(argv, timeout=timeout, check=check).stdout


def default_interface() -> str | None:
    """The interface of the IPv4 default route (the guard drops cluster traffic there)."""
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) > 1 and parts[1] == "00000000":
            return parts[0]
    return None


def require_root() -> None:
    if os.geteuid() != 0:
        raise ClusterError(
            "the e2e cluster's real node runs kubelet, containerd and kube-proxy, which need "
            "root (CI and the development machines run as root)"
        )


# -- host network -----------------------------------------------------------------------------


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def _guard_rules() -> list[tuple[str, str, list[str]]]:
    """(table, chain, rule) triples this module adds."""
    rules: list[tuple[str, str, list[str]]] = []
    egress = default_interface()
    if egress is not None:
        # In POSTROUTING, where the output device is final: a filter OUTPUT rule would still
        # see the default route's device for host -> ClusterIP packets kube-proxy DNATs to a
        # local address, and drop them.
        rules.append(("mangle", "POSTROUTING", ["-d", CLUSTER_RANGE, "-o", egress, "-j", "DROP"]))
    # Pod traffic is forwarded through the CNI bridge (pod -> ClusterIP -> pod); accept it
    # even where another program set the FORWARD policy to DROP (dockerd does).
    rules.append(("filter", "FORWARD", ["-i", POD_BRIDGE, "-j", "ACCEPT"]))
    rules.append(("filter", "FORWARD", ["-o", POD_BRIDGE, "-j", "ACCEPT"]))
    return rules


def _comment(rule: list[str]) -> list[str]:
    return [*rule, "-m", "comment", "--comment", GUARD_COMMENT]


def _iptables(table: str, action: str, chain: str, rule: list[str]) -> bool:
    """Check (-C) or delete (-D) one of our rules; whether iptables succeeded."""
    proc = subprocess.run(
        ["iptables", "-w", "-t", table, action, chain, *_comment(rule)],
        capture_output=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    return proc.returncode == 0


def _listening_on_node_ip() -> bool:
    """True when some process listens on ``NODE_IP`` (a running cluster's apiserver or DNS)."""
    hex_ip = "".join(f"{int(octet):02X}" for octet in reversed(NODE_IP.split(".")))
    for table in ("/proc/net/tcp", "/proc/net/udp"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local = line.split()[1]
            if local.startswith(hex_ip + ":"):
                return True
    return False


def reclaim_stale_node() -> None:
    """Refuse to start beside a live cluster; clear what a killed one left behind (its bridges
    and rules: the next ``network_up`` would otherwise find them half set up)."""
    if not _link_exists(NODE_BRIDGE):
        return
    if _listening_on_node_ip():
        raise ClusterError(
            f"another e2e cluster is running on this machine (something listens on {NODE_IP}); "
            "stop it first: `make cluster-down`"
        )
    log.warning("[node] removing %s and its rules, left by a cluster that was killed", NODE_BRIDGE)
    network_down()


def network_up() -> dict[str, Any]:
    """Create the node bridge and address, the guard rules, and turn on IPv4 forwarding.

    Returns what has to be restored on ``network_down`` (the forwarding sysctl's old value)."""
    require_root()
    reclaim_stale_node()
    if not _link_exists(NODE_BRIDGE):
        run(["ip", "link", "add", NODE_BRIDGE, "type", "bridge"])
    addresses = run(["ip", "-4", "-o", "addr", "show", "dev", NODE_BRIDGE])
    if f" {NODE_IP}/" not in addresses:
        run(["ip", "addr", "add", f"{NODE_IP}/32", "dev", NODE_BRIDGE])
    run(["ip", "link", "set", NODE_BRIDGE, "up"])
    for table, chain, rule in _guard_rules():
        if not _iptables(table, "-C", chain, rule):
            run(["iptables", "-w", "-t", table, "-I", chain, "1", *_comment(rule)])
    forward = Path("/proc/sys/net/ipv4/ip_forward")
    previous = forward.read_text().strip()
    if previous != "1":
        forward.write_text("1\n")
    return {"ip_forward": previous}


IPTABLES = ("iptables", "ip6tables")
IPTABLES_TABLES = ("filter", "nat", "mangle")
# Chains the kubelet (KUBE-FIREWALL, KUBE-KUBELET-CANARY) and kube-proxy (KUBE-*) create.
CHAIN_PREFIXES = ("KUBE-",)


def _rules(binary: str, table: str) -> list[str]:
    proc = subprocess.run(
        [binary, "-w", "-t", table, "-S"],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    return proc.stdout.splitlines() if proc.returncode == 0 else []


def kube_chains() -> list[str]:
    """``binary/table/chain`` for every KUBE-* chain that exists now."""
    found = []
    for binary in IPTABLES:
        if shutil.which(binary) is None:
            continue
        for table in IPTABLES_TABLES:
            for line in _rules(binary, table):
                parts = line.split()
                if parts[:1] == ["-N"] and parts[1].startswith(CHAIN_PREFIXES):
                    found.append(f"{binary}/{table}/{parts[1]}")
    return found


def remove_kube_chains(existed_before: Sequence[str]) -> None:
    """Delete the KUBE-* chains that appeared since ``existed_before`` was taken, and every
    rule that jumps to them (kube-proxy --cleanup leaves the kubelet's own chains)."""
    new = [entry for entry in kube_chains() if entry not in set(existed_before)]
    by_table: dict[tuple[str, str], set[str]] = {}
    for entry in new:
        binary, table, chain = entry.split("/")
        by_table.setdefault((binary, table), set()).add(chain)
    for (binary, table), chains in by_table.items():
        for line in _rules(binary, table):
            # shlex, not split(): kube-proxy's rules carry quoted comments with spaces, and a
            # rule that cannot be deleted keeps its target chain from being deleted.
            parts = shlex.split(line)
            if (
                parts[:1] == ["-A"]
                and parts[1] not in chains
                and any(f"-j {chain}" in line or f"-g {chain}" in line for chain in chains)
            ):
                run([binary, "-w", "-t", table, "-D", *parts[1:]], check=False)
        for chain in chains:
            run([binary, "-w", "-t", table, "-F", chain], check=False)
        for chain in chains:
            run([binary, "-w", "-t", table, "-X", chain], check=False)


def _netns_names() -> set[str]:
    try:
        return {p.name for p in NETNS_DIR.iterdir()}
    except OSError:
        return set()


def network_down(restore: dict[str, Any] | None = None) -> list[str]:
    """Remove what ``network_up`` and the pods made; returns the problems it met."""
    problems: list[str] = []
    for table, chain, rule in _guard_rules():
        for _ in range(5):  # a rule added twice (an interrupted run) is deleted twice
            if not _iptables(table, "-D", chain, rule):
                break
    for bridge in (POD_BRIDGE, NODE_BRIDGE):
        if _link_exists(bridge):
            try:
                run(["ip", "link", "del", bridge])
            except ClusterError as exc:
                problems.append(str(exc))
    if restore and restore.get("ip_forward") not in (None, "1"):
        Path("/proc/sys/net/ipv4/ip_forward").write_text(f"{restore['ip_forward']}\n")
    return problems


def discard_store(store: Path) -> None:
    """Delete a stopped containerd's root, so the next one starts with no image or snapshot.
    Its content and the two databases that must agree on its snapshots (containerd's and the
    snapshotter's) all go."""
    stuck = unmount_under(store)
    if stuck:
        raise ClusterError(f"cannot discard {store}: still mounted: {', '.join(stuck)}")
    shutil.rmtree(store, ignore_errors=True)
    if store.exists():
        raise ClusterError(f"cannot discard {store}: it is still there after rm -r")


def veth_names() -> set[str]:
    """The host's veth interfaces now (pods' host ends, among others)."""
    try:
        out = run(["ip", "-o", "link", "show", "type", "veth"], timeout=30)
    except ClusterError:
        return set()
    # "12: vethabc@if3: <BROADCAST,...> ..." -> vethabc
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def remove_veths(names: set[str]) -> list[str]:
    """Delete these veths (a pod's host end outlives its namespace only while something still
    holds the namespace); the ones that stayed, as messages."""
    problems = []
    for name in sorted(names):
        try:
            run(["ip", "link", "del", name], timeout=30)
        except ClusterError as exc:
            if _link_exists(name):
                problems.append(str(exc))
    return problems


def remove_netns(names: set[str]) -> None:
    """Unmount and delete the pod network namespaces named (their veths go with them)."""
    for name in names:
        path = NETNS_DIR / name
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30, check=False)
        with contextlib.suppress(OSError):
            path.unlink()


# -- configuration files ----------------------------------------------------------------------


@dataclass(frozen=True)
class NodePaths:
    """Where the node keeps its files. ``state`` is per cluster; ``images`` persists in the
    cache so images imported once are there on the next run."""

    state: Path
    images: Path

    @property
    def containerd_socket(self) -> Path:
        return self.state / "containerd" / "containerd.sock"

    @property
    def containerd_config(self) -> Path:
        return self.state / "containerd" / "config.toml"

    @property
    def cni_conf_dir(self) -> Path:
        return self.state / "cni" / "net.d"

    @property
    def kubelet_dir(self) -> Path:
        return self.state / "kubelet"

    @property
    def pod_logs(self) -> Path:
        return self.state / "pod-logs"


def containerd_config(paths: NodePaths, cni_bin_dir: Path) -> str:
    """containerd 1.6's config (version 2): our own root, state, socket and CNI directories."""
    lines = [
        "version = 2",
        f'root = "{paths.images}"',
        f'state = "{paths.state / "containerd" / "state"}"',
        "[grpc]",
        f'  address = "{paths.containerd_socket}"',
        "[ttrpc]",
        f'  address = "{paths.containerd_socket}.ttrpc"',
        '[plugins."io.containerd.internal.v1.opt"]',
        f'  path = "{paths.state / "containerd" / "opt"}"',
        '[plugins."io.containerd.grpc.v1.cri"]',
        f'  sandbox_image = "{PAUSE_IMAGE}"',
        # No CAP_SYS_RESOURCE here: runc cannot lower oom_score_adj below our own.
        "  restrict_oom_score_adj = true",
        '  stream_server_address = "127.0.0.1"',
        '  stream_server_port = "0"',
        "  enable_selinux = false",
        '[plugins."io.containerd.grpc.v1.cri".containerd]',
        '  snapshotter = "overlayfs"',
        '  default_runtime_name = "runc"',
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]',
        '  runtime_type = "io.containerd.runc.v2"',
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]',
        "  SystemdCgroup = false",
        '[plugins."io.containerd.grpc.v1.cri".cni]',
        f'  bin_dir = "{cni_bin_dir}"',
        f'  conf_dir = "{paths.cni_conf_dir}"',
        '[plugins."io.containerd.grpc.v1.cri".registry]',
        f'  config_path = "{paths.state / "containerd" / "certs.d"}"',
    ]
    return "\n".join(lines) + "\n"


def cni_conflist(paths: NodePaths) -> dict[str, Any]:
    """A bridge network on ``POD_BRIDGE`` with host-local IPAM, as kubenet used to set up."""
    return {
        "cniVersion": "1.0.0",
        "name": "embedding-operator-e2e",
        "plugins": [
            {
                "type": "bridge",
                "bridge": POD_BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(paths.state / "cni" / "ipam"),
                    "ranges": [[{"subnet": POD_SUBNET, "gateway": POD_GATEWAY}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
        ],
    }


def kubelet_config(
    paths: NodePaths, ca_file: Path, *, port: int, healthz_port: int, resolv_conf: Path
) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        # The apiserver authenticates with its kubelet client cert; everything else is asked
        # of the apiserver (TokenReview / SubjectAccessReview), as on kubeadm clusters.
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca_file)},
        },
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "cgroupfs",
        "containerRuntimeEndpoint": f"unix://{paths.containerd_socket}",
        "failSwapOn": False,
        "clusterDNS": [NODE_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(resolv_conf),
        "podLogsDir": str(paths.pod_logs),
        "serializeImagePulls": False,
        # The test machine's disk is shared with caches: never evict for disk pressure, and
        # never garbage-collect the images we imported (nothing could pull them back).
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "imageMinimumGCAge": "24h",
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "nodeStatusUpdateFrequency": "5s",
        "syncFrequency": "10s",
        "shutdownGracePeriod": "0s",
        "maxPods": 60,
    }


def kube_proxy_config(kubeconfig: Path, *, healthz_port: int, metrics_port: int) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "clusterCIDR": POD_SUBNET,
        "bindAddress": NODE_IP,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "hostnameOverride": NODE_NAME,
        # Leave the host's sysctls alone: conntrack table size and timeouts, and
        # route_localnet (only needed for NodePorts on 127.0.0.1, which no test uses).
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
        "iptables": {"syncPeriod": "10s", "minSyncPeriod": "0s", "localhostNodePorts": False},
    }


def corefile(kubeconfig: Path, *, health_port: int) -> str:
    """CoreDNS on the node IP: cluster names from the API, nothing forwarded upstream (the
    test machine reaches no DNS servers the cluster should use)."""
    return (
        f"{CLUSTER_DOMAIN}:53 in-addr.arpa:53 {{\n"
        f"    bind {NODE_IP}\n"
        f"    health 127.0.0.1:{health_port}\n"
        f"    kubernetes {CLUSTER_DOMAIN} in-addr.arpa {{\n"
        f"        kubeconfig {kubeconfig} e2e\n"
        "        pods insecure\n"
        "        ttl 5\n"
        "    }\n"
        "    cache 5\n"
        "    errors\n"
        "}\n"
        ".:53 {\n"
        f"    bind {NODE_IP}\n"
        "    template ANY ANY {\n"
        "        rcode NXDOMAIN\n"
        "    }\n"
        "}\n"
    )


def write_yaml(path: Path, document: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def write_node_files(paths: NodePaths, *, cni_bin_dir: Path, resolv_conf: Path) -> None:
    """containerd's config and the CNI conflist (the kubelet's config needs its ports)."""
    paths.containerd_config.parent.mkdir(parents=True, exist_ok=True)
    paths.images.mkdir(parents=True, exist_ok=True)
    paths.containerd_config.write_text(containerd_config(paths, cni_bin_dir))
    paths.cni_conf_dir.mkdir(parents=True, exist_ok=True)
    (paths.cni_conf_dir / "10-embedding-operator-e2e.conflist").write_text(
        json.dumps(cni_conflist(paths), indent=2) + "\n"
    )
    paths.pod_logs.mkdir(parents=True, exist_ok=True)
    resolv_conf.write_text(f"nameserver {NODE_IP}\n")


# -- containerd housekeeping ------------------------------------------------------------------


def ctr(paths: NodePaths, *args: str, timeout: float = COMMAND_TIMEOUT_S) -> str:
    return run(
        ["ctr", "--address", str(paths.containerd_socket), "--namespace", "k8s.io", *args],
        timeout=timeout,
    )


def containerd_answers(paths: NodePaths) -> bool:
    """containerd is serving on its socket (``ctr version`` reaches the daemon)."""
    if not paths.containerd_socket.exists():
        return False
    try:
        run(["ctr", "--address", str(paths.containerd_socket), "version"], timeout=10)
    except ClusterError:
        return False
    return True


def remove_containers(paths: NodePaths) -> list[str]:
    """Kill and delete every container task left in containerd's ``k8s.io`` namespace, so no
    container outlives the cluster (the kubelet is gone by now and would not do it); what
    failed, as messages. A containerd that does not answer is not asked: ``kill_shims`` ends
    its containers without it, after containerd stops."""
    if not containerd_answers(paths):
        return []
    problems: list[str] = []

    def attempt(*args: str) -> str:
        try:
            return ctr(paths, *args)
        except ClusterError as exc:
            problems.append(str(exc))
            return ""

    for task in attempt("tasks", "ls", "-q").split():
        attempt("tasks", "kill", "--signal", "SIGKILL", task)
    for task in attempt("tasks", "ls", "-q").split():
        attempt("tasks", "delete", "--force", task)
    for container in attempt("containers", "ls", "-q").split():
        attempt("containers", "delete", container)
    return problems


SHIM_PREFIX = "containerd-shim"
SHIM_EXIT_TIMEOUT_S = 10.0


def _processes() -> dict[int, tuple[int, list[str]]]:
    """Every process now: pid -> (parent pid, argv)."""
    found: dict[int, tuple[int, list[str]]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # it ended while we looked
        # The command name in stat is in parentheses and may hold spaces: read after the last.
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        found[int(entry.name)] = (ppid, [a.decode(errors="replace") for a in argv if a])
    return found


def shim_trees(paths: NodePaths) -> dict[int, list[int]]:
    """containerd's shims serving this node's socket, each with its descendants (the
    containers' processes: a shim is their subreaper), deepest first."""
    processes = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in processes.items():
        children.setdefault(ppid, []).append(pid)
    socket = str(paths.containerd_socket)
    trees: dict[int, list[int]] = {}
    for pid, (_, argv) in processes.items():
        if not argv or not Path(argv[0]).name.startswith(SHIM_PREFIX):
            continue
        if socket not in argv:
            continue
        descendants: list[int] = []
        stack = list(children.get(pid, []))
        while stack:
            child = stack.pop()
            descendants.append(child)
            stack.extend(children.get(child, []))
        trees[pid] = descendants[::-1]
    return trees


def kill_shims(paths: NodePaths) -> list[str]:
    """SIGKILL the shims of this node's containerd and every process under them: after a
    containerd that did not answer (or was killed) their containers would run on, holding
    their network namespaces, veths and mounts. Empty when none is left; otherwise a message
    naming each process that survived."""
    trees = shim_trees(paths)
    if not trees:
        return []
    pids = [pid for shim, tree in trees.items() for pid in (*tree, shim)]
    log.warning(
        "containerd left %d shim(s) with %d process(es) under them: killing them",
        len(trees),
        len(pids) - len(trees),
    )
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + SHIM_EXIT_TIMEOUT_S
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if process_running(pid)]
    return [f"process {pid} ({_argv(pid)}) outlived SIGKILL" for pid in alive]


def process_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a zombie holds no resources)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def _argv(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "gone"


# Paths the kubelet, containerd's shims and libcni write whatever their flags say; whichever
# of them did not exist before the node started is removed with it.
HOST_PATHS = (
    "/var/lib/kubelet",
    "/var/log/containers",
    "/var/log/pods",
    "/var/lib/cni",
    "/run/containerd",
)


def existing_host_paths() -> list[str]:
    return [path for path in HOST_PATHS if Path(path).exists()]


def remove_host_paths(existed_before: Sequence[str]) -> None:
    for path in HOST_PATHS:
        if path not in existed_before:
            unmount_under(Path(path))
            shutil.rmtree(path, ignore_errors=True)


def pod_netns_names() -> set[str]:
    """containerd's pod network namespaces (``cni-<uuid>``) that exist now."""
    return {name for name in _netns_names() if name.startswith("cni-")}


def which(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ClusterError(
            f"`{name}` is not installed; e2e.harness.host_packages installs the node's Debian "
            "packages"
        )
    return path
