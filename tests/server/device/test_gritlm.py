"""GritLM (parasail-ai/GritLM-7B-vllm: ``model_type: mistral``, ``architectures: ["GritLM"]``)
is served as its authors embed, and an architecture name a model type does not declare is
refused, naming it, before any weight is read.

The reference is ``tests.support.gritlm.authors_vectors``: transformers' MistralModel with
``is_causal=False`` and no sliding window (the config's window is 4 tokens, shorter than the
texts), mean-pooled after BOS and the instruction, as ``GritLM.encode`` masks them, each
text alone. Our server gets one packed batch of mixed lengths, the instruction inside each
text as vLLM's users send it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from embedding_server.device.inspection import inspect_model
from embedding_server.device.instructions import GRITLM, InstructionSpan
from embedding_server.device.models import ARCHITECTURES, lookup
from embedding_server.device.models.names import KNOWN_NAMES
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError
from embedding_server.settings import EngineSettings
from transformers import AutoModel, AutoTokenizer

from tests.support.attention import assert_rows_close
from tests.support.gritlm import (
    authors_vectors,
    build_gritlm,
    gritlm_instruction,
    gritlm_tokenizer,
)
from tests.support.models import rewrite_checkpoint

F32_COSINE = 0.99999
BF16_COSINE = 0.999

ITEMS = [
    ("Given a question, retrieve passages that answer it", "What is the tallest mountain?"),
    ("", "Mount Everest is Earth's highest mountain above sea level."),
    ("Retrieve the abstract", "Generative representational instruction tuning"),
    ("", "hi"),
    ("Find it", "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3),
    ("", "GritLM unifies text embedding and generation in one model, " * 2),
]
"""(instruction, text): with and without an instruction, 4 to about 160 tokens."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_gritlm(tmp_path_factory.mktemp("gritlm"))


def _texts(items: list[tuple[str, str]]) -> list[str]:
    return [gritlm_instruction(instruction) + text for instruction, text in items]


def test_the_template_is_found_as_vllm_matches_it() -> None:
    """On Mistral's tokenizer shape, the ids derived from the template are the very tokens
    vLLM's GritLM pooler hard-codes."""
    tok = gritlm_tokenizer()
    span = InstructionSpan.of(GRITLM, tok)
    tokens = tok.id_to_token
    assert [tokens(i) for i in span.bos] == ["<s>"]
    assert [tokens(i) for i in span.user] == ["▁<", "|", "user", "|", ">", "<0x0A>"]
    assert [tokens(i) for i in span.embed] == ["▁<", "|", "embed", "|", ">", "<0x0A>"]
    assert [tokens(i) for i in span.separator] == ["<0x0A>", "<", "|", "embed", "|", ">", "<0x0A>"]
    with_instruction = tok.encode(GRITLM.example("Find it", "hello")).ids
    assert span(with_instruction) == len(tok.encode(gritlm_instruction("Find it")).ids)
    assert span(tok.encode(GRITLM.example("", "hello")).ids) == 7  # BOS + <|embed|>\n
    assert span(tok.encode("no template").ids) == 1  # BOS only, as vLLM
    assert span(tok.encode("no template", add_special_tokens=False).ids) == 0


def test_gritlm_is_routed_by_its_architecture_name() -> None:
    arch = lookup({"model_type": "mistral", "architectures": ["GritLM"]})
    assert arch.default_pooling == "mean" and arch.instruction is GRITLM
    # Declared by the architecture, so not reported as a default that may be a guess.
    assert arch.declared_pooling is not None and arch.declared_pooling({}) == "mean"
    assert lookup({"model_type": "mistral", "architectures": ["MistralModel"]}).instruction is None
    with pytest.raises(UnsupportedModelError, match="ambiguous"):
        lookup({"model_type": "mistral", "architectures": ["MistralModel", "GritLM"]})


@pytest.mark.parametrize(
    ("dtype", "min_cosine"), [("float32", F32_COSINE), ("bfloat16", BF16_COSINE)]
)
def test_gritlm_embeds_as_its_authors(
    checkpoints: tuple[Path, Path], dtype: str, min_cosine: float
) -> None:
    gritlm, mistral = checkpoints
    engine = Engine.from_pretrained(str(gritlm), dtype=dtype, normalize=False)
    try:
        assert engine.info().pooling == "mean"
        got = engine.embed(_texts(ITEMS))
    finally:
        engine.close()
    want = authors_vectors(mistral, ITEMS)
    assert_rows_close(got, want, min_cosine=min_cosine)
    if dtype == "float32":
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_token_ids_and_texts_without_the_template_are_pooled_as_vllm(
    checkpoints: tuple[Path, Path],
) -> None:
    """Token-id inputs carry their instruction as texts do; a text without the template is
    pooled over every token but BOS, as vLLM's GritLM pooler does."""
    gritlm, mistral = checkpoints
    tok = AutoTokenizer.from_pretrained(str(mistral))
    plain = ["no template at all here", "short"]
    ids = [tok(text)["input_ids"] for text in _texts(ITEMS[:2])]
    engine = Engine.from_pretrained(str(gritlm), dtype="float32", normalize=False)
    try:
        from_ids = engine.embed(ids)
        from_plain = engine.embed(plain)
    finally:
        engine.close()
    assert_rows_close(from_ids, authors_vectors(mistral, ITEMS[:2]), min_cosine=F32_COSINE)
    model = AutoModel.from_pretrained(str(mistral), attn_implementation="eager").eval()
    model.config.is_causal, model.config.sliding_window = False, None
    with torch.no_grad():
        want = [
            model(input_ids=torch.tensor([tok(text)["input_ids"]]))
            .last_hidden_state[0, 1:]
            .mean(0)
            .numpy()
            for text in plain
        ]
    assert_rows_close(from_plain, want, min_cosine=F32_COSINE)


def _without_weights(src: Path, dst: Path, architectures: list[str]) -> Path:
    """``src`` with another architecture name and no weight file: a refusal that needs no
    weights is the only error it can give."""
    rewrite_checkpoint(src, dst, config={"architectures": architectures})
    (dst / "model.safetensors").unlink()
    return dst


@pytest.mark.parametrize(
    ("architectures", "way_out"),
    [
        (["MistralForFooBar"], "it is not supported yet"),
        (["GritLM", "MistralForFooBar"], "it is not supported yet"),
    ],
)
def test_an_unknown_decoder_architecture_is_refused_before_its_weights(
    checkpoints: tuple[Path, Path], tmp_path: Path, architectures: list[str], way_out: str
) -> None:
    path = _without_weights(checkpoints[1], tmp_path / "foobar", architectures)
    with pytest.raises(UnsupportedModelError) as served:
        Engine.from_pretrained(str(path), dtype="float32")
    with pytest.raises(UnsupportedModelError) as inspected:
        inspect_model(EngineSettings(model=str(path), dtype="float32"))
    for refused in (served, inspected):
        message = str(refused.value)
        assert "'MistralForFooBar'" in message and "model_type 'mistral'" in message
        assert "MistralModel" in message and way_out in message


def test_custom_code_under_an_unknown_name_is_pointed_at_the_generic_backend(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    path = _without_weights(checkpoints[1], tmp_path / "custom", ["MistralForFooBar"])
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_foobar.MistralForFooBar"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="--backend transformers --trust-remote-code"):
        Engine.from_pretrained(str(path), dtype="float32")


@pytest.mark.parametrize(
    ("model_type", "name"),
    [
        ("bert", "BertLMHeadModel"),  # BERT run causally, as a language model
        ("xlm-roberta", "XLMRobertaForCausalLM"),
        ("qwen3", "Qwen3ForFooBar"),
        ("clip", "CLIPForImageClassification"),
    ],
)
def test_an_architecture_its_model_type_does_not_declare_is_refused(
    model_type: str, name: str
) -> None:
    with pytest.raises(UnsupportedModelError, match=f"architecture '{name}'"):
        lookup({"model_type": model_type, "architectures": [name]})


@pytest.mark.parametrize(
    ("architectures", "found"),
    [
        (["GritLM"], "serve it with backend native"),
        (["MistralForFooBar"], "architecture 'MistralForFooBar'"),
    ],
)
def test_the_transformers_backend_refuses_what_it_would_run_as_a_plain_mistral(
    checkpoints: tuple[Path, Path], tmp_path: Path, architectures: list[str], found: str
) -> None:
    """transformers builds a model from its model_type: GritLM there would be a causal,
    windowed Mistral, last-token pooled."""
    path = _without_weights(checkpoints[1], tmp_path / "named", architectures)
    with pytest.raises(UnsupportedModelError, match=found):
        Engine.from_pretrained(str(path), dtype="float32", backend="transformers")


def test_a_text_without_the_template_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    tok = gritlm_tokenizer()
    span = InstructionSpan.of(GRITLM, tok)
    with caplog.at_level("WARNING", logger="embedding_server.device.instructions"):
        span([1] * 16)  # a warm-up batch's sequence
        assert not caplog.records
        span(tok.encode("no template").ids)
        span(tok.encode("nor here").ids)
    assert len(caplog.records) == 1 and "does not start with its embedding template" in (
        caplog.records[0].getMessage()
    )


def test_every_native_model_type_declares_the_architectures_it_serves() -> None:
    """A family added without its names would serve any architecture name unchecked."""
    assert sorted(set(ARCHITECTURES) - set(KNOWN_NAMES)) == []
    # A config without the key is served by its model_type alone (as transformers loads it).
    assert lookup({"model_type": "mistral"}) is ARCHITECTURES["mistral"]
