"""Before a Hub model's weights are downloaded, everything ``inspect`` can decide without them.

A load refuses what it cannot serve exactly, and some of those refusals come late: the
tensor audit needs the weights' names and shapes, and the settings' own checks (a
concatenated sentence-transformers pooling, ``--dimensions`` beyond the model's,
``--default-prompt-name`` it lacks, a ``--max-model-len`` it cannot take) run on the loaded
model. For a model on the Hub, each would come after a download of its whole weights
(tens of gigabytes for a 7B model). ``inspect`` makes all of them from the config files and
the Hub's safetensors headers alone (:mod:`.inspection`); :func:`inspect_before_download`
runs it first, so that a model ``inspect`` refuses is refused by ``serve`` with the same
message and without the download.
"""

from __future__ import annotations

import logging

from embedding_server.device.generic import choose_backend
from embedding_server.device.hub import hub_offline, locate_model
from embedding_server.device.inspection import inspect_model
from embedding_server.device.loading import naming
from embedding_server.device.model_config import read_model_config
from embedding_server.settings import EngineSettings

logger = logging.getLogger(__name__)


def inspect_before_download(settings: EngineSettings) -> None:
    """Raise what serving ``settings`` would raise, decided as ``inspect`` decides it, when
    the model comes from the Hub (not a local directory, and not offline: from the local
    cache nothing is downloaded) and is served natively. On the transformers backend
    ``inspect`` itself loads the model, so nothing is gained: that path refuses from the
    config files what it can (``generic.refuse_before_fetch``)."""
    if hub_offline():
        return
    with naming(settings.model):
        source = locate_model(
            settings.model, revision=settings.revision, cache_dir=settings.cache_dir
        )
        if source.repo_id is None:
            return
        backend = choose_backend(
            read_model_config(source.path),
            settings.backend,
            model=settings.model,
            trust_remote_code=settings.trust_remote_code,
        )
    if backend != "native":
        return
    inspect_model(settings)
    logger.debug("model %r: inspected from its config files and headers", settings.model)
