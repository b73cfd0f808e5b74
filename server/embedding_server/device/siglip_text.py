"""The original SigLIP's tokenizer (``SiglipTokenizer``) as a fast (Rust) tokenizer that gives
the token ids transformers' gives.

The google/siglip-* checkpoints ship a sentencepiece ``spiece.model`` and no
``tokenizer.json``, and transformers has only a slow (Python) ``SiglipTokenizer`` for them.
Before the sentencepiece model sees a text, that tokenizer canonicalizes it as big_vision did
in training (``canonicalize_text``):

1. ``▁`` (the word-boundary mark) becomes a space;
2. lowercase, when ``do_lower_case`` (the default), as Python's ``str.lower``;
3. every character of ``string.punctuation`` is removed;
4. each run of whitespace (what ``str.isspace`` says) becomes one space;
5. the ends are stripped.

A fast tokenizer converted from the same ``spiece.model`` does none of that, so "A Cat!" and
"a cat" would get different tokens, and different vectors, than transformers gives them.

Built here: transformers' T5 conversion of ``spiece.model`` (the same Unigram pieces and
scores, the model's own sentencepiece normalization, ``▁`` before each word, ``</s>``
appended), with the five steps put in front of its normalizer as ``tokenizers`` normalizers,
so the text is canonicalized in Rust, inside the tokenizer, as every other model's is
normalized. ``tokenizers`` lowercases char by char, where ``str.lower`` turns a capital sigma
that ends a word into ``ς`` (Unicode's Final_Sigma rule), so a regex does that first.

Differences remain only for a special token typed into a text (``</s>``, ``<unk>``,
``<pad>``): transformers' tokenizer puts no ``▁`` before the word after it, where this one
does, and adds no ``</s>`` after a text that already ends in one (with google's checkpoints,
whose pad token is ``</s>``, that second one is where padding would be anyway). In training,
such a text was plain characters, canonicalized to ``s``, ``unk``, ``pad``.

``tests/server/device/test_siglip_text.py`` compares the canonical text with
``SiglipTokenizer.canonicalize_text`` on random strings and the token ids with
``SiglipTokenizer`` on a corpus.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors

from embedding_server.errors import UnsupportedModelError

TOKENIZER_CLASS = "SiglipTokenizer"
"""``tokenizer_config.json``'s ``tokenizer_class`` of the checkpoints built here."""

SPIECE = "spiece.model"


@functools.cache
def _whitespace() -> str:
    """Every character ``str.isspace`` accepts (computed once, when a SigLIP loads)."""
    return "".join(chr(c) for c in range(0x110000) if chr(c).isspace())


def _char_class(chars: str) -> str:
    """A regex character class of exactly ``chars``, each written as a code point."""
    return "[" + "".join(f"\\x{{{ord(c):x}}}" for c in chars) + "]"


FINAL_SIGMA = r"(?<=\p{Cased}\p{Case_Ignorable}{0,16})\x{3a3}(?!\p{Case_Ignorable}*\p{Cased})"
"""A capital sigma that Python's ``str.lower`` makes final (``ς``): a cased letter before it
and none after it, case-ignorable characters (apostrophes, periods, combining marks) between
skipped. Looking back, at most 16 of them: an unbounded look-behind makes the regex engine
quadratic in the text's length (docs/models.md, "Original SigLIP (v1) tokenizers")."""


def canonicalizer(*, lowercase: bool) -> normalizers.Normalizer:
    """big_vision's ``canonicalize_text`` as transformers' ``SiglipTokenizer`` runs it (with
    the ``▁`` it turns into a space first), as one ``tokenizers`` normalizer."""
    steps: list[normalizers.Normalizer] = [normalizers.Replace("\u2581", " ")]
    if lowercase:
        steps += [normalizers.Replace(Regex(FINAL_SIGMA), "\u03c2"), normalizers.Lowercase()]
    steps += [
        normalizers.Replace(Regex(_char_class(string.punctuation)), ""),
        normalizers.Replace(Regex(_char_class(_whitespace()) + "+"), " "),
        normalizers.Strip(),
    ]
    return normalizers.Sequence(steps)


def siglip_tokenizer(path: Path, config: Mapping[str, Any]) -> tuple[Tokenizer, int | None]:
    """The fast tokenizer of the SigLIP checkpoint at ``path`` whose ``tokenizer_config.json``
    is ``config``, and its ``model_max_length``; refused when it cannot be built exactly."""
    if not (path / SPIECE).is_file():
        raise UnsupportedModelError(
            f"{path}: its tokenizer_config.json names {TOKENIZER_CLASS}, whose tokenization "
            f"is built from {SPIECE}, and there is none"
        )
    import transformers

    # transformers 4 names the fast class T5TokenizerFast; 5 keeps that name as an alias of
    # T5Tokenizer, which is the fast one there.
    t5_fast = getattr(transformers, "T5TokenizerFast", None) or transformers.T5Tokenizer

    def token(key: str, default: str) -> str:
        value = config.get(key, default)
        if isinstance(value, Mapping):  # an AddedToken written out as a dict
            value = value.get("content", default)
        return str(value)

    eos = token("eos_token", "</s>")
    extra = [
        str(t.get("content") if isinstance(t, Mapping) else t)
        for t in config.get("additional_special_tokens") or []
    ]
    try:
        converted = t5_fast.from_pretrained(
            str(path),
            extra_ids=0,
            eos_token=eos,
            unk_token=token("unk_token", "<unk>"),
            pad_token=token("pad_token", "</s>"),
            additional_special_tokens=extra,
        )
    except (ImportError, OSError, ValueError) as exc:
        raise UnsupportedModelError(
            f"cannot build {TOKENIZER_CLASS}'s tokenizer from {path / SPIECE}: {exc}"
        ) from exc
    if not getattr(converted, "is_fast", False):
        raise UnsupportedModelError(
            f"transformers did not convert {path / SPIECE} to a fast tokenizer"
        )
    backend: Tokenizer = converted.backend_tokenizer
    eos_id = backend.token_to_id(eos)
    if eos_id is None:
        raise UnsupportedModelError(f"{path / SPIECE} has no {eos!r} token")
    lowercase = bool(config.get("do_lower_case", True))
    spm = backend.normalizer
    backend.normalizer = normalizers.Sequence(
        [canonicalizer(lowercase=lowercase), *([spm] if spm is not None else [])]
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="always", split=True
    )
    backend.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, eos_id)]
    )
    declared = config.get("model_max_length")
    sane = declared if isinstance(declared, int) and 0 < declared < 10**7 else None
    return backend, sane
