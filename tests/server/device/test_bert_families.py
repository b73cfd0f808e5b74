"""The model types that share BERT's math under other names, against transformers: CamemBERT,
DistilBERT, ERNIE, ELECTRA, and XLM-R checkpoints with jina-reranker-v2's flash-attention
weight names.

Each tiny random checkpoint (``tests.support.bert_families``: DistilBERT with its own config
keys and a sinusoidal position table, ERNIE with task-type embeddings, ELECTRA with
embeddings narrower than its layers) runs as ONE packed batch of mixed lengths, up to the
longest input its position table allows; every token state, and every head's output, must
match transformers running each input alone: cosine >= 0.99999 in float32 (and 2e-5
absolute), >= 0.999 in bfloat16. Then the heads: sequence classifiers through their raw
logits and the classify task, cross-encoders on pairs (segment ids included), token
classifiers, SPLADE over the masked-LM heads; and two tensor-parallel ranks.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from embedding_server.device import loading
from embedding_server.device.models import ARCHITECTURES, lookup
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError
from safetensors import safe_open
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from tests.support import device_cases as cases
from tests.support.bert_families import FAMILIES, Kind, build_family, build_flash_xlm_roberta
from tests.support.device_cases import assert_matches, cosines

pytestmark = pytest.mark.timeout(300)


FLASH = "xlm-roberta-flash"
"""An ``xlm-roberta`` checkpoint saved under jina-reranker-v2's flash-attention names."""

_AUTO = {
    "body": AutoModel,
    "sequence": AutoModelForSequenceClassification,
    "token": AutoModelForTokenClassification,
    "masked_lm": AutoModelForMaskedLM,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, Path]]:
    """Factory: (family, kind, num_labels=1) -> (what the engine loads, what transformers
    loads as the reference): the same directory, except for the flash-named XLM-R, whose
    reference is the ``xlm-roberta`` checkpoint it was renamed from."""
    root = tmp_path_factory.mktemp("bert-families")
    cache: dict[tuple[str, Kind, int], tuple[Path, Path]] = {}

    def get(family: str, kind: Kind, num_labels: int = 1) -> tuple[Path, Path]:
        key = (family, kind, num_labels)
        if key not in cache:
            name = f"{family}-{kind}-{num_labels}"
            model_type = "xlm-roberta" if family == FLASH else family
            # DistilBERT's body keeps the sinusoidal table transformers saves for it.
            sinusoidal = family == "distilbert" and kind == "body"
            path = build_family(
                root / name, model_type, kind, num_labels=num_labels, sinusoidal=sinusoidal
            )
            served = (
                build_flash_xlm_roberta(path, root / f"{name}-flash") if family == FLASH else path
            )
            cache[key] = (served, path)
        return cache[key]

    return get


def _reference(path: Path, kind: Kind) -> torch.nn.Module:
    return _AUTO[kind].from_pretrained(str(path), attn_implementation="eager").eval()


def _inputs(
    tokenizer_dir: Path, item: str | tuple[str, str], limit: int
) -> dict[str, torch.Tensor]:
    """What transformers' tokenizer gives for ``item``, cut as the engine cuts it."""
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    parts = item if isinstance(item, tuple) else (item,)
    enc = tok(*parts, return_tensors="pt", truncation=True, max_length=limit)
    return {k: v for k, v in enc.items() if k in ("input_ids", "token_type_ids")}


@pytest.mark.parametrize(("dtype", "min_cosine"), cases.DTYPES)
@pytest.mark.parametrize("family", [*FAMILIES, FLASH])
def test_packed_batch_matches_transformers(
    checkpoint: Callable[..., tuple[Path, Path]], family: str, dtype: str, min_cosine: float
) -> None:
    """Every token state of one packed batch, 1 token up to the longest the position table
    allows, as transformers computes it for each input alone; and the CLS vector pooled."""
    served, reference = checkpoint(family, "body")
    engine = Engine.from_pretrained(str(served), dtype=dtype, normalize=False)
    info = engine.info()
    assert (info.pooling, info.hidden_size) == ("cls", 32)
    limit = info.max_input_tokens
    seqs = [ids[:limit] for ids in engine.tokenize([*cases.TEXTS, "long " * 200])]
    seqs.insert(0, [seqs[0][0]])  # a single token
    assert len(seqs[-1]) == 128  # the last row of every position table is read
    model = _reference(reference, "body")
    with torch.no_grad():
        expected = [model(input_ids=torch.tensor([s])).last_hidden_state[0].numpy() for s in seqs]
    for got, want in zip(engine.embed_tokens(seqs), expected, strict=True):
        assert_matches(got, want, min_cosine)
    assert_matches(engine.embed(seqs), np.stack([s[0] for s in expected]), min_cosine)


@pytest.mark.parametrize(("dtype", "min_cosine"), cases.DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_sequence_classifier_matches_transformers(
    checkpoint: Callable[..., tuple[Path, Path]], family: str, dtype: str, min_cosine: float
) -> None:
    """The family's own head (DistilBERT: pre_classifier + ReLU; ERNIE: its pooler; ELECTRA:
    dense + GELU + out_proj; CamemBERT: RoBERTa's): its raw logits on the first token (task
    reward's first row), and the classify task's probabilities."""
    served, reference = checkpoint(family, "sequence", 3)
    model = _reference(reference, "sequence")
    rewards = Engine.from_pretrained(str(served), dtype=dtype, task="reward")
    limit = rewards.info().max_input_tokens
    with torch.no_grad():
        logits = np.stack(
            [model(**_inputs(reference, text, limit)).logits[0].numpy() for text in cases.TEXTS]
        )
    assert_matches(np.stack([r[0] for r in rewards.reward(cases.TEXTS)]), logits, min_cosine)
    engine = Engine.from_pretrained(str(served), dtype=dtype)
    assert (engine.info().task, engine.info().labels) == (
        "classify",
        ["class_0", "class_1", "class_2"],
    )
    probs = torch.softmax(torch.from_numpy(logits), -1).numpy()
    assert_matches(engine.classify(cases.TEXTS).probs, probs, min_cosine)


@pytest.mark.parametrize("family", [*FAMILIES, FLASH])
def test_cross_encoder_scores_match_transformers(
    checkpoint: Callable[..., tuple[Path, Path]], family: str
) -> None:
    """One label: task score, sigmoid over the logit of each (query, document) pair, the pair
    one sequence (with segment ids where the family has them). For the flash-named XLM-R,
    jina-reranker-v2's layout, against the checkpoint it was renamed from."""
    served, reference = checkpoint(family, "sequence", 1)
    model = _reference(reference, "sequence")
    for dtype, min_cosine in cases.DTYPES:
        engine = Engine.from_pretrained(str(served), dtype=dtype)
        assert (engine.info().task, engine.info().score_activation) == ("score", "sigmoid")
        limit = engine.info().max_input_tokens
        with torch.no_grad():
            logits = np.array(
                [
                    model(**_inputs(reference, pair, limit)).logits[0, 0].item()
                    for pair in zip(cases.QUERIES, cases.DOCS, strict=True)
                ]
            )
        scores = engine.score(cases.QUERIES, cases.DOCS)
        assert_matches(np.log(scores / (1 - scores)), logits, min_cosine)  # the logits, as one row
        if dtype == "float32":
            np.testing.assert_allclose(scores, 1 / (1 + np.exp(-logits)), atol=1e-5)


def test_flash_names_are_what_jina_reranker_v2_ships(
    checkpoint: Callable[..., tuple[Path, Path]],
) -> None:
    """The renamed checkpoint holds none of transformers' layer names: the engine reads the
    flash-attention ones (fused Wqkv, emb_ln, norm1/norm2, mixer, mlp) and the head."""
    served, _ = checkpoint(FLASH, "sequence", 1)
    with safe_open(str(served / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "roberta.encoder.layers.1.mixer.Wqkv.weight" in names
    assert "roberta.emb_ln.weight" in names
    assert not any(".attention." in n or "encoder.layer." in n for n in names)
    assert {"classifier.dense.weight", "classifier.out_proj.weight"} <= names
    config = json.loads((served / "config.json").read_text())
    assert "model_type" not in config  # the Hub's config names only the custom config class
    assert config["auto_map"]["AutoConfig"].endswith("XLMRobertaFlashConfig")


def test_a_bert_checkpoint_under_an_alibi_config_is_refused(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """An ALiBi ``bert`` config is jina-embeddings-v2's (JinaBERT, served natively:
    test_jina_bert.py); plain BERT weights under it (a position table, an ungated MLP) are
    not that model, so they are refused, naming the position type and the MLP it lacks,
    rather than served with the positions dropped."""
    v2 = tmp_path / "jina-v2-shaped"
    shutil.copytree(tiny_model("bert"), v2)
    config = json.loads((v2 / "config.json").read_text())
    config["position_embedding_type"] = "alibi"
    config["feed_forward_type"] = "geglu"
    config["auto_map"] = {
        "AutoModel": "jinaai/jina-bert-implementation--modeling_bert.JinaBertModel"
    }
    (v2 / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="alibi") as error:
        Engine.from_pretrained(str(v2), dtype="float32")
    assert "mlp.gated_layers" in str(error.value)


def test_the_flash_config_class_with_rotary_positions_is_not_served_as_xlm_r(
    checkpoint: Callable[..., tuple[Path, Path]], tmp_path: Path
) -> None:
    """jina-embeddings-v3 shares jina-reranker-v2's config class but adds rotary positions
    (and task LoRA adapters): such a config goes to its own family (test_jina_v3.py), never
    to plain XLM-R, so an XLM-R checkpoint claiming rotary positions is refused for the
    position table that family does not read."""
    served, _ = checkpoint(FLASH, "body")
    v3 = tmp_path / "v3-shaped"
    shutil.copytree(served, v3)
    config = json.loads((v3 / "config.json").read_text())
    config["position_embedding_type"] = "rotary"
    (v3 / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"jina_embeddings_v3.*position_embeddings"):
        Engine.from_pretrained(str(v3), dtype="float32")


@pytest.mark.parametrize("family", FAMILIES)
def test_token_classifier_matches_transformers(
    checkpoint: Callable[..., tuple[Path, Path]], family: str
) -> None:
    """Every token's label probabilities, ``classifier`` on every token's state."""
    served, reference = checkpoint(family, "token", 4)
    model = _reference(reference, "token")
    for dtype, min_cosine in cases.DTYPES:
        engine = Engine.from_pretrained(str(served), dtype=dtype)
        assert engine.info().task == "token_classify"
        limit = engine.info().max_input_tokens
        for text, probs in zip(cases.TEXTS, engine.token_classify(cases.TEXTS), strict=True):
            with torch.no_grad():
                logits = model(**_inputs(reference, text, limit)).logits[0]
            assert_matches(probs, torch.softmax(logits, -1).numpy(), min_cosine)


@pytest.mark.parametrize("family", FAMILIES)
def test_masked_lm_head_serves_splade(
    checkpoint: Callable[..., tuple[Path, Path]], family: str
) -> None:
    """--task sparse on a *ForMaskedLM: log(1 + relu(MLM logits)), max over the tokens, from
    the family's own head (DistilBERT's vocab_transform, ERNIE's cls.predictions, ELECTRA's
    generator, CamemBERT's lm_head), the decoder tied to the word embeddings."""
    served, reference = checkpoint(family, "masked_lm")
    model = _reference(reference, "masked_lm")
    engine = Engine.from_pretrained(str(served), dtype="float32", task="sparse")
    limit, vocab = engine.info().max_input_tokens, engine.info().vocab_size
    for text, vector in zip(cases.TEXTS, engine.sparse_embed(cases.TEXTS), strict=True):
        with torch.no_grad():
            logits = model(**_inputs(reference, text, limit)).logits[0]
        expected = torch.log1p(torch.relu(logits)).amax(0).numpy()
        got = vector.to_dense(vocab)
        assert cosines(got, expected) >= cases.F32_COSINE
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("family", ["distilbert", "electra", FLASH])
def test_two_ranks_give_the_vectors_of_one(
    checkpoint: Callable[..., tuple[Path, Path]], family: str, engines: list[Engine]
) -> None:
    """Tensor parallelism: 2 of the 4 heads and half the MLP on each rank (the flash-named
    Wqkv split per q/k/v block, ELECTRA's projection replicated) give one rank's states."""
    served, _ = checkpoint(family, "body")
    single = Engine.from_pretrained(str(served), dtype="float32")
    engines.append(Engine.from_pretrained(str(served), dtype="float32", tensor_parallel_size=2))
    parallel = engines[0]
    assert parallel.tensor_parallel is not None
    for want, got in zip(
        single.embed_tokens(cases.TEXTS), parallel.embed_tokens(cases.TEXTS), strict=True
    ):
        assert cosines(got, want).min() >= cases.F32_COSINE
    assert cosines(parallel.embed(cases.TEXTS), single.embed(cases.TEXTS)).min() >= cases.F32_COSINE


class _Recording(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors, noting which ones are read."""

    def __init__(self, inner: Mapping[str, torch.Tensor], read: set[str]) -> None:
        self.inner, self.read = inner, read

    def __getitem__(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return self.inner[name]

    def __contains__(self, name: object) -> bool:
        return name in self.inner

    def __iter__(self) -> Iterator[str]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


@pytest.mark.parametrize(
    ("kind", "task"),
    [
        ("body", "auto"),
        ("sequence", "auto"),
        ("token", "auto"),
        ("masked_lm", "auto"),
        ("masked_lm", "sparse"),
        ("pretraining", "auto"),
    ],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_is_read_or_declared_ignored(
    checkpoint: Callable[..., tuple[Path, Path]],
    family: str,
    kind: Kind,
    task: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each checkpoint layout the family publishes (body, classifiers, masked LM as an
    embedder or for SPLADE, the pre-training model: ELECTRA's discriminators): every tensor
    the engine does not read is one its registry entry declares ignored, with a reason; the
    ones it reads are never hidden among them by a pattern too broad (the body's layers)."""
    served, _ = checkpoint(family, kind, 2 if kind in ("sequence", "token") else 1)
    read: set[str] = set()
    load = loading.load_weights
    monkeypatch.setattr(loading, "load_weights", lambda path: _Recording(load(path), read))
    Engine.from_pretrained(str(served), dtype="float32", task=task)
    names = set(load(served))
    patterns = [re.compile(i.pattern) for i in ARCHITECTURES[family].ignored]
    assert all(i.reason for i in ARCHITECTURES[family].ignored)
    unclaimed = [n for n in names - read if not any(p.fullmatch(n) for p in patterns)]
    assert unclaimed == []
    layers = [n for n in read if ".layer." in n]
    assert layers and not any(p.fullmatch(n) for n in layers for p in patterns)


def test_distilbert_config_keys_are_read_as_transformers_reads_them() -> None:
    """DistilBERT's own names give the common keys; beside a common key, its own wins (it is
    what transformers reads: ``hidden_size`` is an alias of ``dim`` there)."""
    config = {"model_type": "distilbert", "dim": 48, "n_heads": 6, "n_layers": 3}
    config |= {"hidden_dim": 96, "intermediate_size": 7, "activation": "relu"}
    read = lookup(config).read_config(config)
    assert (read["hidden_size"], read["num_attention_heads"], read["num_hidden_layers"]) == (
        48,
        6,
        3,
    )
    assert (read["intermediate_size"], read["hidden_act"]) == (96, "relu")
