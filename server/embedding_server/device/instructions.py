"""Instructions that an embedder's pooling leaves out, found in each sequence's token ids.

GritLM embeds ``<|user|>\\n{instruction}\\n<|embed|>\\n{text}`` (or ``<|embed|>\\n{text}``
with no instruction), its tokenizer's BOS in front, and mean-pools only the tokens of
``{text}``: its authors' ``GritLM.encode`` masks the tokens of BOS plus instruction out of
the mean, and vLLM's GritLM pooler finds the same span by matching the template's token ids
in each prompt. The instruction travels inside the text, as vLLM's users send it, so the span
is found here, from the ids a sequence holds (texts and token-id inputs alike), and handed to
pooling as the count of leading tokens it skips (``device.pooling.pool``'s ``skip``, the
machinery of sentence-transformers' ``include_prompt: false``).

The template's token ids are derived from the checkpoint's own tokenizer, in the contexts
the template puts them (at the start of the text, and after the instruction), rather than
written down for one vocabulary: on GritLM's (Mistral's) tokenizer they are the very
patterns vLLM hard-codes (``▁<|user|>\\n``, ``▁<|embed|>\\n`` and ``\\n<|embed|>\\n``).
A sequence that does not start with the template, after BOS, is pooled over every token
but BOS, as vLLM pools it; one without BOS (``add_special_tokens: false``) over every token.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from embedding_server.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

_PROBE = "x"
"""A text before the separator, so that the separator is tokenized mid-text, as it is after
an instruction (a word-start marker such as ``▁`` goes to the probe, not to the separator)."""


@dataclass(frozen=True)
class InstructionFormat:
    """How a family's texts carry an instruction that pooling leaves out (declared per
    architecture in the registry): ``user`` + instruction + ``separator`` + text, or
    ``embed`` + text without an instruction."""

    name: str
    user: str
    separator: str
    embed: str

    def example(self, instruction: str, text: str) -> str:
        """The text a user sends for ``text`` under ``instruction`` ("" for none)."""
        if instruction:
            return f"{self.user}{instruction}{self.separator}{text}"
        return f"{self.embed}{text}"


GRITLM = InstructionFormat(
    name="GritLM", user="<|user|>\n", separator="\n<|embed|>\n", embed="<|embed|>\n"
)
"""GritLM's embedding prompt (its README's ``gritlm_instruction``, vLLM's gritlm.py)."""


@dataclass
class InstructionSpan:
    """Finds, in a sequence's token ids, how many leading tokens (BOS and instruction) its
    pooling leaves out."""

    format: InstructionFormat
    bos: tuple[int, ...]
    user: tuple[int, ...]
    separator: tuple[int, ...]
    embed: tuple[int, ...]
    _warned: bool = field(default=False, compare=False)

    @classmethod
    def of(cls, fmt: InstructionFormat, tokenizer: Tokenizer) -> InstructionSpan:
        """The spans ``fmt``'s template takes in ``tokenizer``'s ids; refuses a tokenizer
        that adds no BOS (the template is found after it) or that would not tokenize the
        template apart from what surrounds it."""
        bare = tokenizer.encode(_PROBE, add_special_tokens=False).ids
        full = tokenizer.encode(_PROBE, add_special_tokens=True).ids
        bos = tuple(full[: len(full) - len(bare)]) if full[len(full) - len(bare) :] == bare else ()
        if not bos:
            raise UnsupportedModelError(
                f"{fmt.name} pools the tokens after its instruction, which its authors find "
                "after the tokenizer's BOS token, but this checkpoint's tokenizer adds none "
                "in front of a text: its vectors cannot be pooled as the model's"
            )
        after = tokenizer.encode(_PROBE + fmt.separator, add_special_tokens=False).ids
        if after[: len(bare)] != bare or len(after) == len(bare):
            raise UnsupportedModelError(
                f"{fmt.name}'s instruction separator {fmt.separator!r} does not tokenize "
                "apart from the text before it with this checkpoint's tokenizer, so where "
                "its instruction ends cannot be found"
            )

        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False).ids)

        return cls(fmt, bos, ids(fmt.user), tuple(after[len(bare) :]), ids(fmt.embed))

    def __call__(self, ids: Sequence[int]) -> int:
        """How many of ``ids``' leading tokens its pooling leaves out."""
        start = len(self.bos)
        if tuple(ids[:start]) != self.bos:
            return 0
        if _at(ids, self.user, start):
            end = _find(ids, self.separator, start + len(self.user))
            if end >= 0:
                return end + len(self.separator)
        elif _at(ids, self.embed, start):
            return start + len(self.embed)
        # Warm-up batches repeat one token: they are no user's input to warn about.
        if not self._warned and len(set(ids)) > 1:
            self._warned = True
            logger.warning(
                "a %s input does not start with its embedding template (%r + instruction + "
                "%r, or %r, before the text): it is pooled over all of its tokens but BOS, "
                "as vLLM does, which is not how the model was trained to embed",
                self.format.name,
                self.format.user,
                self.format.separator,
                self.format.embed,
            )
        return start


def _at(ids: Sequence[int], pattern: Sequence[int], start: int) -> bool:
    return len(pattern) > 0 and tuple(ids[start : start + len(pattern)]) == tuple(pattern)


def _find(ids: Sequence[int], pattern: Sequence[int], start: int) -> int:
    """The first index ``>= start`` where ``pattern`` begins in ``ids``, else -1."""
    width = len(pattern)
    first = pattern[0]
    for i in range(start, len(ids) - width + 1):
        if ids[i] == first and tuple(ids[i : i + width]) == tuple(pattern):
            return i
    return -1
