"""The local cluster's metrics pipeline: Prometheus, prometheus-adapter and KEDA.

Prometheus scrapes the server and operator pods on the real node and evaluates the chart's
recording rules and alerts (its PrometheusRule); prometheus-adapter serves
custom.metrics.k8s.io from it with the rules the chart renders; the APIService points the
aggregation layer at the adapter on the node IP. The HPAs the operator makes read the
servers' queue depth through it, as they would on a cluster with the chart's adapter rules.

KEDA (its operator and metrics API server, with its own CRDs from the pinned module) serves
external.metrics.k8s.io the same way, for services with ``autoscaler: keda``: its
ScaledObjects' Prometheus triggers query this Prometheus on 127.0.0.1 (``prometheus_url``, the
address the operator is given as ``--keda-prometheus-address``), and its operator takes
services to and from zero replicas.
"""

from __future__ import annotations

import yaml

from e2e.harness.cluster.client import b64
from e2e.harness.cluster.context import ClusterContext, KubeCommands
from e2e.harness.components import (
    KedaMetricsServer,
    KedaOperator,
    Prometheus,
    PrometheusAdapter,
    adapter_api_objects,
    keda_api_objects,
)
from e2e.harness.images.refs import CHART_DIR


class MetricsPipeline:
    def __init__(self, cluster: ClusterContext, *, keda: bool = True) -> None:
        self.cluster = cluster
        self.keda = keda

    def start(self) -> None:
        cluster = self.cluster
        state = cluster.real_node.paths.state
        prometheus = cluster.start_component(
            Prometheus(
                cluster.launcher,
                cluster.binaries.prometheus,
                state_dir=state,
                kubeconfig=cluster.kubeconfig,
                port=cluster.ports.prometheus,
                timeout=cluster.timeouts.prometheus,
                rules=chart_prometheus_rules(cluster),
            )
        )
        adapter = cluster.add_component(
            PrometheusAdapter(
                cluster.launcher,
                cluster.binaries.prometheus_adapter,
                cluster.api,
                state_dir=state,
                kubeconfig=cluster.kubeconfig,
                rules=chart_adapter_rules(cluster),
                prometheus_url=prometheus.url,
                port=cluster.ports.adapter,
                timeout=cluster.timeouts.adapter,
            )
        )
        cluster.apply(adapter_api_objects(cluster.ports.adapter, b64(cluster.pki.ca.cert)))
        adapter.wait_ready()
        if self.keda:
            self.start_keda()

    def start_keda(self) -> None:
        cluster = self.cluster
        state = cluster.real_node.paths.state
        ports = cluster.ports
        crds = cluster.binaries.keda_crds
        cluster.control_plane.apply_crds(sorted(crds.glob("*.yaml")))
        cluster.apply(keda_api_objects(ports.keda_apiserver, b64(cluster.pki.ca.cert)))
        cluster.start_component(
            KedaOperator(
                cluster.launcher,
                cluster.binaries.keda_operator,
                cluster.pki.keda,
                cluster.pki.ca,
                state_dir=state,
                kubeconfig=cluster.kubeconfig,
                grpc_port=ports.keda_grpc,
                metrics_port=ports.keda_metrics,
                probe_port=ports.keda_probe,
                timeout=cluster.timeouts.keda,
            )
        )
        cluster.start_component(
            KedaMetricsServer(
                cluster.launcher,
                cluster.binaries.keda_adapter,
                cluster.api,
                state_dir=state,
                kubeconfig=cluster.kubeconfig,
                grpc_port=ports.keda_grpc,
                port=ports.keda_apiserver,
                metrics_port=ports.keda_apiserver_metrics,
                timeout=cluster.timeouts.keda,
            )
        )


def chart_adapter_rules(client: KubeCommands) -> str:
    """prometheus-adapter's config as the chart renders it (its rules ConfigMap)."""
    rendered = client.helm(
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


def chart_prometheus_rules(client: KubeCommands) -> str:
    """The chart's recording rules and alerts (its PrometheusRule's groups) as a Prometheus
    rule file."""
    rendered = client.helm(
        "template",
        "e2e",
        str(CHART_DIR),
        "--show-only",
        "templates/prometheusrule.yaml",
        "--set",
        "monitoring.prometheusRule.enabled=true",
    ).stdout
    rule = yaml.safe_load(rendered)
    return yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False)
