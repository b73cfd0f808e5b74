"""plan(): the one path from a raw spec to children, shared by reconcile and render."""

from __future__ import annotations

from typing import Any

import pytest
from embedding_operator.builders import desired_children
from embedding_operator.builders.common import Owner
from embedding_operator.plan import Planned, Refused, plan
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
