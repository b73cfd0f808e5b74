"""The embedding fingerprint's inputs: each one that decides a vector changes it, and nothing
that only names, places or schedules the model does (issue 47, items 1 and 6).

On tiny checkpoints, loaded by the real engine, so each setting goes through the load path
that serves it; the composition of the hash itself is checked on the resolved info.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from embedding_server.device.configuration import resolve_config
from embedding_server.device.fingerprint import file_digest, fingerprint_inputs, model_files
from embedding_server.device.loading import load_configured
from embedding_server.engine import Engine
from embedding_server.fingerprint import (
    ExpectedFingerprint,
    fingerprint_of,
    is_fingerprint,
)
from embedding_server.settings import EngineSettings, ServerSettings
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.support.models import add_sentence_transformers, build_bert


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer BERT in a sentence-transformers pipeline (mean pooling, normalized) with a
    query prompt."""
    body = build_bert(tmp_path_factory.mktemp("fp") / "bert")
    return add_sentence_transformers(body, pooling="mean", prompts={"query": "query: "})


def _info(model: Path | str, **settings: Any) -> tuple[str, dict[str, Any]]:
    engine = Engine.from_settings(ServerSettings(model=str(model), **settings))
    try:
        info = engine.info()
        return info.fingerprint, info.fingerprint_inputs
    finally:
        engine.close()


def _copy(model: Path, tmp_path: Path, name: str = "copy") -> Path:
    return Path(shutil.copytree(model, tmp_path / name))


def test_the_fingerprint_is_16_hex_digits_of_its_inputs(model: Path) -> None:
    fingerprint, inputs = _info(model, dtype="float32")
    assert is_fingerprint(fingerprint)
    assert fingerprint == fingerprint_of(inputs)
    assert inputs["schema"] == 1
    assert inputs["pooling"] == "mean" and inputs["normalize"] is True
    assert inputs["prompts"]["query"] == "query: "
    assert inputs["dtype"] == "float32"
    # Every file the load reads, by content.
    assert {"config.json", "model.safetensors", "tokenizer.json", "modules.json"} <= set(
        inputs["files"]
    )
    weights = (model / "model.safetensors").read_bytes()
    assert inputs["files"]["model.safetensors"] == hashlib.sha256(weights).hexdigest()


# -- what changes it ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"pooling": "cls"}, "pooling"),
        ({"normalize": False}, "normalize"),
        ({"max_model_len": 16}, "max_input_tokens"),
        ({"default_prompt_name": "query"}, "default_prompt_name"),
        ({"dtype": "bfloat16"}, "dtype"),
        ({"quantization": "int8"}, "quantization"),
        ({"attention": "sdpa_padded"}, "attention"),
        ({"backend": "transformers"}, "backend"),
    ],
)
def test_each_setting_that_changes_vectors_changes_the_fingerprint(
    model: Path, settings: dict[str, Any], field: str
) -> None:
    base, base_inputs = _info(model, dtype="float32")
    other, inputs = _info(model, **{"dtype": "float32", **settings})
    assert inputs[field] != base_inputs[field]
    assert other != base


def test_default_dimensions_change_the_fingerprint(tmp_path: Path, model: Path) -> None:
    matryoshka = _copy(model, tmp_path)
    config = json.loads((matryoshka / "config.json").read_text())
    (matryoshka / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    full, _ = _info(matryoshka, dtype="float32")
    cut, inputs = _info(matryoshka, dtype="float32", dimensions=16)
    assert inputs["dimensions"] == 16
    assert cut != full


def test_other_weights_with_the_same_header_and_size_change_the_fingerprint(
    tmp_path: Path, model: Path
) -> None:
    """A fine-tune has its base's safetensors header and file size byte for byte: the
    fingerprint hashes the weights' content, not their shapes."""
    tuned = _copy(model, tmp_path)
    tensors = load_file(str(tuned / "model.safetensors"))
    name = next(n for n in sorted(tensors) if n.endswith("query.weight"))
    tensors[name] = tensors[name] + 0.01
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        metadata = f.metadata()
    save_file(tensors, str(tuned / "model.safetensors"), metadata=metadata)
    size = (model / "model.safetensors").stat().st_size
    assert (tuned / "model.safetensors").stat().st_size == size
    original, before = _info(model, dtype="float32")
    changed, after = _info(tuned, dtype="float32")
    assert changed != original
    differ = {k for k in before["files"] if before["files"][k] != after["files"][k]}
    assert differ == {"model.safetensors"}


@pytest.mark.parametrize(
    "file",
    ["tokenizer.json", "tokenizer_config.json", "1_Pooling/config.json", "modules.json"],
)
def test_a_changed_tokenizer_or_pipeline_file_changes_the_fingerprint(
    tmp_path: Path, model: Path, file: str
) -> None:
    edited = _copy(model, tmp_path)
    content = json.loads((edited / file).read_text())
    (edited / file).write_text(json.dumps(content, indent=3))  # same meaning, other bytes
    assert _info(edited, dtype="float32")[0] != _info(model, dtype="float32")[0]


def test_a_changed_prompt_changes_the_fingerprint(tmp_path: Path, model: Path) -> None:
    edited = _copy(model, tmp_path)
    path = edited / "config_sentence_transformers.json"
    config = json.loads(path.read_text())
    config["prompts"] = {"query": "Query: "}
    path.write_text(json.dumps(config))
    fingerprint, inputs = _info(edited, dtype="float32")
    assert inputs["prompts"]["query"] == "Query: "
    assert fingerprint != _info(model, dtype="float32")[0]


def test_every_decision_of_the_load_is_hashed(model: Path) -> None:
    """Each resolved value the inputs carry, changed alone, changes the fingerprint (the
    task and head included, which tiny checkpoints of one kind cannot all show)."""
    settings = EngineSettings(model=str(model), dtype="float32")
    cpu = torch.device("cpu")
    loaded = load_configured(settings, device=cpu)
    config = resolve_config(settings, loaded, device=cpu)
    engine = Engine(settings, loaded, device=cpu)
    info = engine.info()
    base = fingerprint_of(fingerprint_inputs(loaded, config, info))
    changes: dict[str, Any] = {
        "task": "score",
        "pooling": "cls",
        "normalize": False,
        "dimensions": 8,
        "max_input_tokens": 7,
        "prompts": {"query": "q: "},
        "default_prompt_name": "query",
        "score_activation": "sigmoid",
        "outputs": ["dense", "sparse"],
        "score_method": "cross_encoder",
        "dtype": "bfloat16",
        "quantization": "int8",
        "attention": "flash_attn",
        "backend": "transformers",
    }
    for name, value in changes.items():
        changed = fingerprint_of(fingerprint_inputs(loaded, config, replace(info, **{name: value})))
        assert changed != base, name
    pooled_prompt = replace(config, include_prompt=not config.include_prompt)
    assert fingerprint_of(fingerprint_inputs(loaded, pooled_prompt, info)) != base
    # What only names, places or schedules the model is not an input.
    for name, value in {
        "model": "renamed",
        "model_path": "/elsewhere",
        "device": "cuda:3",
        "cpu_threads": 64,
        "tensor_parallel_size": 4,
        "max_batch_tokens": 99,
        "max_batch_size": 3,
        "max_queue_tokens": 12345,
        "max_request_tokens": 999,
        "attention_passed_over": ["flash_attn: not installed"],
    }.items():
        same = fingerprint_of(fingerprint_inputs(loaded, config, replace(info, **{name: value})))
        assert same == base, name


# -- what does not change it --------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"served_model_name": "renamed"},
        {"served_model_aliases": ["old-name", "short"]},
        {"port": 9123, "host": "0.0.0.0"},
        {"api_workers": 4},
        {"max_batch_tokens": 512, "max_batch_size": 7, "max_queue_tokens": 4096},
        {"tokenizer_workers": 5},
        {"auto_truncate": True},
    ],
)
def test_names_ports_workers_and_budgets_leave_it_alone(
    model: Path, settings: dict[str, Any]
) -> None:
    assert _info(model, dtype="float32", **settings)[0] == _info(model, dtype="float32")[0]


def test_the_same_files_elsewhere_fingerprint_alike_and_so_do_two_loads(
    tmp_path: Path, model: Path
) -> None:
    first = _info(model, dtype="float32")
    assert _info(model, dtype="float32") == first  # a restart
    assert _info(_copy(model, tmp_path, "moved"), dtype="float32") == first  # another path


def test_a_hub_snapshot_fingerprints_like_a_copy_of_its_files(tmp_path: Path, model: Path) -> None:
    """A Hub cache keeps each file as ``snapshots/<commit>/<name> -> ../../blobs/<sha256>``:
    the LFS id is the sha256 of the bytes, so a snapshot and a plain copy agree."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / ("c" * 40)
    (repo / "blobs").mkdir(parents=True)
    for file in sorted(model.rglob("*")):
        if file.is_dir():
            continue
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        link = snapshot / file.relative_to(model)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    assert _info(snapshot, dtype="float32") == _info(model, dtype="float32")


def test_a_hub_blob_is_not_read(tmp_path: Path) -> None:
    """The blob's name is its digest: nothing is read (a blob named otherwise than its bytes
    would hash proves it)."""
    named = "ab" * 32
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / named).write_bytes(b"not what the name says")
    (tmp_path / "snap").mkdir()
    os.symlink(f"../blobs/{named}", tmp_path / "snap" / "model.safetensors")
    assert file_digest(tmp_path / "snap" / "model.safetensors") == named


def test_a_file_changed_in_place_is_hashed_again(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"a" * 1000)
    first = file_digest(file)
    file.write_bytes(b"b" * 1000)  # same size, same inode
    assert file_digest(file) != first
    assert file_digest(file) == hashlib.sha256(b"b" * 1000).hexdigest()


def test_only_the_files_a_load_reads_count(tmp_path: Path, model: Path) -> None:
    root = _copy(model, tmp_path)
    before = model_files(root)
    (root / "README.md").write_text("# a model card edit")
    (root / ".cache").mkdir()
    (root / ".cache" / "x.json").write_text("{}")
    (root / "modeling_custom.py").write_text("# not run on the native backend")
    torch.save({"w": torch.zeros(1)}, root / "pytorch_model.bin")  # safetensors win
    os.symlink("..", root / "1_Pooling" / "up")  # a loop ends
    assert model_files(root) == before
    assert "modeling_custom.py" in model_files(root, code=True)


def test_the_fake_backend_hashes_its_vector_options_not_its_timing() -> None:
    base = _info("fake?dim=8")[0]
    assert _info("fake?dim=8&delay_ms=5&device_us_per_token=3")[0] == base
    assert _info("fake?dim=16")[0] != base
    assert _info("fake?dim=8&pooling=cls")[0] != base


# -- --expect-fingerprint's value -------------------------------------------------------


def test_expected_inputs_say_which_differ(model: Path) -> None:
    fingerprint, inputs = _info(model, dtype="float32")
    expected = ExpectedFingerprint.parse(json.dumps({**inputs, "dtype": "bfloat16"}))
    message = expected.mismatch(fingerprint, inputs)
    assert message is not None
    assert fingerprint in message and expected.fingerprint in message
    assert 'dtype: "float32", expected "bfloat16"' in message
    assert ExpectedFingerprint.parse(fingerprint).mismatch(fingerprint, inputs) is None
    # A saved /info answer works too; one whose fingerprint contradicts its inputs does not.
    info = {"fingerprint": fingerprint, "fingerprint_inputs": inputs}
    assert ExpectedFingerprint.parse(json.dumps(info)).fingerprint == fingerprint
    with pytest.raises(ValueError, match="hash to"):
        ExpectedFingerprint.parse(json.dumps({**info, "fingerprint": "0" * 16}))
    with pytest.raises(ValueError, match="16 lowercase hex"):
        ExpectedFingerprint.parse("fp-123")
