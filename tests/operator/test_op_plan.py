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
    ("spec", "reason", "field", "has_render"),
    [
        ({"model": {"name": ""}}, "InvalidSpec", "spec.model.name", False),
        ({"model": M, "gpu": {"type": "tpu"}}, "UnknownGPUType", "spec.gpu.type", False),
        (
            {"model": M, "gpu": {"type": "h100"}, "parallelism": {"tensorParallelSize": 2}},
            "TensorParallelUnsupported",
            "spec.parallelism.tensorParallelSize",
            True,
        ),
    ],
)
def test_refusals_name_the_field(
    spec: dict[str, Any], reason: str, field: str, has_render: bool
) -> None:
    refused = plan(OWNER, spec, GpuProfiles.builtin())
    assert isinstance(refused, Refused)
    assert refused.problem.reason == reason and refused.problem.message.startswith(field)
    assert not refused.problem.retryable
    assert (refused.render is not None) == has_render
