"""plan(): the one path from a raw spec to children, shared by reconcile and render."""

from __future__ import annotations

from typing import Any

import pytest
from embedding_operator.builders import desired_children
from embedding_operator.builders.common import Owner
from embedding_operator.plan import Planned, Refused, plan
from embedding_operator.policy import WorkloadPolicy
from embedding_operator.profiles import GpuProfiles

from tests.support.operator import render_input

M = {"name": "m"}
OWNER = Owner(name="emb", namespace="ns", uid="uid-1", generation=1)


def test_a_good_spec_plans_the_builders_children() -> None:
    spec = {"model": {"name": "m"}, "gpu": {"type": "l4"}}
    planned = plan(OWNER, spec, GpuProfiles.builtin(), "img:1")
    assert isinstance(planned, Planned)
    assert planned.render.default_image == "img:1"
    expected = desired_children(render_input(spec))
    assert [m["kind"] for m in planned.children.present] == [m["kind"] for m in expected.present]
    assert planned.children.absent == expected.absent


@pytest.mark.parametrize(
    ("spec", "reason", "field"),
    [
        ({"model": {"name": ""}}, "InvalidSpec", "spec.model.name"),
        ({"model": M, "gpu": {"type": "tpu"}}, "UnknownGPUType", "spec.gpu.type"),
    ],
)
def test_refusals_name_the_field(spec: dict[str, Any], reason: str, field: str) -> None:
    refused = plan(OWNER, spec, GpuProfiles.builtin())
    assert isinstance(refused, Refused)
    assert refused.problem.reason == reason and refused.problem.message.startswith(field)
    assert not refused.problem.retryable


@pytest.mark.parametrize("gpu", ["h100", "cpu"])
def test_tensor_parallelism_on_the_bundled_server_is_planned(gpu: str) -> None:
    spec = {"model": M, "gpu": {"type": gpu}, "parallelism": {"tensorParallelSize": 2}}
    planned = plan(OWNER, spec, GpuProfiles.builtin(), "img:1")
    assert isinstance(planned, Planned)
    (deployment,) = [m for m in planned.children.present if m["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "img:1"
    assert container["args"][container["args"].index("--tensor-parallel-size") + 1] == "2"


# --- the admins' allowlist (policy.py) ---------------------------------------------------------

POLICY = WorkloadPolicy(
    allowed_images=("registry.example/embedding-server:*",),
    allowed_priority_classes=("inference",),
)


@pytest.mark.parametrize(
    ("server", "scheduling", "reason", "field"),
    [
        ({"image": "evil.example/miner:1"}, {}, "ImageNotAllowed", "spec.server.image"),
        # A glob is matched against the whole reference, not a prefix of it.
        (
            {"image": "registry.example/embedding-server-x:1"},
            {},
            "ImageNotAllowed",
            "spec.server.image",
        ),
        (
            {},
            {"priorityClassName": "system-node-critical"},
            "PriorityClassNotAllowed",
            "spec.scheduling.priorityClassName",
        ),
    ],
)
def test_allowlist_refuses_with_the_field(
    server: dict[str, Any], scheduling: dict[str, Any], reason: str, field: str
) -> None:
    spec = {"model": M, "server": server, "scheduling": scheduling}
    refused = plan(OWNER, spec, GpuProfiles.builtin(), "img:1", POLICY)
    assert isinstance(refused, Refused)
    assert refused.problem.reason == reason and not refused.problem.retryable
    assert refused.problem.message.startswith(f"{field}: ")
    assert "nothing is applied" in refused.problem.message
    # No allowlist configured: the same spec plans.
    assert isinstance(plan(OWNER, spec, GpuProfiles.builtin(), "img:1"), Planned)


@pytest.mark.parametrize(
    ("server", "scheduling"),
    [
        ({}, {}),  # the default image, no priority class
        ({"image": "img:1"}, {}),  # the default image, named explicitly
        ({"image": "registry.example/embedding-server:2.0"}, {"priorityClassName": "inference"}),
    ],
)
def test_allowlist_admits(server: dict[str, Any], scheduling: dict[str, Any]) -> None:
    spec = {"model": M, "server": server, "scheduling": scheduling}
    assert isinstance(plan(OWNER, spec, GpuProfiles.builtin(), "img:1", POLICY), Planned)
