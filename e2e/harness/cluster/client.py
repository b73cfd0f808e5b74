"""kubectl, helm and ServiceAccount access to a cluster by its kubeconfig, for tests and tools.

``KubeClient`` is all a chart-level test needs from a cluster, whichever it is: the harness's
local one (``Cluster`` is a ``KubeClient`` that also runs the processes) or an existing one
(existing.py). Commands run with a deadline and raise ``ClusterError`` with kubectl's or
helm's stderr; helm keeps its state inside the client's workdir, never the user's
~/.config/helm.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from e2e.harness.proc import poll_until, run_command

# A namespace name is a DNS label.
NAMESPACE_MAX = 63


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def kubeconfig_dict(
    server: str, ca_file: Path, user: Mapping[str, str], *, namespace: str = "default"
) -> dict[str, Any]:
    """A self-contained kubeconfig (certificates embedded) for one user."""
    return kubeconfig_for(
        {"server": server, "certificate-authority-data": b64(ca_file)}, user, namespace=namespace
    )


def kubeconfig_for(
    cluster: Mapping[str, Any], user: Mapping[str, str], *, namespace: str = "default"
) -> dict[str, Any]:
    """A kubeconfig with one cluster entry (``server``, CA, ...) and one user."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": dict(cluster)}],
        "users": [{"name": "e2e-user", "user": dict(user)}],
        "contexts": [
            {
                "name": "e2e",
                "context": {"cluster": "e2e", "user": "e2e-user", "namespace": namespace},
            }
        ],
        "current-context": "e2e",
    }


def write_kubeconfig(path: Path, config: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
    path.chmod(0o600)
    return path


def cert_user(cert: Path, key: Path) -> dict[str, str]:
    return {"client-certificate-data": b64(cert), "client-key-data": b64(key)}


class KubeClient:
    """kubectl and helm against the cluster ``kubeconfig`` names (its current context).

    ``bin_dirs`` go first on ``PATH`` in ``env()``, so a plain ``kubectl`` in a subprocess is
    this client's; ``namespace_prefix`` is put in front of every namespace ``create_namespace``
    makes (a shared cluster then shows which namespaces the e2e tier made).
    """

    def __init__(
        self,
        kubeconfig: Path,
        *,
        kubectl: Path,
        helm: Path,
        workdir: Path,
        bin_dirs: Sequence[Path] = (),
        command_timeout: float = 120,
        service_account_timeout: float = 60,
        namespace_prefix: str = "",
    ) -> None:
        self.kubeconfig = kubeconfig
        self.kubectl_bin = kubectl
        self.helm_bin = helm
        self.workdir = workdir
        self.bin_dirs = list(bin_dirs)
        self.command_timeout = command_timeout
        self.service_account_timeout = service_account_timeout
        self.namespace_prefix = namespace_prefix
        self._cluster_entry: dict[str, Any] | None = None

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for subprocesses: KUBECONFIG, our binaries first on PATH, and helm
        state kept inside the workdir (never the user's ~/.config/helm)."""
        env = dict(os.environ if base is None else base)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = os.pathsep.join([*(str(d) for d in self.bin_dirs), env.get("PATH", "")])
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
        """Run kubectl against this cluster (admin unless ``kubeconfig`` is given)."""
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
        """Run helm against this cluster (admin unless ``kubeconfig`` is given)."""
        config = kubeconfig or self.kubeconfig
        return self._run(
            self.helm_bin, [f"--kubeconfig={config}", *args], check=check, timeout=timeout
        )

    def create_namespace(self, name: str, *, labels: Mapping[str, str] | None = None) -> str:
        """Create a namespace (``namespace_prefix`` + ``name``) and wait until its ``default``
        ServiceAccount exists (the ServiceAccount admission plugin rejects pods until it
        does); returns the name it got."""
        name = (self.namespace_prefix + name)[:NAMESPACE_MAX].rstrip("-")
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

    def service_account_exists(self, namespace: str, name: str) -> bool:
        found = self.kubectl(
            "get", "serviceaccount", name, "-n", namespace, "--ignore-not-found", "-o", "name"
        )
        return bool(found.stdout.strip())

    def wait_for_service_account(self, namespace: str, name: str) -> None:
        poll_until(
            lambda: self.service_account_exists(namespace, name),
            timeout=self.service_account_timeout,
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

    def cluster_entry(self) -> dict[str, Any]:
        """The kubeconfig's cluster entry for its current context (server and CA, embedded),
        for kubeconfigs of other users of the same cluster."""
        if self._cluster_entry is None:
            config = self.kubectl_json("config", "view", "--minify", "--flatten", "--raw")
            self._cluster_entry = dict(config["clusters"][0]["cluster"])
        return self._cluster_entry

    def service_account_kubeconfig(
        self, namespace: str, name: str, *, path: Path | None = None, duration_s: int = 3600
    ) -> Path:
        """Write a kubeconfig that authenticates as ServiceAccount ``namespace/name`` with a
        TokenRequest token, so a program runs with exactly that account's RBAC."""
        token = self.service_account_token(namespace, name, duration_s=duration_s)
        path = path or self.workdir / "kubeconfigs" / f"sa-{namespace}-{name}.kubeconfig"
        return write_kubeconfig(
            path, kubeconfig_for(self.cluster_entry(), {"token": token}, namespace=namespace)
        )

    def _run(
        self,
        binary: Path,
        args: Sequence[str],
        *,
        input: str | None = None,
        check: bool,
        timeout: float | None,
    ) -> subprocess.CompletedProcess[str]:
        return run_command(
            [str(binary), *args],
            timeout=timeout if timeout is not None else self.command_timeout,
            check=check,
            env=self.env(),
            input=input,
            what=f"`{binary.name} {' '.join(args)}`",
        )
