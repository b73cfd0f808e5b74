"""A Kubernetes cluster for the e2e tests: the harness's own, or access to an existing one.

One module per part, as components.py has one class per process:

* ``client``: ``KubeClient``, kubectl / helm / ServiceAccount kubeconfigs against a cluster by
  its kubeconfig; all a chart-level test needs, on any cluster (see existing.py);
* ``local``: ``Cluster``, a ``KubeClient`` that also runs the cluster on this machine, from
  real binaries on 127.0.0.1 and the node IP, composed of
* ``control_plane`` (etcd, kube-apiserver, the CRDs, controller manager, scheduler),
  ``fake_nodes`` (kwok's GPU nodes), ``real_node`` (containerd and the images, kube-proxy,
  CoreDNS, the kubelet) and ``monitoring`` (Prometheus and prometheus-adapter);
* ``context``: ``ClusterContext``, what those parts use of the cluster (a Protocol, so they
  never import ``local``), with its ``Ports`` and ``Timeouts``;
* ``state``: a detached cluster's state file; ``cli``: ``python -m e2e.harness.cluster
  up|env|down``.

The names below are the package's public surface (the e2e tests and fixtures, bench).
"""

from e2e.harness.binaries import Binaries, BuildError
from e2e.harness.cluster.client import KubeClient, kubeconfig_dict
from e2e.harness.cluster.context import Timeouts
from e2e.harness.cluster.local import Cluster
from e2e.harness.cluster.monitoring import chart_adapter_rules
from e2e.harness.cluster.real_node import (
    REAL_NODE_TAINT,
    REAL_NODE_TAINT_KEY,
    start_containerd_with_images,
)
from e2e.harness.proc import ClusterError, poll_until

__all__ = [
    "REAL_NODE_TAINT",
    "REAL_NODE_TAINT_KEY",
    "Binaries",
    "BuildError",
    "Cluster",
    "ClusterError",
    "KubeClient",
    "Timeouts",
    "chart_adapter_rules",
    "kubeconfig_dict",
    "poll_until",
    "start_containerd_with_images",
]
