"""The existing-cluster mode, run once per CI run so it cannot rot unnoticed.

Nothing else would run it: CI has no other cluster. So this points the mode at the harness's
own cluster, as a contributor points it at a kind cluster: a second pytest, given only
``E2E_KUBECONFIG`` (this session's admin kubeconfig), the images built here by name, and a
values file that places the operator and the server pods on the tainted real node (as a
platform team's values would place them on a dedicated node pool). It must build and load
nothing, install the chart with Helm, bring ``examples/minilm-cpu.yaml`` to Ready and have a
pod's OpenAI client get sentence-transformers' vectors from it (the README path), and skip
what needs the local node, saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from e2e.harness.cluster import REAL_NODE_TAINT_KEY, Cluster
from e2e.harness.existing import SKIP_REASONS
from e2e.harness.images import ImageSet
from e2e.harness.node import NODE_NAME

# It drives the harness's own cluster; on an existing cluster, the mode is what is running.
pytestmark = pytest.mark.local_node

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900
# The README path with the chart's install, and one test of each kind the mode must skip.
SELECTED = [
    "e2e/test_real_node.py::test_readme_path_serves_sentence_transformers_vectors",
    "e2e/test_real_node.py::test_reranker_serves_cross_encoder_scores_from_an_offline_model_cache",
    "e2e/test_smoke.py::test_gpu_pods_run_only_on_the_requested_gpu_type",
]


def test_existing_cluster_mode_installs_the_chart_and_serves_the_readme_path(
    cluster: Cluster, e2e_images: ImageSet, tmp_path: Path
) -> None:
    toleration = {"key": REAL_NODE_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
    on_node = {"kubernetes.io/hostname": NODE_NAME}
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "tolerations": [toleration],
                "nodeSelector": on_node,
                "gpuProfiles": {"cpu": {"nodeSelector": on_node, "tolerations": [toleration]}},
            }
        )
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("E2E_")},
        "E2E_KUBECONFIG": str(cluster.kubeconfig),
        "E2E_OPERATOR_IMAGE": e2e_images.operator,
        "E2E_SERVER_IMAGE": e2e_images.server,
        "E2E_CLIENT_IMAGE": e2e_images.client,
        "E2E_HELM_VALUES": str(values),
        "E2E_NAMESPACE_PREFIX": "existing-",
        # Nothing may be built in this mode: an empty cache would make any build attempt
        # start from scratch (and fail the deadline) instead of passing unnoticed.
        "EMBEDDING_OPERATOR_CACHE": str(tmp_path / "no-cache"),
    }
    report = tmp_path / "report.xml"
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *SELECTED,
            "-m",
            "e2e",
            "-rs",
            "-p",
            "no:cacheprovider",
            f"--basetemp={tmp_path / 'inner'}",
            f"--junitxml={report}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    seconds = time.monotonic() - started
    # The inner run's own output (its diagnostics on failure included), for whoever reads this.
    print(
        f"inner pytest ({seconds:.0f} s), rc={result.returncode}:\n{result.stdout}{result.stderr}"
    )
    assert "e2e: existing cluster from E2E_KUBECONFIG" in result.stdout, "not in the mode"
    assert result.returncode == 0, "the existing-cluster run failed (its output is above)"

    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        skipped = case.find("skipped")
        failed = case.find("failure") is not None or case.find("error") is not None
        outcome = "failed" if failed else "skipped" if skipped is not None else "passed"
        outcomes[case.get("name")] = (outcome, "" if skipped is None else skipped.get("message"))
    assert outcomes["test_readme_path_serves_sentence_transformers_vectors"] == ("passed", "")
    reranker = outcomes["test_reranker_serves_cross_encoder_scores_from_an_offline_model_cache"]
    assert reranker[0] == "skipped" and SKIP_REASONS["local_node"] in (reranker[1] or "")
    gpu_pods = outcomes["test_gpu_pods_run_only_on_the_requested_gpu_type"]
    assert gpu_pods[0] == "skipped" and SKIP_REASONS["kwok"] in (gpu_pods[1] or "")
    assert not (tmp_path / "no-cache").exists(), "the existing-cluster mode built something"
