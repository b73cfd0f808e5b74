"""bge-m3's sparse and ColBERT heads on the device: read from their pickled state dicts, run
on the token states in one pass.

The request plane's half (what the outputs mean, MaxSim) is ``embedding_server/request/hybrid.py``.
BAAI/bge-m3 keeps the heads outside ``model.safetensors``, as ``sparse_linear.pt`` and
``colbert_linear.pt`` at the repository's root: ``torch.save`` of an ``nn.Linear``'s state
dict. A pickle can run code when it is loaded, so they are read with
``torch.load(weights_only=True)``, which unpickles tensors and plain containers only and
refuses anything else; and a file holding anything but one Linear's ``weight`` and ``bias``
of the shapes the body implies is refused, naming what it holds.

A model directory with both files is served with all three outputs (``/info`` lists them);
one with only one of them is refused, since bge-m3's outputs come as a pair and a half-read
checkpoint would serve less than it claims.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from embedding_server.errors import UnsupportedModelError
from embedding_server.request.hybrid import HybridHeads

SPARSE_FILE = "sparse_linear.pt"
COLBERT_FILE = "colbert_linear.pt"
HEAD_FILES = (SPARSE_FILE, COLBERT_FILE)
"""The root files of a bge-m3-shaped repository, fetched with its weights."""

_SPECIAL_ROLES = ("cls_token", "eos_token", "pad_token", "unk_token")
"""The tokens FlagEmbedding's sparse output leaves out (``unused_tokens``)."""


@dataclass(frozen=True)
class HybridHead:
    """``sparse_linear`` (hidden -> 1) and ``colbert_linear`` (hidden -> width), float32.
    Applied to token states ``[tokens, hidden]`` it gives ``[tokens, 1 + width]``: each
    token's ``relu`` sparse weight, then its (unnormalized) ColBERT vector."""

    sparse_weight: torch.Tensor
    sparse_bias: torch.Tensor | None
    colbert_weight: torch.Tensor
    colbert_bias: torch.Tensor | None

    @property
    def width(self) -> int:
        return int(self.colbert_weight.shape[0])

    def to(self, device: torch.device) -> HybridHead:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=torch.float32)

        return HybridHead(
            sparse_weight=self.sparse_weight.to(device=device, dtype=torch.float32),
            sparse_bias=move(self.sparse_bias),
            colbert_weight=self.colbert_weight.to(device=device, dtype=torch.float32),
            colbert_bias=move(self.colbert_bias),
        )

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        x = states.float()
        sparse = torch.relu(F.linear(x, self.sparse_weight, self.sparse_bias))
        colbert = F.linear(x, self.colbert_weight, self.colbert_bias)
        return torch.cat([sparse, colbert], dim=-1)


COLBERT_NOT_SERVED = (
    "it is a ColBERT late-interaction model: its vectors are per-token, projected and "
    "normalized, with [Q]/[D] markers and query augmentation, and scored by MaxSim. Of "
    "PyLate's modules only its Dense (pylate.models.Dense.Dense, with the settings of "
    "config_sentence_transformers.json) is read; a single pooled vector of it would not be "
    "what it was trained to give, so it is refused"
)


def refuse_colbert(config: Mapping[str, Any]) -> None:
    """Refuse a stanford-colbert ``HF_ColBERT`` checkpoint (a BERT body with a ``linear``
    projection) on the transformers backend, from config.json alone, before any weight is
    fetched: the native backend serves it (``device/colbert.py``)."""
    names = [str(n) for n in config.get("architectures") or []]
    if "HF_ColBERT" in names:
        raise UnsupportedModelError(
            "architecture HF_ColBERT: it is a ColBERT late-interaction model, served by the "
            "native backend only (its query expansion needs the packed attention's key "
            "limits); serve it with backend native (or auto)"
        )


def read_hybrid_head(
    path: Path | None, *, hidden_size: int, tokenizer: Tokenizer, architecture: str
) -> tuple[HybridHeads, HybridHead] | None:
    """The heads of a bge-m3-shaped model directory, None when it has neither file."""
    if path is None:
        return None
    present = [name for name in HEAD_FILES if (path / name).is_file()]
    if not present:
        return None
    if len(present) == 1:
        missing = next(name for name in HEAD_FILES if name not in present)
        raise UnsupportedModelError(
            f"{architecture}: {path} holds {present[0]} but not {missing}; bge-m3's sparse "
            "and ColBERT heads come as a pair, and a model served with one of them would "
            "answer less than it declares. Add the missing file, or remove the other to "
            "serve the dense output alone"
        )
    sparse_w, sparse_b = _linear(path / SPARSE_FILE, hidden_size, out_features=1)
    colbert_w, colbert_b = _linear(path / COLBERT_FILE, hidden_size, out_features=None)
    head = HybridHead(sparse_w, sparse_b, colbert_w, colbert_b)
    return HybridHeads(_special_ids(path, tokenizer), head.width), head


def _linear(
    file: Path, hidden_size: int, *, out_features: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An ``nn.Linear``'s ``weight`` and optional ``bias`` from ``torch.save(state_dict)``,
    unpickled with ``weights_only=True`` (tensors and containers, never code)."""
    try:
        state: Any = torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        raise UnsupportedModelError(
            f"{file.name} is not a state dict of tensors that can be read safely "
            f"(torch.load with weights_only=True refused it: {exc})"
        ) from exc
    if not isinstance(state, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in state.values()
    ):
        raise UnsupportedModelError(f"{file.name} is not a state dict of tensors")
    extra = sorted(set(map(str, state)) - {"weight", "bias"})
    if "weight" not in state or extra:
        raise UnsupportedModelError(
            f"{file.name} holds {sorted(map(str, state))}; a Linear layer's weight (and bias) "
            "is expected"
        )
    weight = state["weight"].float()
    bias = state["bias"].float() if "bias" in state else None
    rows = out_features if out_features is not None else int(weight.shape[0])
    if weight.dim() != 2 or tuple(weight.shape) != (rows, hidden_size):
        raise UnsupportedModelError(
            f"{file.name}: weight has shape {list(weight.shape)}, expected "
            f"[{out_features if out_features is not None else 'width'}, {hidden_size}] for a "
            f"body of hidden size {hidden_size}"
        )
    if bias is not None and tuple(bias.shape) != (rows,):
        raise UnsupportedModelError(
            f"{file.name}: bias has shape {list(bias.shape)}, expected [{rows}]"
        )
    return weight, bias


def _special_ids(path: Path, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids of the CLS, EOS, PAD and UNK tokens the tokenizer's configuration names
    (``special_tokens_map.json``, then ``tokenizer_config.json``)."""
    named: dict[str, str] = {}
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            data = json.loads((path / file).read_text())
        except (OSError, ValueError):
            continue
        for role in _SPECIAL_ROLES:
            value = data.get(role) if isinstance(data, dict) else None
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                named[role] = value
    ids = {tokenizer.token_to_id(token) for token in named.values()}
    found = tuple(sorted(i for i in ids if i is not None))
    if not found:
        raise UnsupportedModelError(
            f"{path}: the tokenizer's configuration names none of its CLS, EOS, PAD and UNK "
            "tokens, which bge-m3's sparse output leaves out"
        )
    return found
