"""A listwise reranker's head on the device: jina-reranker-v3's projector.

``JinaForRanking`` (the authors' ``modeling.py``, custom code that is not run) is a
``Qwen3ForCausalLM`` whose language-model head is replaced by an identity, plus
``projector = Sequential(Linear(hidden, hidden // 2, bias=False), ReLU(), Linear(hidden //
2, 512, bias=False))``. The body is the native Qwen3 decoder (causal, as the authors run
it); this module reads the projector's two weights (``projector.0.weight``,
``projector.2.weight``) and applies it, in float32, to the token states a listwise job asks
for. The request plane picks the marker positions' rows and scores them
(``embedding_server/request/listwise.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from embedding_server.errors import UnsupportedModelError
from embedding_server.request.listwise import CHAT_TOKENS, ListwiseFormat

ARCHITECTURE = "JinaForRanking"
FIRST, SECOND = "projector.0.weight", "projector.2.weight"


def is_listwise(config: Mapping[str, Any]) -> bool:
    """Whether ``config.json`` names jina-reranker-v3's ``JinaForRanking``."""
    return ARCHITECTURE in [str(n) for n in config.get("architectures") or []]


@dataclass(frozen=True)
class ProjectorHead:
    """``Linear(hidden, hidden // 2)``, ReLU, ``Linear(hidden // 2, width)``, no biases."""

    first: torch.Tensor
    second: torch.Tensor

    @property
    def width(self) -> int:
        return int(self.second.shape[0])

    def to(self, device: torch.device) -> ProjectorHead:
        return ProjectorHead(
            self.first.to(device=device, dtype=torch.float32),
            self.second.to(device=device, dtype=torch.float32),
        )

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(states.float(), self.first)), self.second)


def read_projector(weights: Mapping[str, torch.Tensor], hidden_size: int) -> ProjectorHead:
    """The projector of a ``JinaForRanking`` checkpoint (reading marks its tensors read); a
    bias beside it is left unread, so the tensor audit refuses the checkpoint."""
    for name in (FIRST, SECOND):
        if name not in weights:
            raise UnsupportedModelError(
                f"{ARCHITECTURE} checkpoint without {name}: its projector is what its scores "
                "are computed from"
            )
    first, second = weights[FIRST].float(), weights[SECOND].float()
    half = hidden_size // 2
    if tuple(first.shape) != (half, hidden_size) or second.dim() != 2 or second.shape[1] != half:
        raise UnsupportedModelError(
            f"{ARCHITECTURE} projector has shapes {list(first.shape)} and {list(second.shape)}; "
            f"its authors' code builds [{half}, {hidden_size}] and [width, {half}] for a body "
            f"of hidden size {hidden_size}"
        )
    return ProjectorHead(first, second)


def read_format(tokenizer: Tokenizer, width: int) -> ListwiseFormat:
    """The prompt's marker ids from the checkpoint's tokenizer; a tokenizer without the
    markers or the chat tokens as single tokens is not the model's, and is refused."""
    probe = ListwiseFormat(document_id=-1, query_id=-1, width=width)
    ids: dict[str, int] = {}
    for token in (probe.document_token, probe.query_token, *CHAT_TOKENS):
        found = tokenizer.token_to_id(token)
        if found is None:
            raise UnsupportedModelError(
                f"{ARCHITECTURE} served as {probe.name}: its tokenizer has no token {token!r}, "
                "which its prompt needs; is it that model's tokenizer?"
            )
        ids[token] = found
    return ListwiseFormat(
        document_id=ids[probe.document_token], query_id=ids[probe.query_token], width=width
    )
