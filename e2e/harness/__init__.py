"""The e2e harness: a real local Kubernetes cluster from real binaries, in the style of envtest.

Modules, each runnable where it has a command line (from the repository root):

* ``cluster`` (a package): ``KubeClient``, kubectl/helm/ServiceAccount access by a kubeconfig,
  and ``Cluster``, a ``KubeClient`` that runs the cluster from the components below (control
  plane, kwok's fake GPU nodes, the real node, Prometheus and prometheus-adapter);
  ``python -m e2e.harness.cluster up|env|down`` runs one for manual use.
* ``existing``: the existing-cluster mode (``E2E_KUBECONFIG``): the tests on a cluster you have.
* ``components``: one class per process (etcd, kube-apiserver, kube-controller-manager,
  kube-scheduler, kwok, containerd, kube-proxy, CoreDNS, kubelet, Prometheus,
  prometheus-adapter), each with its command line, health probe, start and stop.
* ``node``: the real node's host side: bridges, guard rules, config files, cleanup.
* ``pki``: the cluster's certificates; ``probes``: HTTP, API and DNS health probes;
  ``proc``: child processes that never outlive their owner, ``free_port``, ``poll_until``.
* ``binaries``: builds the Go binaries from ``e2e/tools`` (``python -m e2e.harness.binaries``).
* ``images`` (a package): builds, loads and saves the container images
  (``python -m e2e.harness.images``).
* ``host_packages``: installs the Debian packages the node and the image builds need.
* ``operator``: the operator under test, run as the chart's ServiceAccount, and helpers.
"""
