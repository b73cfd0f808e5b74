"""Saying so when the pooling is a guess.

A checkpoint tells how its vectors are pooled in its sentence-transformers Pooling config
(``modules.json`` and ``1_Pooling/config.json``), or, for a few families, in its own
``config.json`` (JinaBERT's ``emb_pooler``). Without either, the server falls back on its
architecture's default (the first token for encoders, the last for decoders, the mean for
T5), which is right for some checkpoints and wrong for others: e5-small without its pooling
files is trained with the mean and gets the first token; a Qwen2 embedder trained with the
mean gets the last token. Both give vectors of the right shape, so nothing would fail.
:func:`pooling_guess` names the guess and the way out; ``inspect`` prints it and ``serve``
logs it at warning level.
"""

from __future__ import annotations

from embedding_server.device.loading import LoadedModel
from embedding_server.device.models import lookup
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.configuration import EngineConfig
from embedding_server.settings import EngineSettings

_METHODS = {
    "cls": "the first token's state",
    "last": "the last token's state",
    "mean": "the mean of the token states",
}


def pooling_guess(
    settings: EngineSettings, loaded: LoadedModel, config: EngineConfig
) -> str | None:
    """Why the pooling ``config`` serves is a guess and how to set it, or None where the
    checkpoint or the settings declare it (or the served outputs do not pool: a classifier,
    SPLADE, ColBERT, an image family whose pooling is part of its architecture)."""
    if (
        config.task != "embed"
        or settings.pooling != "auto"
        or loaded.backend == "fake"
        or loaded.st.pooling is not None
        or loaded.colbert is not None
        or _declared_by_family(loaded)
    ):
        return None
    method = config.pooling
    where = (
        "its sentence-transformers config has no Pooling module"
        if loaded.st.present
        else "it has no sentence-transformers files (modules.json, 1_Pooling/config.json)"
    )
    return (
        f"pooling {method} is a guess: {where} and its config.json declares none, so it "
        f"gets the {loaded.architecture} default, {_METHODS.get(method, method)}. Checkpoints "
        "of one architecture are trained with different poolings (e5 without its pooling "
        "files means mean, not cls; many decoder embedders mean, not last): if its model "
        "card says another, set --pooling (EMBEDDING_SERVER_POOLING; spec.embedding.pooling "
        "in an EmbeddingService), or serve it with its sentence-transformers files"
    )


def _declared_by_family(loaded: LoadedModel) -> bool:
    """Whether the native family fixes the pooling itself: from a config key it reads
    (``Architecture.declared_pooling``), or as part of an image architecture."""
    if loaded.backend != "native":
        return False
    try:
        arch = lookup(loaded.config)
    except UnsupportedModelError:
        return False
    if arch.images:
        return True
    return arch.declared_pooling is not None and arch.declared_pooling(loaded.config) is not None
