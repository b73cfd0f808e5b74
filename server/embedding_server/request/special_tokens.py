"""The special tokens a text gets, as the checkpoint's authors computed them.

A fast tokenizer's ``tokenizer.json`` carries a post-processor that adds the special tokens
(``<s> $A``, ``[CLS] $A [SEP]``, ...), and that is what this server runs. For most checkpoints it
is also what their authors ran. Two kinds of checkpoint got other tokens:

* **Switches in tokenizer_config.json.** transformers 4's Llama-family fast tokenizers rebuilt
  the template from ``add_bos_token``/``add_eos_token`` at load (``bos? $A eos?``, pairs
  ``bos? $A eos? bos? $B eos?``), whatever ``tokenizer.json`` said. transformers 5 drops both
  switches whenever a ``tokenizer.json`` exists. e5-mistral-7b-instruct says
  ``add_eos_token: true`` and its model card pools the ``</s>`` that adds; a ``tokenizer.json``
  template of ``<s> $A`` would pool a content token instead. Where a declared switch disagrees
  with the template, the template is rebuilt from the switches, as transformers 4 did. A
  switch the config leaves out keeps what ``tokenizer.json`` does on that side, so nothing the
  checkpoint does not declare changes.
* **Templates added by the checkpoint's own tokenizer code**, which this server never runs
  (gte-Qwen2's ``tokenization_qwen.Qwen2TokenizerFast`` appends ``<|endoftext|>`` when
  ``add_eos_token`` is set; its ``tokenizer.json`` has none). These are declared data,
  :data:`CODE_TEMPLATES`: one row per tokenizer class a checkpoint names in ``auto_map``, with
  the rule its code applies. TEI adds the same template by hand for that family.

Either way the result is a plain ``TemplateProcessing``, so truncation still cuts content and
keeps the special tokens (``tokenization.py``), and :class:`SpecialTokens` records what a text
gets and where it came from, for the load log, ``inspect``, ``/info`` and ``/tokenize``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from tokenizers import Tokenizer, processors

from embedding_server.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

Source = Literal["tokenizer.json", "tokenizer_config.json", "tokenizer code"]

PROBE = "hello world"

SWITCHES = ("add_bos_token", "add_eos_token")

SWITCH_CLASSES = frozenset(
    {
        "LlamaTokenizer",
        "LlamaTokenizerFast",
        "CodeLlamaTokenizer",
        "CodeLlamaTokenizerFast",
        "GemmaTokenizer",
        "GemmaTokenizerFast",
        "CohereTokenizer",
        "CohereTokenizerFast",
    }
)
"""``tokenizer_class`` values whose transformers 4 fast tokenizer rebuilt its template from
``add_bos_token``/``add_eos_token`` (their ``update_post_processor``). Other classes took
``tokenizer.json``'s template as it is, in transformers 4 and 5 alike, so their switches never
changed a token and are not applied here either."""


@dataclass(frozen=True)
class CodeTemplate:
    """A template a checkpoint gets from its own tokenizer code (not run here)."""

    model_type: str
    tokenizer_class: str
    """The fast class ``tokenizer_config.json``'s ``auto_map`` names (``AutoTokenizer``)."""
    defaults: Mapping[str, bool]
    """What the code assumes for each switch the config leaves out; a switch the config
    sets overrides it. The code rebuilds the whole template from them (``bos? $A eos?``)."""
    family: str
    """Who ships this code, for logs and docs."""


CODE_TEMPLATES: tuple[CodeTemplate, ...] = (
    CodeTemplate(
        model_type="qwen2",
        tokenizer_class="tokenization_qwen.Qwen2TokenizerFast",
        defaults={"add_bos_token": False, "add_eos_token": False},
        family="Alibaba-NLP/gte-Qwen2-1.5B/7B-instruct",
    ),
)
"""Checkpoints whose special tokens come only from their own tokenizer code. vLLM (its
``_maybe_fix_gte_tokenizer``) and TEI (a template added for ``qwen2`` with remote code) each
carry exactly this family by hand; no other is known."""


@dataclass(frozen=True)
class SpecialTokens:
    """The special tokens around one text, and where they came from."""

    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    source: Source = "tokenizer.json"
    """``tokenizer.json`` (its post-processor, as it is), ``tokenizer_config.json`` (rebuilt
    from its ``add_bos_token``/``add_eos_token``) or ``tokenizer code`` (a declared template
    of the checkpoint's own tokenizer code, :data:`CODE_TEMPLATES`)."""
    note: str = ""
    """Why the template is not ``tokenizer.json``'s, or why a switch was not applied."""

    @property
    def template(self) -> str:
        """The tokens around a text, ``…`` standing for the text: ``<s> … </s>``."""
        return " ".join([*self.before, "…", *self.after])

    def describe(self) -> str:
        """One line for people: the template and its source (and the note)."""
        text = f"{self.template} (from {self.source}"
        return text + (f": {self.note})" if self.note else ")")


def _auto_map_class(config: Mapping[str, Any]) -> str | None:
    """The fast tokenizer class ``tokenizer_config.json``'s ``auto_map`` names, if any
    (``{"AutoTokenizer": [slow, fast]}``, or the bare list older checkpoints write)."""
    auto_map = config.get("auto_map")
    entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, Mapping) else auto_map
    if isinstance(entry, list | tuple):
        named = [e for e in entry if isinstance(e, str)]
        return named[-1] if named else None
    return entry if isinstance(entry, str) else None


def code_template(
    model_config: Mapping[str, Any], tokenizer_config: Mapping[str, Any]
) -> CodeTemplate | None:
    """The :data:`CODE_TEMPLATES` row a checkpoint declares, if any."""
    named = _auto_map_class(tokenizer_config)
    for row in CODE_TEMPLATES:
        if model_config.get("model_type") == row.model_type and named == row.tokenizer_class:
            return row
    return None


@contextmanager
def _unpadded(tokenizer: Tokenizer) -> Iterator[None]:
    """``tokenizer`` without the padding and truncation its tokenizer.json may switch on
    (MiniLM's pads to 128), put back afterwards: they would bury the probe's template."""
    padding, truncation = tokenizer.padding, tokenizer.truncation
    tokenizer.no_padding()
    tokenizer.no_truncation()
    try:
        yield
    finally:
        if padding is not None:
            tokenizer.enable_padding(**padding)
        if truncation is not None:
            tokenizer.enable_truncation(**truncation)


def affixes(tokenizer: Tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after one text; None when the probe's
    content is not found whole inside its encoding."""
    with _unpadded(tokenizer):
        plain = tokenizer.encode(PROBE, add_special_tokens=False).ids
        full = tokenizer.encode(PROBE, add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return None


def _names(tokenizer: Tokenizer, ids: list[int]) -> tuple[str, ...]:
    return tuple(tokenizer.id_to_token(i) or f"<id {i}>" for i in ids)


def describe_tokens(tokenizer: Tokenizer, source: Source = "tokenizer.json") -> SpecialTokens:
    """What ``tokenizer``'s post-processor adds to one text, as it is."""
    found = affixes(tokenizer)
    if found is None:
        return SpecialTokens(source=source, note="its template could not be located")
    return SpecialTokens(_names(tokenizer, found[0]), _names(tokenizer, found[1]), source)


def _switch(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _token_id(tokenizer: Tokenizer, token: str | None, switch: str) -> int:
    token_id = tokenizer.token_to_id(token) if token else None
    if token_id is None:
        raise UnsupportedModelError(
            f"tokenizer_config.json sets {switch} but its "
            f"{switch.removeprefix('add_').removesuffix('_token')} token "
            f"{token!r} is not in the vocabulary; the checkpoint's special tokens cannot be "
            "computed as its authors did"
        )
    return token_id


def _template(
    tokenizer: Tokenizer, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """``bos? $A eos?`` and ``bos? $A eos? bos? $B eos?``, as transformers 4's Llama-family
    ``update_post_processor`` and gte-Qwen2's code build them."""
    specials: list[tuple[str, int]] = []
    first, second = ["$A:0"], ["$B:1"]
    if add_bos:
        assert bos is not None
        specials.append((bos, _token_id(tokenizer, bos, "add_bos_token")))
        first.insert(0, f"{bos}:0")
        second.insert(0, f"{bos}:1")
    if add_eos:
        assert eos is not None
        if eos != bos or not add_bos:
            specials.append((eos, _token_id(tokenizer, eos, "add_eos_token")))
        first.append(f"{eos}:0")
        second.append(f"{eos}:1")
    return processors.TemplateProcessing(single=first, pair=first + second, special_tokens=specials)


def apply_template(
    tokenizer: Tokenizer,
    *,
    tokenizer_config: Mapping[str, Any],
    model_config: Mapping[str, Any],
    bos_token: str | None,
    eos_token: str | None,
) -> SpecialTokens:
    """Give ``tokenizer`` the special tokens its checkpoint's authors computed (see the
    module docstring), in place, and say which it gets and why. ``bos_token``/``eos_token``:
    the tokenizer's, as transformers resolves them from the checkpoint's files."""
    row = code_template(model_config, tokenizer_config)
    declared = {s: _switch(tokenizer_config.get(s)) for s in SWITCHES}
    if row is None and all(v is None for v in declared.values()):
        return describe_tokens(tokenizer)
    tokenizer_class = str(tokenizer_config.get("tokenizer_class") or "")
    honoured = row is not None or tokenizer_class in SWITCH_CLASSES
    current = affixes(tokenizer)
    if current is None:
        if not honoured:
            return describe_tokens(tokenizer)
        raise UnsupportedModelError(
            "the tokenizer's special-token template could not be located, so it cannot be "
            "checked against the add_bos_token/add_eos_token of its tokenizer_config.json"
        )
    before, after = current
    as_is = SpecialTokens(_names(tokenizer, before), _names(tokenizer, after))
    tokens = {"add_bos_token": bos_token, "add_eos_token": eos_token}
    ids = {s: tokenizer.token_to_id(t) if t else None for s, t in tokens.items()}
    present = {
        "add_bos_token": before == [ids["add_bos_token"]],
        "add_eos_token": after == [ids["add_eos_token"]],
    }
    source: Source
    if row is not None:
        flags = {s: row.defaults[s] if declared[s] is None else bool(declared[s]) for s in SWITCHES}
        source, why = "tokenizer code", f"{row.tokenizer_class} ({row.family}), not run here"
    else:
        # A switch left out keeps tokenizer.json's side: only what is declared changes.
        flags = {s: present[s] if declared[s] is None else bool(declared[s]) for s in SWITCHES}
        source = "tokenizer_config.json"
        why = ", ".join(f"{k}: {str(v).lower()}" for k, v in declared.items() if v is not None)
    want_before = [ids["add_bos_token"]] if flags["add_bos_token"] else []
    want_after = [ids["add_eos_token"]] if flags["add_eos_token"] else []
    if (before, after) == (want_before, want_after):
        return as_is
    if not honoured:
        note = (
            f"tokenizer_config.json sets {why}, which its tokenizer class "
            f"{tokenizer_class or '(none)'} never applied; tokenizer.json's template is used"
        )
        logger.warning("special tokens: %s", note)
        return SpecialTokens(as_is.before, as_is.after, note=note)
    for switch, wanted in flags.items():
        if wanted and tokens[switch] is None:
            raise UnsupportedModelError(
                f"{source} asks for {switch} but the tokenizer names no such token; the "
                "checkpoint's special tokens cannot be computed as its authors did"
            )
    tokenizer.post_processor = _template(
        tokenizer, bos_token, eos_token, flags["add_bos_token"], flags["add_eos_token"]
    )
    got = describe_tokens(tokenizer, source)
    note = f"{why}; tokenizer.json alone gives {as_is.template}"
    logger.info("special tokens: %s, rebuilt from %s (%s)", got.template, source, note)
    return SpecialTokens(got.before, got.after, source, note)
