"""Deterministic mixed-length text corpus shared by the offline and HTTP benchmarks.

Texts are 4 to 200 words drawn from a fixed vocabulary with a seeded generator, so every run
(and every machine) embeds exactly the same inputs; lengths are spread uniformly so batching
and padding behaviour matter as they do with real traffic.
"""

from __future__ import annotations

import random

_VOCABULARY = """
the of and to in is was for on are with as by at from that this be or an it have not which
but were all can has their more one will other also been its about into only new model
embedding vector search query document server batch token budget queue latency throughput
kubernetes operator cluster replica scaling memory compute kernel attention layer
transformer encoder decoder sentence meaning language retrieval index similarity cosine
normal dimension cache request response client stream network storage database river
mountain forest ocean city village garden kitchen window morning evening winter summer
autumn spring music painting history science physics chemistry biology planet quickly
slowly carefully rarely often always never perhaps certainly clearly simply build deploy
measure improve explain compare describe discover protect remember travel blue green
bright quiet heavy gentle ancient modern simple complex careful honest
"""
_WORDS = tuple(_VOCABULARY.split())


def make_corpus(n: int, *, seed: int = 0, min_words: int = 4, max_words: int = 200) -> list[str]:
    """``n`` texts of ``min_words``..``max_words`` words (uniform), reproducible by ``seed``."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        words = rng.choices(_WORDS, k=rng.randint(min_words, max_words))
        sentences, start = [], 0
        while start < len(words):
            end = min(len(words), start + rng.randint(6, 18))
            chunk = words[start:end]
            sentences.append(" ".join(chunk).capitalize() + ".")
            start = end
        texts.append(" ".join(sentences))
    return texts
