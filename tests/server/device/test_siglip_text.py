"""The original SigLIP's tokenizer (``device/siglip_text.py``) against transformers' own
``SiglipTokenizer``, which canonicalizes each text in Python (lowercase, punctuation removed,
whitespace collapsed) before its sentencepiece model.

A google/siglip-* layout (``spiece.model``, no ``tokenizer.json``, ``SiglipTokenizer`` named
in ``tokenizer_config.json``) is built with a tiny sentencepiece model trained here. Checked:
the canonical text equals ``canonicalize_text`` on random strings (Greek final sigma, every
kind of whitespace and punctuation); the token ids equal ``SiglipTokenizer``'s on a corpus;
and the served text vectors, from the runner and through the offline engine (truncation
included), equal ``get_text_features`` on ``SiglipTokenizer``'s ids padded to ``max_length``,
for texts whose case and punctuation a plain conversion would keep.
"""

from __future__ import annotations

import random
import string
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from embedding_server.device.siglip_text import canonicalizer
from embedding_server.device.tokenizer_files import load_tokenizer
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.sequences import SequenceInput
from transformers import SiglipModel
from transformers.models.siglip.tokenization_siglip import SiglipTokenizer

from tests.support.vision import build_siglip_spm, cosines, serve

pytestmark = pytest.mark.timeout(300)

CORPUS = [
    "a photo of a cat",
    "A Photo of a CAT!",
    "Two dogs, playing in the snow.",
    "  the   quick\tbrown\nfox  ",
    "it's 5 o'clock: (really) [sic] {x} <y> @home #tag $9 100% a&b *~^|\\/`",
    "e-mail vs. email; done?!",
    "PEOPLE WALKING IN A PARK",
    "\u00a0non\u2003breaking\u3000spaces\u2029",
    "an\u2581image\u2581of a car",
    "\u2581leading mark",
    "ΟΔΟΣ ΣΑΣ Σ ΑΣ' ÁΣ",
    "İstanbul ß ﬁ ① Ⅻ café",
    "",
    " ",
    "!!!",
    "...a...",
]


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_siglip_spm(tmp_path_factory.mktemp("siglip-spm") / "tiny-siglip")


@pytest.fixture(scope="module")
def slow(siglip_dir: Path) -> SiglipTokenizer:
    return SiglipTokenizer.from_pretrained(str(siglip_dir))


def test_the_canonical_text_is_transformers_canonicalize_text(slow: SiglipTokenizer) -> None:
    rng = random.Random(7)
    whitespace = [chr(c) for c in range(0x3001) if chr(c).isspace()]
    alphabet = [
        *"abcXYZ ",
        *string.punctuation,
        *whitespace,
        *"ΣσςΟΔÁİıß\u2581ﬁ①Ⅻ\u0301\u00ad",
    ]
    texts = CORPUS + [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))) for _ in range(5000)
    ]
    for lowercase in (True, False):
        slow.do_lower_case = lowercase
        ours = canonicalizer(lowercase=lowercase)
        try:
            for text in texts:
                expected = slow.canonicalize_text(text.replace("\u2581", " "))
                assert ours.normalize_str(text) == expected, (text, lowercase)
        finally:
            slow.do_lower_case = True


def test_token_ids_are_siglip_tokenizers(siglip_dir: Path, slow: SiglipTokenizer) -> None:
    tokenizer, max_length = load_tokenizer(siglip_dir)
    assert max_length == 24
    for text in CORPUS:
        assert tokenizer.encode(text).ids == slow(text).input_ids, text
    # What the canonicalization is for: a plain conversion of the same spiece.model keeps the
    # case and the punctuation, and gives other tokens.
    plain = transformers.T5TokenizerFast.from_pretrained(str(siglip_dir), extra_ids=0)
    assert plain("A Photo of a CAT!").input_ids != slow("A Photo of a CAT!").input_ids


def test_served_text_vectors_are_transformers(siglip_dir: Path, slow: SiglipTokenizer) -> None:
    loaded, runner = serve(siglip_dir)
    texts = ["A Photo of a CAT!", "a photo of a cat", "Two dogs, playing in the snow."]
    ids = [loaded.tokenizer.encode(t).ids for t in texts]
    assert ids[0] == ids[1]  # case and punctuation do not count, as in training
    served = runner.run([SequenceInput(i) for i in ids]).pooled
    model = SiglipModel.from_pretrained(str(siglip_dir)).eval()
    batch = slow(texts, padding="max_length", max_length=24, return_tensors="pt")
    with torch.no_grad():
        expected = model.get_text_features(input_ids=batch["input_ids"]).pooler_output.numpy()
    assert served.shape == expected.shape
    assert cosines(served, expected).min() >= 0.99999
    np.testing.assert_allclose(served[0], served[1], rtol=0, atol=0)


def test_the_engine_embeds_texts_as_transformers(siglip_dir: Path, slow: SiglipTokenizer) -> None:
    """Through the offline API, as a user calls it (the engine's own tokenization stage,
    truncation included): a text longer than the tower's 24 tokens is cut to them, as
    ``SiglipTokenizer(truncation=True)`` cuts it, ``</s>`` kept last."""
    from embedding_server.engine import Engine

    engine = Engine.from_pretrained(str(siglip_dir), dtype="float32", normalize=False)
    texts = ["A Photo of a CAT!", "people walking, in a PARK...", "the quick brown fox " * 6]
    served = engine.embed(texts, truncate=True)
    model = SiglipModel.from_pretrained(str(siglip_dir)).eval()
    batch = slow(texts, padding="max_length", truncation=True, max_length=24, return_tensors="pt")
    assert int(batch["input_ids"][2, -1]) == 1  # the long text: cut, then </s>
    with torch.no_grad():
        expected = model.get_text_features(input_ids=batch["input_ids"]).pooler_output.numpy()
    assert cosines(served, expected).min() >= 0.99999


def test_a_siglip_checkpoint_without_its_sentencepiece_model_is_refused(
    siglip_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "no-spiece"
    broken.mkdir()
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (broken / name).write_bytes((siglip_dir / name).read_bytes())
    with pytest.raises(UnsupportedModelError, match=r"SiglipTokenizer.*spiece\.model"):
        load_tokenizer(broken)
