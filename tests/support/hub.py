"""A fake Hugging Face Hub over a local directory, recording what a load asks it for.

``snapshot_download`` copies the files its ``allow_patterns`` match (fnmatch over the whole
path, as the Hub's filter does) into one snapshot folder named by a commit;
``get_safetensors_metadata`` answers with the safetensors headers (names, shapes, dtypes)
read from the directory's files, as the Hub reads them with range requests. Each call is
recorded in order, so a test can assert what was downloaded before a refusal.
"""

from __future__ import annotations

import fnmatch
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import huggingface_hub
import pytest
from safetensors import safe_open

COMMIT = "0ddba11" + "0" * 33


@dataclass
class FakeHub:
    """One repository (``repo``) served as every Hub id, and what was asked of it."""

    repo: Path
    snapshot: Path
    calls: list[tuple[str, list[str]]] = field(default_factory=list)
    """``("snapshot", allow_patterns)`` or ``("headers", [])``, in the order asked."""

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)
        monkeypatch.setattr(
            huggingface_hub, "get_safetensors_metadata", self.get_safetensors_metadata
        )
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        return self

    def snapshot_download(self, repo_id: str, **kwargs: Any) -> str:
        patterns = list(kwargs.get("allow_patterns") or ["*"])
        self.calls.append(("snapshot", patterns))
        folder = self.snapshot / "snapshots" / COMMIT
        folder.mkdir(parents=True, exist_ok=True)
        for f in self.repo.rglob("*"):
            rel = f.relative_to(self.repo).as_posix()
            if f.is_file() and any(fnmatch.fnmatch(rel, p) for p in patterns):
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(f, folder / rel)
        return str(folder)

    def get_safetensors_metadata(self, repo_id: str, *, revision: str | None = None) -> Any:
        from huggingface_hub.errors import NotASafetensorsRepoError

        self.calls.append(("headers", []))
        files = {}
        for path in sorted(self.repo.glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                tensors = {
                    name: SimpleNamespace(
                        dtype=str(f.get_slice(name).get_dtype()),
                        shape=list(f.get_slice(name).get_shape()),
                    )
                    for name in f.keys()  # noqa: SIM118
                }
            files[path.name] = SimpleNamespace(tensors=tensors)
        if not files:
            raise NotASafetensorsRepoError(f"{repo_id} has no safetensors weights")
        return SimpleNamespace(files_metadata=files)

    def weights_downloaded(self) -> list[str]:
        """The weight files in the snapshot folder (safetensors, ``.bin``, ``.pt``)."""
        return sorted(
            p.relative_to(self.snapshot).as_posix()
            for p in self.snapshot.rglob("*")
            if p.suffix in (".safetensors", ".bin", ".pt")
        )

    def weight_requests(self) -> list[list[str]]:
        """The snapshot calls that ask for the model's weights (its safetensors or
        ``pytorch_model*.bin``; not the few small files ``inspect`` reads whole, bge-m3's
        head files, which this repository does not have)."""
        return [
            patterns
            for kind, patterns in self.calls
            if kind == "snapshot"
            and any(p.endswith((".safetensors", ".bin")) and "/" not in p for p in patterns)
        ]
