"""A Hub download fetches the files a model needs and no code.

A repository can hold anything beside its weights: ``tokenizer.py``, a
``tokenizer/sitecustomize.py``, a compiled ``tokenizer_ext.so``, Python in a Dense module's
folder. None of it is ever needed to serve a model natively, and a file on disk is one
environment variable (``PYTHONPATH``, ``LD_PRELOAD``) away from running at the next start. So
the download patterns name file types (config and tokenizer data, safetensors, a Dense
module's config and weights) and match no ``.py`` or ``.so`` file; the Python files of a
checkpoint with its own code are fetched only when remote code is allowed and used.
"""

from __future__ import annotations

import fnmatch
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from embedding_server.engine import Engine

from tests.support.device_cases import fake_snapshot_download
from tests.support.models import add_sentence_transformers

COMMIT = "feedface" * 5
TEXTS = ["a", "the files a model needs, and nothing else"]
PLANTED = [
    "tokenizer.py",
    "tokenizer/sitecustomize.py",
    "tokenizer_ext.so",
    "tokenizer.cpython-311-x86_64-linux-gnu.so",
    "sitecustomize.py",
    "usercustomize.py",
    "modeling_evil.py",
    "2_Dense/evil.py",
    "1_Pooling/hook.py",
    "tokenizer_config.json.py",
    "libfoo.so.1",
]
"""Code a hostile repository plants beside a servable model."""

Recorded = list[list[str]]


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[Path], tuple[Path, Recorded]]:
    """Serve a local directory as a Hub repository: ``snapshot_download`` copies the files its
    ``allow_patterns`` match (fnmatch over the whole path, as the Hub's filter does) into one
    snapshot folder, and records each call's patterns."""

    def serve(repo: Path) -> tuple[Path, Recorded]:
        calls: Recorded = []
        snapshot = tmp_path / "hub" / "snapshots" / COMMIT

        def record(kwargs: dict[str, Any]) -> None:
            calls.append(list(kwargs.get("allow_patterns") or ["*"]))

        fake_snapshot_download(monkeypatch, repo, snapshot, record, honour_ignore_patterns=True)
        return snapshot, calls

    return serve


def _plant(repo: Path) -> None:
    for name in PLANTED:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text("raise SystemExit('planted code ran')\n")


def test_a_hub_model_downloads_no_python_or_shared_library(
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    hub: Callable[[Path], tuple[Path, Recorded]],
) -> None:
    st = add_sentence_transformers(tiny_model("bert"), pooling="mean", dense_out=24)
    repo = tmp_path / "repo"
    shutil.copytree(st, repo)
    _plant(repo)
    snapshot, calls = hub(repo)

    engine = Engine.from_pretrained("acme/planted", dtype="float32")

    fetched = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    assert not [f for f in fetched if f.endswith(".py") or ".so" in Path(f).suffixes], fetched
    assert "2_Dense/model.safetensors" in fetched and "tokenizer.json" in fetched
    for patterns in calls:  # no pattern asked for could ever match code
        for name in PLANTED:
            assert not any(fnmatch.fnmatch(name, p) for p in patterns), (name, patterns)
    # What was fetched is the whole model: the vectors are the local directory's.
    np.testing.assert_allclose(
        engine.embed(TEXTS),
        Engine.from_pretrained(str(st), dtype="float32").embed(TEXTS),
        atol=1e-6,
    )


def test_bge_m3_head_files_are_fetched_from_the_root_only(
    tmp_path: Path, hub: Callable[[Path], tuple[Path, Recorded]]
) -> None:
    """bge-m3's sparse_linear.pt and colbert_linear.pt come with the weights (and are read
    with weights_only=True, tests/server/device/test_bge_m3.py); other pickles, at the root
    (training state) or in a folder, are never fetched."""
    import torch

    from tests.support.models import build_xlm_roberta

    st = add_sentence_transformers(build_xlm_roberta(tmp_path / "xlmr"), pooling="cls")
    repo = tmp_path / "repo"
    shutil.copytree(st, repo)
    torch.save(torch.nn.Linear(32, 1).state_dict(), repo / "sparse_linear.pt")
    torch.save(torch.nn.Linear(32, 32).state_dict(), repo / "colbert_linear.pt")
    for stray in ("optimizer.pt", "checkpoint-1/colbert_linear.pt", "1_Pooling/sparse_linear.pt"):
        (repo / stray).parent.mkdir(parents=True, exist_ok=True)
        (repo / stray).write_bytes(b"not fetched")
    snapshot, _ = hub(repo)

    engine = Engine.from_pretrained("BAAI/bge-m3-tiny", dtype="float32")

    fetched = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    assert [f for f in fetched if f.endswith(".pt")] == ["colbert_linear.pt", "sparse_linear.pt"]
    assert engine.info().outputs == ["dense", "sparse", "multi_vector"]
