"""Special tokens as the checkpoints' authors compute them, checked against their own code.

* e5-mistral-7b-instruct's shape: ``tokenizer.json`` adds ``<s>`` only, ``tokenizer_config.json``
  says ``add_eos_token: true``. The reference is the model card's code: tokenize with
  ``max_length - 1`` and truncation, append ``eos_token_id``, run transformers' model, pool
  the last token (its ``last_token_pool``).
* gte-Qwen2's shape: ``<|endoftext|>`` comes from its own ``tokenization_qwen.py``. The
  reference tokenizes with that code (``trust_remote_code``, here only), given the
  ``add_eos_token`` its config declares as transformers 4 gave it, then runs transformers'
  Qwen2 bidirectionally and pools the last token, as its sentence-transformers files say.
* A Llama-family config whose switches agree with its template: nothing changes.

Each compares what is served, over the offline engine and over HTTP, on one packed batch of
mixed lengths: float32 cosine >= 0.99999, bfloat16 >= 0.999.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from embedding_server.cli import main
from embedding_server.device.tokenizer_files import read_tokenizer
from embedding_server.engine import Engine
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.special_tokens import apply_template, describe_tokens
from embedding_server.request.tokenization import TextTokenizer
from embedding_server.request.truncation import Truncation
from transformers import AutoModel, AutoTokenizer

from tests.support.api import fake_settings, running_server
from tests.support.special_tokens import agreeing, e5_mistral_shaped, gte_qwen2_shaped

F32_COSINE = 0.99999
BF16_COSINE = 0.999
INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages\nQuery: "
TEXTS = [
    "hi",
    INSTRUCTION + "how much protein should a female eat",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Résumé naïve café — 東京 ok",
    "tokens " * 20,
]


@pytest.fixture(scope="module")
def e5_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return e5_mistral_shaped(tmp_path_factory.mktemp("special") / "e5-mistral")


@pytest.fixture(scope="module")
def gte_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gte_qwen2_shaped(tmp_path_factory.mktemp("special") / "gte-qwen2")


def last_token_pool(states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The model cards' pooling (e5-mistral's and gte-Qwen2's ``last_token_pool``)."""
    left_padding = attention_mask[:, -1].sum() == attention_mask.shape[0]
    if left_padding:
        return states[:, -1]
    lengths = attention_mask.sum(dim=1) - 1
    return states[torch.arange(states.shape[0]), lengths]


def _pooled(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> np.ndarray:
    with torch.no_grad():
        states = model(**batch).last_hidden_state
    return F.normalize(last_token_pool(states, batch["attention_mask"]), p=2, dim=1).numpy()


def e5_mistral_card(path: Path, texts: list[str], max_length: int) -> np.ndarray:
    """intfloat/e5-mistral-7b-instruct's model card, on ``path``."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path), attn_implementation="eager").eval()
    batch_dict = tokenizer(
        texts,
        max_length=max_length - 1,
        return_attention_mask=False,
        padding=False,
        truncation=True,
    )
    batch_dict["input_ids"] = [[*ids, tokenizer.eos_token_id] for ids in batch_dict["input_ids"]]
    batch = tokenizer.pad(batch_dict, padding=True, return_attention_mask=True, return_tensors="pt")
    return _pooled(model, dict(batch))


def gte_qwen2_reference(path: Path, texts: list[str], max_length: int) -> np.ndarray:
    """gte-Qwen2's model card on ``path``: its own tokenizer code, the bidirectional body,
    the last token. transformers 5 hands tokenizer_config.json's ``add_eos_token`` to no
    tokenizer class when a tokenizer.json exists, so it is passed as transformers 4 did."""
    declared = json.loads((path / "tokenizer_config.json").read_text())["add_eos_token"]
    tokenizer = AutoTokenizer.from_pretrained(
        str(path), trust_remote_code=True, add_eos_token=declared
    )
    assert type(tokenizer).__module__.endswith("tokenization_qwen")
    model = AutoModel.from_pretrained(str(path), attn_implementation="eager").eval()
    model.config.is_causal = False
    batch = tokenizer(
        texts, max_length=max_length, padding=True, truncation=True, return_tensors="pt"
    )
    return _pooled(
        model, {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    )


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    got = got / np.linalg.norm(got, axis=1, keepdims=True)
    want = want / np.linalg.norm(want, axis=1, keepdims=True)
    return np.sum(got * want, axis=1)


def assert_engine_matches(
    path: Path, reference: Callable[[Path, list[str], int], np.ndarray], dtype: str
) -> Engine:
    engine = Engine.from_pretrained(str(path), dtype=dtype)
    assert len({len(ids) for ids in engine.tokenize(TEXTS)}) == len(TEXTS)  # mixed lengths
    want = reference(path, TEXTS, engine.info().max_input_tokens)
    got = engine.embed(TEXTS)  # one packed batch
    floor = F32_COSINE if dtype == "float32" else BF16_COSINE
    assert cosines(got, want).min() >= floor, cosines(got, want)
    return engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_e5_mistral_pools_the_eos_its_model_card_appends(e5_mistral: Path, dtype: str) -> None:
    engine = assert_engine_matches(e5_mistral, e5_mistral_card, dtype)
    for ids in engine.tokenize(TEXTS):
        assert (ids[0], ids[-1]) == (1, 2)  # <s> ... </s>
    specials = engine.info().special_tokens
    assert (specials.before, specials.after) == (("<s>",), ("</s>",))
    assert specials.source == "tokenizer_config.json"
    assert "add_eos_token: true" in specials.note


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gte_qwen2_pools_the_eos_its_own_tokenizer_code_appends(
    gte_qwen2: Path, dtype: str
) -> None:
    engine = assert_engine_matches(gte_qwen2, gte_qwen2_reference, dtype)
    assert not engine.info().sliding_window and engine.info().pooling == "last"
    for ids in engine.tokenize(TEXTS):
        assert ids[-1] == 0  # <|endoftext|>
    specials = engine.info().special_tokens
    assert (specials.before, specials.after, specials.source) == (
        (),
        ("<|endoftext|>",),
        "tokenizer code",
    )
    assert "tokenization_qwen.Qwen2TokenizerFast" in specials.note


def test_a_config_that_agrees_with_its_template_changes_nothing(tmp_path: Path) -> None:
    path = agreeing(tmp_path / "agreeing")
    loaded = read_tokenizer(path)
    plain = AutoTokenizer.from_pretrained(str(path))
    assert loaded.tokenizer.encode(TEXTS[1]).ids == plain(TEXTS[1]).input_ids
    assert loaded.tokenizer.to_str() == plain.backend_tokenizer.to_str()
    assert loaded.special_tokens.source == "tokenizer.json"
    assert loaded.special_tokens.template == "<s> …"


def test_a_switch_left_out_keeps_the_template_side(tmp_path: Path) -> None:
    """Only add_eos_token declared: the <s> tokenizer.json adds stays."""
    from tests.support.special_tokens import llama_shaped

    path = llama_shaped(tmp_path / "eos-only", add_bos=None, add_eos=True)
    assert read_tokenizer(path).special_tokens.template == "<s> … </s>"


def test_switches_of_a_class_that_never_applied_them_change_nothing(tmp_path: Path) -> None:
    """A tokenizer class outside the Llama family took tokenizer.json as it is in
    transformers 4 and 5 alike; its switch is reported, not applied."""
    path = e5_mistral_shaped(tmp_path / "other-class")
    config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer = read_tokenizer(path).tokenizer
    tokenizer.post_processor = AutoTokenizer.from_pretrained(
        str(path)
    ).backend_tokenizer.post_processor
    specials = apply_template(
        tokenizer,
        tokenizer_config={**config, "tokenizer_class": "PreTrainedTokenizerFast"},
        model_config={"model_type": "mistral"},
        bos_token="<s>",
        eos_token="</s>",
    )
    assert specials.template == "<s> …" and specials.source == "tokenizer.json"
    assert "never applied" in specials.note
    assert describe_tokens(tokenizer).template == "<s> …"


def test_truncation_keeps_the_eos_as_the_card_computes_it(e5_mistral: Path) -> None:
    limit = 12
    long_text = "The quick brown fox jumps over the lazy dog. " * 4
    tokenizer = TextTokenizer(read_tokenizer(e5_mistral).tokenizer, max_length=64)
    (cut,) = tokenizer.encode([long_text], truncation=Truncation(max_tokens=limit))
    card = AutoTokenizer.from_pretrained(str(e5_mistral))
    want = card(long_text, max_length=limit - 1, truncation=True)["input_ids"]
    assert cut.truncated and cut.ids == [*want, card.eos_token_id]
    assert (cut.ids[0], cut.ids[-1], len(cut.ids)) == (1, 2, limit)
    engine = Engine.from_pretrained(str(e5_mistral), dtype="float32")
    texts = [long_text, "short", long_text[7:]]
    got = engine.embed(texts, truncate=Truncation(max_tokens=limit))
    assert cosines(got, e5_mistral_card(e5_mistral, texts, limit)).min() >= F32_COSINE


def test_http_embeddings_and_tokenize_show_the_special_tokens(e5_mistral: Path) -> None:
    settings = fake_settings(str(e5_mistral), dtype="float32")
    want = e5_mistral_card(e5_mistral, TEXTS, 256)
    with running_server(settings) as server:
        response = httpx.post(
            server.url + "/v1/embeddings", json={"input": TEXTS}, timeout=60
        ).json()
        got = np.array([row["embedding"] for row in response["data"]], dtype=np.float32)
        assert cosines(got, want).min() >= F32_COSINE
        tokens = httpx.post(
            server.url + "/tokenize",
            json={"prompt": "hello world", "return_token_strs": True},
            timeout=30,
        ).json()
        assert tokens["token_strs"][0] == "<s>" and tokens["token_strs"][-1] == "</s>"
        assert tokens["special_tokens"]["before"] == ["<s>"]
        assert tokens["special_tokens"]["after"] == ["</s>"]
        assert tokens["special_tokens"]["source"] == "tokenizer_config.json"
        bare = httpx.post(
            server.url + "/tokenize",
            json={"prompt": "hello world", "add_special_tokens": False},
            timeout=30,
        ).json()
        assert bare["tokens"] == tokens["tokens"][1:-1]
        assert bare["special_tokens"]["before"] == bare["special_tokens"]["after"] == []
        info = httpx.get(server.url + "/info", timeout=30).json()
        assert info["special_tokens"]["after"] == ["</s>"]


def _inspect_line(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["inspect", "--dtype", "float32", "--device", "cpu", *args]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("special tokens")]
    assert len(lines) == 1
    return lines[0].removeprefix("special tokens").strip()


def test_inspect_says_which_special_tokens_a_text_gets_and_from_where(
    e5_mistral: Path, gte_qwen2: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _inspect_line(capsys, "--model", str(e5_mistral)).startswith(
        "<s> … </s> (from tokenizer_config.json: add_bos_token: true, add_eos_token: true; "
        "tokenizer.json alone gives <s> …)"
    )
    assert _inspect_line(capsys, "--model", str(gte_qwen2)).startswith(
        "… <|endoftext|> (from tokenizer code: tokenization_qwen.Qwen2TokenizerFast"
    )
    assert _inspect_line(capsys) == "[CLS] … [SEP] (from tokenizer.json)"  # the packaged MiniLM
    assert main(["inspect", "--model", str(e5_mistral), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["special_tokens"]
    assert (shown["before"], shown["after"]) == (["<s>"], ["</s>"])


def test_a_switch_whose_token_the_tokenizer_lacks_refuses_the_load(e5_mistral: Path) -> None:
    config = json.loads((e5_mistral / "tokenizer_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(e5_mistral)).backend_tokenizer
    with pytest.raises(UnsupportedModelError, match="add_eos_token"):
        apply_template(
            tokenizer,
            tokenizer_config=config,
            model_config={"model_type": "mistral"},
            bos_token="<s>",
            eos_token=None,
        )
