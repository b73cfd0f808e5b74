"""What the project's images are called, where their sources live, and the error they raise.

The image references follow the chart (``charts/embedding-operator/values.yaml``): the chart's
default image is the one the e2e tier builds, so ``helm install`` with no image values runs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from e2e.harness.binaries import cache_root

ROOT = Path(__file__).resolve().parents[3]
IMAGES_DIR = ROOT / "images"
CHART_DIR = ROOT / "charts" / "embedding-operator"
SERVER_DOCKERFILE = IMAGES_DIR / "server.Dockerfile"
OPERATOR_DOCKERFILE = IMAGES_DIR / "operator.Dockerfile"
CLIENT_DOCKERFILE = IMAGES_DIR / "e2e-client.Dockerfile"
PAUSE_DOCKERFILE = IMAGES_DIR / "pause.Dockerfile"
PAUSE_SOURCE = IMAGES_DIR / "pause" / "pause.c"
LOCKS = {
    "server": IMAGES_DIR / "server.lock",
    "operator": IMAGES_DIR / "operator.lock",
    "e2e-client": IMAGES_DIR / "e2e-client.lock",
}
TORCH_SOURCES = ("pypi", "cpu")
"""Where the server image's torch comes from (its ``TORCH_SOURCE`` build argument): PyPI's
wheel, which carries the CUDA runtime as nvidia-* wheels (the default, and the only source CI
may depend on), or PyTorch's CPU wheel index, which has no CUDA at all."""
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
SERVER_LOCKS = {"pypi": LOCKS["server"], "cpu": IMAGES_DIR / "server.cpu.lock"}
"""The server image's lock per torch source (``lock --torch-source cpu`` writes the second)."""
SERVER_CONTEXT_LOCKS = {"pypi": "requirements.lock", "cpu": "requirements.cpu.lock"}
"""The name each lock has in the server's build context (the Dockerfile's ``lock-*`` stages)."""
CLIENT_IMAGE_REPOSITORY = "embedding-operator.local/e2e-client"

BASE_IMAGE = "embedding-operator.local/debian:bookworm"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
# What the Dockerfiles bind-mount from their context (their .dockerignore allows exactly these).
CONTEXT_ENTRIES = ("requirements.lock", "wheels", "dist")
SERVER_CONTEXT_ENTRIES = (*CONTEXT_ENTRIES, SERVER_CONTEXT_LOCKS["cpu"])


class ImageError(RuntimeError):
    """An image could not be built or loaded; callers must fail, never skip."""


class ImportFailed(ImageError):
    """`ctr images import` itself failed on a stream `docker save` wrote whole: the store
    refused it. Seen once in CI on a store kept in the cache: "failed to prepare extraction
    snapshot ...: parent snapshot ... does not exist" (containerd's database and the
    snapshotter's disagreed about a layer the new image shares with an older one)."""


@dataclass(frozen=True)
class ImageSet:
    """The image references a node needs, as `docker build -t` tagged them."""

    base: str
    pause: str
    server: str
    operator: str
    # The e2e tier's client pods: the server image plus the official `openai` package.
    client: str
    # Seconds per step of the build that produced this set, and image sizes in bytes (for
    # the log and the CLI).
    timings: Mapping[str, float] = field(default_factory=dict, compare=False)
    sizes: Mapping[str, int] = field(default_factory=dict, compare=False)

    def for_node(self) -> tuple[str, ...]:
        """What a node's containerd needs: the sandbox image and the two workloads."""
        return (self.pause, self.server, self.operator, self.client)

    def workloads(self) -> tuple[str, ...]:
        """What any cluster needs to run the e2e tier's pods: operator, server, e2e client."""
        return (self.operator, self.server, self.client)


def images_cache() -> Path:
    return cache_root() / "images"


def image_refs() -> ImageSet:
    """Repositories from the chart's values.yaml, tags defaulting to its appVersion."""
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text(encoding="utf-8"))
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text(encoding="utf-8"))
    app_version = str(chart["appVersion"])
    operator_tag = values["image"].get("tag") or app_version
    server_tag = values["serverImage"].get("tag") or app_version
    return ImageSet(
        base=BASE_IMAGE,
        pause=PAUSE_IMAGE,
        server=f"{values['serverImage']['repository']}:{server_tag}",
        operator=f"{values['image']['repository']}:{operator_tag}",
        client=f"{CLIENT_IMAGE_REPOSITORY}:{server_tag}",
    )
