"""``embedding-server inspect``: what a model would be served as, decided without serving it.

The model goes through the same steps as a load (:func:`~.loading.load_model`, the
configuration :func:`~.configuration.resolve_config` derives from the settings, the attention
kernel :func:`~.attention.select_backend` picks for this device), with one difference: the
weights are only names, shapes and dtypes (``shapes_only``), read from the safetensors
headers, so the body and heads are built on the ``meta`` device and nothing is computed. So
a model ``inspect`` accepts is one the server accepts with the same settings, and a model it
refuses is refused with the same message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from embedding_server.device.configuration import choose_attention, describe, resolve_config
from embedding_server.device.distributed import SINGLE, Shard
from embedding_server.device.dtypes import resolve_device
from embedding_server.device.fingerprint import has_weights, with_fingerprint
from embedding_server.device.loading import load_configured
from embedding_server.device.pooling_guess import pooling_guess
from embedding_server.request.configuration import EngineInfo
from embedding_server.settings import EngineSettings


@dataclass(frozen=True)
class Inspection:
    """What would be served: the engine's resolved configuration (as ``/info`` would
    report it) and what the checkpoint is made of."""

    info: EngineInfo
    backend: str
    """Which implementation serves it: ``native`` (this server's packed model code) or
    ``transformers`` (transformers' own model class, ``generic.py``)."""
    custom_code: str | None
    """The class ``auto_map`` names: not run on the native backend; run on the transformers
    backend, which only remote code allowed gets to."""
    causal: bool
    """Whether attention is causal (decoders unless their config switches it off)."""
    tensors_read: int
    ignored: list[tuple[str, str]]
    """``(tensor, reason)`` of each tensor the family knowingly leaves unread."""
    pooling_note: str | None = None
    """Why the pooling is a guess (the architecture's default: the checkpoint declares
    none) and how to set it; None where it is declared (``pooling_guess.py``)."""

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values: the info's, then this inspection's."""
        out = self.info.to_dict()
        out.update(
            backend=self.backend,
            custom_code=self.custom_code,
            causal=self.causal,
            tensors_read=self.tensors_read,
            tensors_ignored=[{"name": n, "reason": r} for n, r in self.ignored],
            pooling_note=self.pooling_note,
        )
        return out


def inspect_model(settings: EngineSettings) -> Inspection:
    """Decide what ``settings`` would serve; raises what serving would raise."""
    device = resolve_device(settings.device)
    size = settings.tensor_parallel_size
    # Rank 0's share: a size that does not divide the heads is refused as at start-up.
    shard = SINGLE if size == 1 else Shard(0, size)
    loaded = load_configured(settings, device=device, shard=shard, shapes_only=True)
    config = resolve_config(settings, loaded, device=device)
    attention = choose_attention(settings, loaded, device)
    info = describe(
        config,
        loaded,
        device=device,
        attention=attention,
        vocab_size=loaded.tokenizer.get_vocab_size(with_added_tokens=True),
    )
    if loaded.path is not None and has_weights(loaded.path):
        # As serving computes it; a Hub model's weights are not downloaded here, so its
        # fingerprint is known only where an earlier download left them in the cache.
        code = loaded.backend == "transformers" and settings.trust_remote_code
        info = with_fingerprint(info, loaded, config, code=code)
    audit = loaded.tensors
    return Inspection(
        info=info,
        backend=loaded.backend,
        custom_code=loaded.custom_code,
        causal=bool(loaded.model.causal),
        tensors_read=len(audit.read) if audit else 0,
        ignored=list(audit.ignored) if audit else [],
        pooling_note=pooling_guess(settings, loaded, config),
    )
