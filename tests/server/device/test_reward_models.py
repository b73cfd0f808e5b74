"""Qwen2's dedicated reward models: Qwen2.5-Math-RM (``Qwen2ForRewardModel``) and
Qwen2.5-Math-PRM (``Qwen2ForProcessRewardModel``), on task reward.

Their authors' modeling_qwen2_rm.py (custom code) is transformers' Qwen2Model under
``score = Sequential(Linear(h, h), ReLU, Linear(h, n))`` at every token. So the reference is
transformers' own Qwen2Model on each sequence alone, then that head in torch: the outcome
model's raw outputs at every token (the last one is the reward its forward pass returns),
and the process model's softmax at each ``<extra_0>``, as the model card's
``make_step_rewards`` reads it (column 1: the step is right). A tiny Qwen2 saved by
transformers is rewritten into the Hub's layout (``model.`` prefix, ``score.0`` /
``score.2``, the architecture name and ``auto_map``) and served from one packed batch of
mixed lengths.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError, UnsupportedModelError
from embedding_server.settings import ServerSettings
from transformers import AutoModel

from tests.support.api import running_server
from tests.support.device_cases import assert_rewards_match
from tests.support.models import build_decoder, rewrite_checkpoint

STEP = "<extra_0>"
HIDDEN = 32
TEXTS = [
    "1 + 1 = 2",
    "Let x be the number of apples. Then 3x + 4 = 19, so x = 5, and the answer is 5.",
    "no",
    "tokens " * 20,
]
STEPPED = [
    f"Step one: 2 + 2 = 4{STEP}",
    f"a{STEP}b is longer than a{STEP}and the last step, longest of the three{STEP}",
    "a solution without any step separator",
    f"{STEP}",
]


def _head(outputs: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "score.0.weight": torch.randn(HIDDEN, HIDDEN, generator=gen) * 0.3,
        "score.0.bias": torch.randn(HIDDEN, generator=gen) * 0.1,
        "score.2.weight": torch.randn(outputs, HIDDEN, generator=gen) * 0.3,
        "score.2.bias": torch.randn(outputs, generator=gen) * 0.1,
    }


def _hub(base: Path, dst: Path, architecture: str, outputs: int, **config: object) -> Path:
    return rewrite_checkpoint(
        base,
        dst,
        rename=lambda name: name if name.startswith("model.") else "model." + name,
        add=_head(outputs, seed=outputs),
        config={
            "architectures": [architecture],
            "auto_map": {
                "AutoConfig": "configuration_qwen2_rm.Qwen2RMConfig",
                "AutoModel": f"modeling_qwen2_rm.{architecture}",
            },
            **config,
        },
    )


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_decoder(
        tmp_path_factory.mktemp("reward") / "qwen2", "qwen2", extra_specials=[STEP]
    )


@pytest.fixture(scope="module")
def rm(qwen2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _hub(qwen2, tmp_path_factory.mktemp("reward") / "rm", "Qwen2ForRewardModel", 1)


@pytest.fixture(scope="module")
def prm(qwen2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # num_labels as a config that predates the head would have it: the head's width wins.
    return _hub(
        qwen2,
        tmp_path_factory.mktemp("reward") / "prm",
        "Qwen2ForProcessRewardModel",
        2,
        num_labels=7,
    )


def _reference(
    qwen2: Path, hub: Path, seqs: list[list[int]], dtype: torch.dtype
) -> list[np.ndarray]:
    """The authors' computation: Qwen2Model, then the score MLP at every token (raw)."""
    from safetensors.torch import load_file

    head = {k: v for k, v in load_file(str(hub / "model.safetensors")).items() if "score" in k}
    model = AutoModel.from_pretrained(str(qwen2), dtype=dtype).eval()
    out = []
    with torch.no_grad():
        for seq in seqs:
            states = model(input_ids=torch.tensor([seq])).last_hidden_state[0]
            h = F.relu(
                F.linear(states, head["score.0.weight"].to(dtype), head["score.0.bias"].to(dtype))
            )
            logits = F.linear(h, head["score.2.weight"].to(dtype), head["score.2.bias"].to(dtype))
            out.append(logits.float().numpy())
    return out


@pytest.mark.parametrize(("dtype", "cosine"), [("float32", 0.99999), ("bfloat16", 0.999)])
def test_outcome_reward_is_the_head_at_every_token(
    qwen2: Path, rm: Path, dtype: str, cosine: float
) -> None:
    engine = Engine.from_pretrained(str(rm), dtype=dtype)
    info = engine.info()
    assert (info.backend, info.task, info.labels) == ("native", "reward", ["LABEL_0"])
    seqs = engine.tokenize(TEXTS)
    assert len({len(s) for s in seqs}) == len(seqs)
    want = _reference(qwen2, rm, seqs, getattr(torch, dtype))
    got = engine.reward(TEXTS)
    assert_rewards_match(seqs, got, want, cosine, dtype)
    if dtype == "float32":
        for g, w in zip(got, want, strict=True):
            assert abs(g[-1, 0] - w[-1, 0]) <= 1e-4  # the reward the model card prints


@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_process_reward_is_the_softmax_at_each_step(
    qwen2: Path, prm: Path, dtype: str, atol: float
) -> None:
    engine = Engine.from_pretrained(str(prm), dtype=dtype)
    info = engine.info()
    assert (info.task, info.labels) == ("reward", ["LABEL_0", "LABEL_1"])
    seqs = engine.tokenize(STEPPED)
    step = engine.tokenize(STEP, add_special_tokens=False)[0]
    assert len(step) == 1
    logits = _reference(qwen2, prm, seqs, getattr(torch, dtype))
    got = engine.reward(STEPPED)
    for seq, g, raw in zip(seqs, got, logits, strict=True):
        at = np.asarray(seq) == step[0]
        want = torch.softmax(torch.from_numpy(raw[at]).double(), -1).numpy()
        assert g.shape == (int(at.sum()), 2)
        np.testing.assert_allclose(g, want, atol=atol)
    assert [g.shape[0] for g in got] == [1, 3, 0, 1]
    # The model card's step rewards: P(right) at each separator, in order.
    assert np.all((got[1][:, 1] > 0) & (got[1][:, 1] < 1))


def test_reward_models_refuse_other_tasks(rm: Path, prm: Path) -> None:
    for path in (rm, prm):
        for task in ("score", "classify", "embed"):
            with pytest.raises(UnsupportedModelError, match="served by task reward"):
                Engine.from_pretrained(str(path), dtype="float32", task=task)
    engine = Engine.from_pretrained(str(rm), dtype="float32")
    with pytest.raises(InvalidRequestError, match="task is reward"):
        engine.score("a", "b")


def test_a_head_of_the_wrong_width_is_refused(qwen2: Path, tmp_path: Path) -> None:
    """vLLM and the authors' code fix the outputs (1, 2) whatever num_labels says: a
    checkpoint whose head disagrees is not the model it names."""
    path = _hub(qwen2, tmp_path / "rm2", "Qwen2ForRewardModel", 2)
    with pytest.raises(UnsupportedModelError, match="reward head has 2 output"):
        Engine.from_pretrained(str(path), dtype="float32")


def test_a_process_reward_model_needs_its_step_token(tmp_path: Path) -> None:
    plain = build_decoder(tmp_path / "plain", "qwen2")
    path = _hub(plain, tmp_path / "prm", "Qwen2ForProcessRewardModel", 2)
    with pytest.raises(UnsupportedModelError, match="no token '<extra_0>'"):
        Engine.from_pretrained(str(path), dtype="float32")


def test_unknown_reward_families_are_refused_before_weights(rm: Path, tmp_path: Path) -> None:
    path = rewrite_checkpoint(
        rm,
        tmp_path / "llama-rm",
        config={"model_type": "llama", "architectures": ["LlamaForRewardModel"]},
    )
    (path / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match="reward models of model_type 'llama'"):
        Engine.from_pretrained(str(path), dtype="float32")


def test_process_rewards_over_http(prm: Path) -> None:
    """/pooling task reward: one row per step, none for a text without a step."""
    want = Engine.from_pretrained(str(prm), dtype="float32").reward(STEPPED)
    with running_server(ServerSettings(model=str(prm), dtype="float32")) as server:
        response = httpx.post(
            server.url + "/pooling", json={"input": STEPPED, "task": "reward"}, timeout=60
        )
        assert response.status_code == 200, response.text
        rows = [np.asarray(item["data"], dtype=np.float32) for item in response.json()["data"]]
    assert [len(r) for r in rows] == [1, 3, 0, 1]
    for got, expected in zip(rows, want, strict=True):
        if len(expected):
            np.testing.assert_allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("trust", [False, True])
def test_a_reward_model_without_a_native_body_is_refused_before_its_code_or_weights(
    rm: Path, tmp_path: Path, trust: bool
) -> None:
    """A reward architecture whose model type has no native body: the transformers backend
    (its custom code) serves no reward model, so it is refused, not run as an embedder,
    and not sent to --trust-remote-code first."""
    path = rewrite_checkpoint(
        rm,
        tmp_path / "neox",
        config={
            "model_type": "gpt_neox",
            "architectures": ["GPTNeoXForRewardModel"],
            "auto_map": {"AutoModel": "modeling_rm.GPTNeoXForRewardModel"},
        },
    )
    (path / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match="no native reward model"):
        Engine.from_pretrained(str(path), dtype="float32", trust_remote_code=trust)


def test_the_transformers_backend_refuses_reward_models(rm: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="backend native"):
        Engine.from_pretrained(
            str(rm), dtype="float32", backend="transformers", trust_remote_code=True
        )
