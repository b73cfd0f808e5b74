"""Fixtures for the operator's cluster-free tests."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.support.operator import CRD_PATH, FakeCluster


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return dict(yaml.safe_load(CRD_PATH.read_text()))


@pytest.fixture(scope="session")
def schema(crd: dict[str, Any]) -> dict[str, Any]:
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster()
