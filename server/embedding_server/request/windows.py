"""Reading a long text through windows, so that a megabyte of text costs the tokenizer what
a few thousand characters cost.

A text longer than the model can use is *read* through a window before the tokenizer sees
all of it. Reading never changes a result; the argument: the tokenizer splits text into words
before it cuts words into tokens, so every token of a window of the text, except those of the
word at the window's edge (and an added token touching it), is a token of the whole text, the
same token at the same place: these are the window's *settled* tokens
(:func:`settled_tokens`), and the text beyond the window cannot change them. When the settled
tokens are more than an input may keep, the whole text is over-long, and its truncation (or
its refusal without truncation) is exactly that of the window. When they are not (a text made
of a few giant words, or a word longer than the window straddling its edge), the window is
doubled and the text read again (:meth:`Reading.widen`), until either the settled tokens
decide it or the window holds the whole text, which is then tokenized as it is. A window
starts at :data:`CLIP_CHARS_PER_TOKEN` characters per token the input may keep and grows to
:data:`MAX_CHARS_PER_TOKEN` per token at most, so the tokenizer reads at most twice that of
any one input, whatever its words. A longer text its widest window does not settle (a word of
thousands of characters at the cut) is refused with :class:`~.errors.UnsettledInputError`
(:func:`unsettled_error`), never tokenized in full nor guessed at.

A request's texts are read in turns of at most :data:`READ_CHARS_PER_CALL` characters
(:func:`in_turns`), each turn in at most two batched tokenizer calls (:func:`read_windows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Encoding, Tokenizer

from embedding_server.errors import UnsettledInputError

CLIP_CHARS_PER_TOKEN = 8
"""The first window over an over-long text: characters read per token the input may keep.
Natural text averages 3-5 characters per token in every tokenizer we serve, so this window
nearly always settles the text at once."""

MAX_CHARS_PER_TOKEN = 64
"""The widest window: characters read per token the input may keep (at least
:data:`MIN_WIDEST_CHARS`). Beyond it a text that is still not settled is refused."""

MIN_WIDEST_CHARS = 16384
"""The widest window is never narrower than this, so a request that keeps few tokens of each
input (a small ``truncate_prompt_tokens``) still reads a long word whole."""

READ_CHARS_PER_CALL = 1 << 20
"""Characters one batched tokenizer call reads at most: the inputs of a bigger request are
read in turns of this size, and its tokens are counted against its limit after each turn."""


@dataclass(eq=False, slots=True)
class Reading:
    """One text being read through a window (see the module docstring)."""

    text: str
    window: int
    """Characters of ``text`` the next read takes (from its end with ``from_end``)."""
    from_end: bool = False
    prompt: str = ""
    """Prepended to what is read from the start (a prompt is cut off with the start)."""
    enc: Encoding | None = None
    read: int = 0
    """The window ``enc`` was read with (0: not read yet)."""
    settled: int = 0
    """Leading tokens of ``enc`` (trailing ones ``from_end``) that the unread text cannot
    change; all of them once the whole text was read."""

    @property
    def whole(self) -> bool:
        return self.window >= len(self.text)

    @property
    def current(self) -> bool:
        return self.enc is not None and self.read == self.window

    def part(self) -> str:
        if self.whole:
            return self.prompt + self.text
        if self.from_end:
            return self.text[len(self.text) - self.window :]
        return self.prompt + self.text[: self.window]

    def widen(self, widest: int) -> bool:
        """Double the window (to ``widest`` at most); False when it is at ``widest``."""
        if self.window >= widest:
            return False
        self.window = min(2 * self.window, widest)
        return True


def in_turns(readings: list[Reading]) -> list[list[Reading]]:
    """``readings`` in turns of at most :data:`READ_CHARS_PER_CALL` characters read."""
    turns: list[list[Reading]] = [[]]
    size = 0
    for reading in readings:
        cost = min(len(reading.text), reading.window)
        if turns[-1] and size + cost > READ_CHARS_PER_CALL:
            turns.append([])
            size = 0
        turns[-1].append(reading)
        size += cost
    return turns


def read_windows(backend: Tokenizer, readings: Sequence[Reading]) -> None:
    """Tokenize the window of each reading that is not current, in at most two batched
    calls: windows need word ids to settle their edge (``encode_batch``); whole texts do
    not and skip the offset and word bookkeeping (``encode_batch_fast``, measurably
    cheaper per text)."""
    stale = list({id(r): r for r in readings if not r.current}.values())
    parts = [r for r in stale if not r.whole]
    wholes = [r for r in stale if r.whole]
    if parts:
        encodings = backend.encode_batch([r.part() for r in parts], add_special_tokens=False)
        for reading, enc in zip(parts, encodings, strict=True):
            reading.enc, reading.read = enc, reading.window
            reading.settled = settled_tokens(enc.word_ids, from_end=reading.from_end)
    if wholes:
        encodings = backend.encode_batch_fast([r.part() for r in wholes], add_special_tokens=False)
        for reading, enc in zip(wholes, encodings, strict=True):
            reading.enc, reading.read, reading.settled = enc, reading.window, len(enc.ids)


def settled_tokens(word_ids: Sequence[int | None], *, from_end: bool) -> int:
    """How many tokens of a clipped text the text beyond the cut cannot change: all but
    those of the word at the cut (the last word, or the first when the start was cut off).
    A token outside any word (an added token) next to the cut counts as part of it, and so
    does the word beside it."""
    words = list(reversed(word_ids)) if from_end else list(word_ids)
    n = len(words)
    end = n
    for _ in range(2):
        if end == 0:
            return 0
        cut_word = words[end - 1]
        while end > 0 and words[end - 1] == cut_word:
            end -= 1
        if cut_word is not None:
            break
    return end


def unsettled_error(
    where: str, reading: Reading, keep: int, widest: int, param: str | None = None
) -> UnsettledInputError:
    """The refusal of a text whose widest window does not settle the ``keep`` tokens it
    needs. The text is longer than the window (else it would be read whole), and that is
    all the message says of its length: a pair's prompt is read from a cut of it
    (``prompts.py``), whose length is not the prompt's."""
    end = "last" if reading.from_end else "first"
    return UnsettledInputError(
        f"{where} is longer than {widest} characters, the most the server tokenizes of one "
        f"input, and its {end} {widest} characters hold only "
        f"{reading.settled} tokens that the rest of the text cannot change, not the "
        f"{max(keep, 1)} it needs: a word thousands of characters long runs across that "
        f"point. Send at most {widest} characters of this text, or break up that word.",
        param=param or where.split("[", 1)[0],
    )
