"""Certificates and keys for the e2e control plane, made with the `openssl` CLI.

One throwaway CA signs the serving certs of kube-apiserver, kube-controller-manager and
kube-scheduler (so every health probe verifies TLS) and the client certs the components
authenticate with. Client identities are the ones RBAC bootstraps roles for
(``system:kube-controller-manager``, ``system:kube-scheduler``), so the control plane runs
under real RBAC; only the admin user is in ``system:masters``. A separate key pair signs
ServiceAccount tokens, and a separate front-proxy CA backs the aggregation layer's
requestheader authentication, as kubeadm sets it up. ECDSA P-256 throughout: key generation is
instant, unlike RSA.
"""

from __future__ import annotations

import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from e2e.harness.node import NODE_IP, NODE_NAME
from e2e.harness.proc import ClusterError, run_command

CERT_DAYS = 7
SERVICE_IP = "198.19.0.1"  # first address of --service-cluster-ip-range: the `kubernetes` Service
APISERVER_SANS = (
    "IP:127.0.0.1",
    f"IP:{NODE_IP}",
    f"IP:{SERVICE_IP}",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
)
LOCAL_SANS = ("IP:127.0.0.1", "DNS:localhost")
# The aggregation layer dials an APIService by its Service's DNS name and verifies it.
ADAPTER_SANS = (f"IP:{NODE_IP}", "DNS:prometheus-adapter.kube-system.svc")
# KEDA's metrics server is an APIService too, and dials the KEDA operator's gRPC metrics
# service on 127.0.0.1 with mutual TLS: one certificate serves both ends, as a server and a client.
KEDA_SANS = (
    "IP:127.0.0.1",
    f"IP:{NODE_IP}",
    "DNS:keda-metrics-apiserver.keda.svc",
    "DNS:keda-operator.keda.svc",
)
FRONT_PROXY_CLIENT = "front-proxy-client"


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: KeyPair
    apiserver: KeyPair
    controller_manager_serving: KeyPair
    scheduler_serving: KeyPair
    admin: KeyPair
    controller_manager: KeyPair
    scheduler: KeyPair
    service_account_key: Path
    service_account_pub: Path
    # The aggregation layer's requestheader auth (as kubeadm sets it up): without it every
    # component logs errors about the missing requestheader CA, and no APIService could work.
    front_proxy_ca: KeyPair
    front_proxy_client: KeyPair
    # The real node: the kubelet's identity (Node authorizer), kube-proxy's (bootstrap RBAC's
    # system:node-proxier), the apiserver's client cert for the kubelet API, and the serving
    # cert of prometheus-adapter, which listens on the node IP behind an APIService.
    node: KeyPair
    kube_proxy: KeyPair
    apiserver_kubelet_client: KeyPair
    adapter_serving: KeyPair
    keda: KeyPair


def _openssl(*args: str) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ClusterError("`openssl` is not on PATH; it makes the cluster's certificates")
    run_command([openssl, *args], timeout=60, what=f"openssl {' '.join(args)}")


def _key(path: Path) -> Path:
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path)
    )
    path.chmod(0o600)
    return path


def _signed(
    directory: Path, name: str, ca: KeyPair, subject: str, extensions: list[str]
) -> KeyPair:
    key = _key(directory / f"{name}.key")
    csr = directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    cert = directory / f"{name}.crt"
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
    ext.write_text("\n".join(["basicConstraints=critical,CA:FALSE", *extensions]) + "\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca.cert),
        "-CAkey",
        str(ca.key),
        "-set_serial",
        str(secrets.randbits(63) | 1),
        "-days",
        str(CERT_DAYS),
        "-extfile",
        str(ext),
        "-out",
        str(cert),
    )
    csr.unlink()
    ext.unlink()
    return KeyPair(cert, key)


def _server(
    directory: Path,
    name: str,
    ca: KeyPair,
    cn: str,
    sans: tuple[str, ...],
    *,
    client_auth: bool = False,
) -> KeyPair:
    """A serving certificate for ``sans``; with ``client_auth``, one that also authenticates
    its holder as a client."""
    usage = "serverAuth,clientAuth" if client_auth else "serverAuth"
    return _signed(
        directory,
        name,
        ca,
        f"/CN={cn}",
        [
            "keyUsage=critical,digitalSignature,keyEncipherment",
            f"extendedKeyUsage={usage}",
            f"subjectAltName={','.join(sans)}",
        ],
    )


def _client(directory: Path, name: str, ca: KeyPair, subject: str) -> KeyPair:
    return _signed(
        directory,
        name,
        ca,
        subject,
        [
            "keyUsage=critical,digitalSignature,keyEncipherment",
            "extendedKeyUsage=clientAuth",
        ],
    )


def _ca(directory: Path, name: str, cn: str) -> KeyPair:
    key = _key(directory / f"{name}.key")
    cert = directory / f"{name}.crt"
    # fmt: off
    _openssl("req", "-x509", "-new", "-key", str(key), "-subj", f"/CN={cn}",
             "-days", str(CERT_DAYS), "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
             "-out", str(cert))
    # fmt: on
    return KeyPair(cert, key)


def create_pki(directory: Path) -> Pki:
    """Write a fresh CA, serving/client certs and the ServiceAccount key pair to ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca(directory, "ca", "embedding-operator-e2e-ca")
    front_proxy_ca = _ca(directory, "front-proxy-ca", "embedding-operator-e2e-front-proxy-ca")
    sa_key = _key(directory / "service-account.key")
    sa_pub = directory / "service-account.pub"
    _openssl("pkey", "-in", str(sa_key), "-pubout", "-out", str(sa_pub))
    return Pki(
        ca=ca,
        apiserver=_server(directory, "apiserver", ca, "kube-apiserver", APISERVER_SANS),
        controller_manager_serving=_server(
            directory, "controller-manager-serving", ca, "kube-controller-manager", LOCAL_SANS
        ),
        scheduler_serving=_server(directory, "scheduler-serving", ca, "kube-scheduler", LOCAL_SANS),
        admin=_client(directory, "admin", ca, "/O=system:masters/CN=e2e-admin"),
        controller_manager=_client(
            directory, "controller-manager", ca, "/CN=system:kube-controller-manager"
        ),
        scheduler=_client(directory, "scheduler", ca, "/CN=system:kube-scheduler"),
        front_proxy_ca=front_proxy_ca,
        front_proxy_client=_client(
            directory, "front-proxy-client", front_proxy_ca, f"/CN={FRONT_PROXY_CLIENT}"
        ),
        node=_client(directory, "node", ca, f"/O=system:nodes/CN=system:node:{NODE_NAME}"),
        kube_proxy=_client(directory, "kube-proxy", ca, "/CN=system:kube-proxy"),
        apiserver_kubelet_client=_client(
            directory,
            "apiserver-kubelet-client",
            ca,
            "/O=system:masters/CN=kube-apiserver-kubelet-client",
        ),
        adapter_serving=_server(
            directory, "adapter-serving", ca, "prometheus-adapter", ADAPTER_SANS
        ),
        keda=_server(directory, "keda", ca, "keda", KEDA_SANS, client_auth=True),
        service_account_key=sa_key,
        service_account_pub=sa_pub,
    )
