"""The e2e harness: a real local Kubernetes cluster from real binaries, in the style of envtest.

Modules, each runnable where it has a command line (from the repository root):

* ``cluster``: ``Cluster`` composes the components below into a running cluster for the tests;
  ``python -m e2e.harness.cluster up|env|down`` runs one for manual use.
* ``components``: one class per process (etcd, kube-apiserver, kube-controller-manager,
  kube-scheduler, kwok, containerd, kube-proxy, CoreDNS, kubelet, Prometheus,
  prometheus-adapter), each with its command line, health probe, start and stop.
* ``node``: the real node's host side: bridges, guard rules, config files, cleanup.
* ``pki``: the cluster's certificates; ``probes``: HTTP, API and DNS health probes;
  ``proc``: child processes that never outlive their owner.
* ``binaries``: builds the Go binaries from ``e2e/tools`` (``python -m e2e.harness.binaries``).
* ``images``: builds and loads the container images (``python -m e2e.harness.images``).
* ``host_packages``: installs the Debian packages the node and the image builds need.
* ``operator``: the operator under test, run as the chart's ServiceAccount, and helpers.
"""
