"""Tensor parallelism on CPU: two gloo ranks give the vectors one rank gives.

Every architecture we serve, on a packed batch of mixed lengths, in float32: the real
all-MiniLM-L6-v2 and tiny random models whose head counts make the split real (4 query heads
over 2 ranks; GQA with 2 key/value heads split, and with 1 replicated on both ranks; biases
on the row-parallel projections, added once). Also: sizes that do not divide the heads are
refused naming the numbers, and closing an engine leaves no worker process behind.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from embedding_server.device.distributed import Shard
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError

from tests.support.api import wait_for
from tests.support.device_cases import build_roberta
from tests.support.gte import build_gte
from tests.support.models import (
    MINILM_DIR,
    build_bge_m3,
    build_deberta,
    build_decoder,
    build_modernbert,
    build_mpnet,
    build_xlm_roberta,
    rewrite_checkpoint,
)

TEXTS = [
    "hi",
    "tensor parallel ranks must agree with a single rank, token for token",
    "a",
    "mixed lengths in one packed batch: " + "long " * 40,
    "seven words are in this one here",
]
COSINE = 0.99999


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "xlm-roberta": build_xlm_roberta,
    "roberta": build_roberta,
    "modernbert": lambda p: build_modernbert(p, "modernbert"),
    "modernbert-biases": lambda p: build_modernbert(p, "modernbert-mlm-legacy"),
    # The relative-position bias and DeBERTa's position projections split by heads too.
    "mpnet": build_mpnet,
    "deberta-v3": lambda p: build_deberta(p, "deberta-v3"),
    # GTE: the fused [up; gate] MLP halves split per rank, NTK-scaled rope.
    "gte-new-ntk": lambda p: build_gte(p, "new-ntk"),
    "deberta-v2-conv": lambda p: build_deberta(p, "deberta-v2-conv"),
    "qwen2": lambda p: build_decoder(p, "qwen2"),
    "qwen3": lambda p: build_decoder(p, "qwen3"),
    "llama-biases": lambda p: build_decoder(p, "llama", attention_bias=True, mlp_bias=True),
    "llama-1-kv-head": lambda p: build_decoder(p, "llama", num_key_value_heads=1),
    "mistral": lambda p: build_decoder(p, "mistral"),
    "gemma3_text": lambda p: build_decoder(p, "gemma3_text"),
    # NVIDIA's bidirectional Llama: Llama's split, attention both ways.
    "llama_bidirec": lambda p: rewrite_checkpoint(
        build_decoder(p.with_name(p.name + "-llama"), "llama"),
        p,
        config={"model_type": "llama_bidirec", "architectures": ["LlamaBidirectionalModel"]},
    ),
    # bge-m3's heads on rank 0's gathered token states: embed_tokens are its multi-vectors.
    "bge-m3": build_bge_m3,
    # Soft-capped logits on every rank's heads, sliding and full layers.
    "gemma2": lambda p: build_decoder(
        p, "gemma2", head_dim=16, attn_logit_softcapping=4.0, sliding_window=8
    ),
    # Gemma 1 (bge-reranker-v2-gemma's body): Gemma 2's split without the cap or the window.
    "gemma": lambda p: build_decoder(p, "gemma", head_dim=16),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("tp-models")

    def get(name: str) -> Path:
        if name == "minilm":
            return MINILM_DIR
        target = root / name
        return target if target.is_dir() else BUILDERS[name](target)

    return get


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _token_states(engine: Engine) -> list[np.ndarray]:
    return engine.embed_tokens(TEXTS)


@pytest.mark.parametrize("name", ["minilm", *BUILDERS])
def test_two_ranks_give_the_vectors_of_one(
    name: str, model_dir: Callable[[str], Path], engines: list[Engine]
) -> None:
    path = str(model_dir(name))
    single = Engine.from_pretrained(path, dtype="float32")
    expected_tokens, expected = _token_states(single), single.embed(TEXTS)
    engines.append(Engine.from_pretrained(path, dtype="float32", tensor_parallel_size=2))
    parallel = engines[0]
    assert parallel.tensor_parallel is not None and len(parallel.tensor_parallel.pids) == 1

    got = parallel.embed(TEXTS)
    cosines = (got * expected).sum(1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1)
    )
    assert cosines.min() >= COSINE, cosines
    for want, have in zip(expected_tokens, _token_states(parallel), strict=True):
        assert want.shape == have.shape
        per_token = (want * have).sum(1) / (
            np.linalg.norm(want, axis=1) * np.linalg.norm(have, axis=1)
        )
        assert per_token.min() >= COSINE, per_token


def test_each_rank_holds_half_the_attention_and_mlp(model_dir: Callable[[str], Path]) -> None:
    path = str(model_dir("llama-biases"))
    single = Engine.from_pretrained(path, dtype="float32")
    with Engine.from_pretrained(path, dtype="float32", tensor_parallel_size=2) as parallel:
        whole = single._runner.model.layers[0]  # type: ignore[attr-defined]
        part = parallel._runner.model.model.layers[0]  # type: ignore[attr-defined]
        assert part.qkv_w.shape[0] * 2 == whole.qkv_w.shape[0]
        assert part.o_w.shape[1] * 2 == whole.o_w.shape[1]
        assert part.gate_up_w.shape[0] * 2 == whole.gate_up_w.shape[0]
        assert part.down_w.shape[1] * 2 == whole.down_w.shape[1]
        # Vocab-parallel token embeddings: half the rows each.
        whole_rows = single._runner.model.embed.weight.shape[0]  # type: ignore[attr-defined]
        assert parallel._runner.model.model.embed.weight.shape[0] * 2 == whole_rows  # type: ignore[attr-defined]


@pytest.mark.parametrize(("total", "size"), [(30522, 2), (7, 3), (2, 4), (260, 8)])
def test_vocabulary_rows_are_split_without_gap_or_overlap(total: int, size: int) -> None:
    rows = [Shard(rank, size).chunk(total) for rank in range(size)]
    covered = [i for r in rows for i in range(total)[r]]
    assert covered == list(range(total))


def test_a_size_that_does_not_divide_the_heads_is_refused(
    model_dir: Callable[[str], Path],
) -> None:
    with pytest.raises(UnsupportedModelError, match=r"tensor_parallel_size 3 does not divide .*4"):
        Engine.from_pretrained(str(model_dir("qwen3")), dtype="float32", tensor_parallel_size=3)


def test_closing_the_engine_stops_its_ranks(model_dir: Callable[[str], Path]) -> None:
    with Engine.from_pretrained(str(model_dir("minilm")), tensor_parallel_size=2) as engine:
        assert engine.tensor_parallel is not None
        pids = engine.tensor_parallel.pids
        assert pids and all(_alive(pid) for pid in pids)
        engine.embed(["still works"])
    assert not any(_alive(pid) for pid in pids)


def test_the_batch_plan_crosses_once_per_batch(
    model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One header and one payload broadcast per forward pass, whatever the number of
    sequences in it or of layers in the model (MiniLM has 6)."""
    import threading

    import torch.distributed as dist

    caller = threading.get_ident()
    calls: list[int] = []
    broadcast = dist.broadcast

    def counting(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == caller:  # not the idle heartbeat's
            calls.append(tensor.numel())
        return broadcast(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "broadcast", counting)
    with Engine.from_pretrained(str(model_dir("minilm")), tensor_parallel_size=2) as engine:
        engine.embed(TEXTS)  # one batch of five sequences
        # The header (kind, tokens, sequences, whether task adapters and key lengths
        # follow, and the length of the cached prefixes' part), then the plan.
        assert len(calls) == 2 and calls[0] == 6
        engine.embed(["one more"])
        assert len(calls) == 4


def test_tensor_parallelism_serves_embedders_only_for_now(tmp_path: Path) -> None:
    """A cross-encoder's pairs carry segment ids the ranks' batch broadcast does not: refused
    at load, naming the task."""
    from tests.support.tasks import build_classifier

    path = build_classifier(tmp_path / "bert-cls", "bert", num_labels=1)
    with pytest.raises(UnsupportedModelError, match=r"serves task embed only.*task is"):
        Engine.from_pretrained(str(path), dtype="float32", tensor_parallel_size=2)


def _store_listeners(pid: int) -> list[Any]:
    """The TCP sockets process ``pid`` listens on."""
    import psutil

    return [
        c for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN
    ]


def test_the_store_listens_on_loopback_only_and_ignores_foreign_writes(
    model_dir: Callable[[str], Path],
) -> None:
    """Rank 0's TCPStore is for its own child ranks: it listens on 127.0.0.1 only, and what a
    process that is not one of them writes there (the keys a rank reports its load under,
    bare or under the prefix it reads from the store's key list) neither fails the group nor
    keeps it from forming."""
    from datetime import timedelta

    from embedding_server.device.tensor_parallel import TensorParallelGroup
    from embedding_server.settings import EngineSettings
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    before = {c.laddr.port for c in _store_listeners(os.getpid())}
    settings = EngineSettings(
        model=str(model_dir("minilm")), dtype="float32", tensor_parallel_size=2
    )
    group = TensorParallelGroup(settings, torch.device("cpu"))
    try:
        (store,) = [c for c in _store_listeners(os.getpid()) if c.laddr.port not in before]
        assert store.laddr.ip == "127.0.0.1", store  # not "::" or "0.0.0.0"
        foreign = TCPStore(
            "127.0.0.1", store.laddr.port, is_master=False, timeout=timedelta(seconds=10)
        )
        foreign.set("tp/1/error", "forged by a process that is not a rank")
        # A process in the pod can list the keys, and so learn any prefix: once rank 1 has
        # reported its load, forge its failure next to it.
        loaded: list[str] = []

        def rank_1_loaded() -> bool:
            loaded[:] = [k for k in foreign.list_keys() if k.endswith("tp/1/loaded")]
            return bool(loaded)

        wait_for(rank_1_loaded, timeout=120, what="rank 1 to report its load")
        for key in loaded:
            foreign.set(key.replace("/loaded", "/error"), "forged next to the real key")
        group.join()  # formed: the forged failure was not believed
        assert group.failure is None
    finally:
        group.close()
