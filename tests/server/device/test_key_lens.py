"""Each sequence's key length (ColBERT's query augmentation) carried from a
:class:`SequenceInput` to the packed batch: through the runner, across the engine process's
IPC and to tensor-parallel ranks.

The check needs no reference model: in a BERT (absolute positions, no window) a token that
may attend to the first ``k`` keys only sees exactly what it would see were the sequence cut
to those ``k`` tokens, so the first ``k`` token states of a sequence run with ``key_len=k``
equal those of its ``k``-token prefix run alone, in the same batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from embedding_server.device import tensor_parallel
from embedding_server.device.attention import Backend
from embedding_server.device.models import PackedBatch
from embedding_server.engine import Engine
from embedding_server.ipc.messages import decode_sequences, encode_sequences
from embedding_server.request.sequences import SequenceInput

from tests.support.models import build_bert

IDS = [101, 7, 8, 9, 10, 11, 103, 103, 103, 102]
KEYS = 6


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine.from_pretrained(
        str(build_bert(tmp_path_factory.mktemp("keys") / "bert")), dtype="float32"
    )


def test_the_runner_limits_each_sequence_to_its_keys(engine: Engine) -> None:
    out = engine._runner.run(
        [
            SequenceInput(IDS, want_tokens=True, key_len=KEYS),
            SequenceInput(IDS[:KEYS], want_tokens=True),
            SequenceInput(IDS, want_tokens=True),
        ]
    )
    limited, prefix, whole = out.tokens
    assert limited is not None and prefix is not None and whole is not None
    assert limited.shape == whole.shape == (len(IDS), prefix.shape[1])
    np.testing.assert_allclose(limited[:KEYS], prefix, rtol=1e-5, atol=1e-5)
    # Without the limit the same tokens see the [MASK] keys and come out elsewhere.
    assert not np.allclose(whole[:KEYS], prefix, atol=1e-3)


def test_key_lengths_cross_the_engine_process_boundary() -> None:
    seqs = [
        SequenceInput(IDS, key_len=KEYS),
        SequenceInput([101, 102]),
        SequenceInput([101, 5, 102], adapter=1),
    ]
    back = decode_sequences(encode_sequences(seqs), want_tokens=False)
    assert [s.key_len for s in back] == [KEYS, None, None]
    assert [s.adapter for s in back] == [None, None, 1]
    plain = decode_sequences(encode_sequences(seqs[1:]), want_tokens=False)
    assert [s.key_len for s in plain] == [None, None]


@pytest.mark.parametrize("key_lens", [None, (3, 2)])
def test_key_lengths_reach_tensor_parallel_ranks(
    monkeypatch: pytest.MonkeyPatch, key_lens: tuple[int, ...] | None
) -> None:
    """Rank 0's broadcasts replayed into a worker's receive: the batch it rebuilds limits
    the same keys (and builds the same attention plan) as rank 0's."""
    sent: list[torch.Tensor] = []
    monkeypatch.setattr(tensor_parallel.dist, "broadcast", lambda t, src: sent.append(t.clone()))
    cpu = torch.device("cpu")
    batch = PackedBatch.build([[1, 2, 3], [4, 5]], cpu, key_lens=key_lens)
    tensor_parallel._send(tensor_parallel._FORWARD, batch, cpu)

    replay = iter(sent)

    def receive(tensor: torch.Tensor, src: int) -> Any:
        tensor.copy_(next(replay))

    monkeypatch.setattr(tensor_parallel.dist, "broadcast", receive)
    plan = tensor_parallel._receive(cpu, Backend.SDPA_BUCKETED)
    got = plan.batch
    assert plan.kind == tensor_parallel._FORWARD and got is not None
    assert got.seqlens == batch.seqlens
    assert got.key_lens == key_lens
    assert got.input_ids.tolist() == batch.input_ids.tolist()
    want = [t.tolist() for t in batch.attention_plan.tensors()]
    assert [t.tolist() for t in got.attention_plan.tensors()] == want
