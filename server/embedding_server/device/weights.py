"""Reading a checkpoint's tensors: safetensors files (one, or shards) read lazily tensor
by tensor (:class:`SafetensorsWeights`), ``pytorch_model.bin`` where that is all there is
(:func:`load_weights`), and a checkpoint as shapes and dtypes alone (:class:`TensorShapes`),
from its files' headers or, for a Hub model, from the Hub's safetensors headers without a
download (:func:`hub_shapes`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from embedding_server.device.hub import ModelSource, hub_offline
from embedding_server.device.model_config import read_json
from embedding_server.errors import ModelNotFoundError, UnsupportedModelError


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """The tensors of safetensors files by name, each read from its file when asked for.

    The model builders read one weight at a time, keep their rank's share and drop the rest,
    so a checkpoint is never in memory whole: what makes loading a shard of a large model
    cost that shard, not the model, on every tensor-parallel rank.
    """

    def __init__(self, files: Sequence[Path]) -> None:
        from safetensors import safe_open

        self._files = {str(f): safe_open(str(f), framework="pt") for f in files}
        self._where = {
            name: f
            for f, handle in self._files.items()
            for name in handle.keys()  # type: ignore[no-untyped-call]  # noqa: SIM118
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        handle = self._files[self._where[name]]
        tensor: torch.Tensor = handle.get_tensor(name)  # type: ignore[no-untyped-call]
        return tensor

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape of ``name``, from its file's header (the tensor is not read)."""
        view = self._files[self._where[name]].get_slice(name)  # type: ignore[no-untyped-call]
        return tuple(int(n) for n in view.get_shape())

    def row(self, name: str, index: int) -> torch.Tensor:
        """Row ``index`` of the tensor ``name``, read alone from the file (a yes/no
        reranker's two rows of a language-model head of a hundred thousand rows)."""
        view = self._files[self._where[name]].get_slice(name)  # type: ignore[no-untyped-call]
        tensor: torch.Tensor = view[index : index + 1][0]
        return tensor

    def shapes(self) -> dict[str, tuple[list[int], torch.dtype]]:
        """Every tensor's shape and dtype, from the files' headers (no tensor is read)."""
        out: dict[str, tuple[list[int], torch.dtype]] = {}
        for name, f in self._where.items():
            view = self._files[f].get_slice(name)  # type: ignore[no-untyped-call]
            dtype = _SAFETENSORS_DTYPES.get(str(view.get_dtype()), torch.float32)
            out[name] = (list(view.get_shape()), dtype)
        return out

    def __contains__(self, name: object) -> bool:
        return name in self._where  # without reading the tensor, as Mapping's would

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


# safetensors' dtype names (its header's and the Hub's) as torch dtypes.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class TensorShapes(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors as shapes and dtypes only, each read as an empty tensor on the
    ``meta`` device: models and heads built from it run every check and sizing of a real
    load without a byte of weights (what ``inspect`` builds)."""

    def __init__(self, shapes: Mapping[str, tuple[Sequence[int], torch.dtype]]) -> None:
        self._shapes = dict(shapes)

    @classmethod
    def of(cls, weights: Mapping[str, torch.Tensor]) -> TensorShapes:
        """The shapes of a mapping (from ``SafetensorsWeights``: read from file headers)."""
        if isinstance(weights, SafetensorsWeights):
            return cls(weights.shapes())
        return cls({name: (tuple(t.shape), t.dtype) for name, t in weights.items()})

    @classmethod
    def from_hub(cls, files: Mapping[str, Any]) -> TensorShapes:
        """From ``huggingface_hub.get_safetensors_metadata(...).files_metadata``."""
        return cls(
            {
                name: (tuple(info.shape), _SAFETENSORS_DTYPES.get(info.dtype, torch.float32))
                for meta in files.values()
                for name, info in meta.tensors.items()
            }
        )

    def __getitem__(self, name: str) -> torch.Tensor:
        shape, dtype = self._shapes[name]
        return torch.empty(tuple(shape), dtype=dtype, device="meta")

    def __contains__(self, name: object) -> bool:
        return name in self._shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def load_weights(path: Path) -> Mapping[str, torch.Tensor]:
    """All tensors of a checkpoint, by their Hugging Face names, on the CPU (safetensors read
    lazily, tensor by tensor: :class:`SafetensorsWeights`)."""
    single = path / "model.safetensors"
    if single.is_file():
        return SafetensorsWeights([single])
    index = read_json(path / "model.safetensors.index.json")
    if isinstance(index, dict):
        return SafetensorsWeights(
            [path / shard for shard in sorted(set(index["weight_map"].values()))]
        )
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        return SafetensorsWeights(shards)
    bin_index = read_json(path / "pytorch_model.bin.index.json")
    bins = (
        [path / f for f in sorted(set(bin_index["weight_map"].values()))]
        if isinstance(bin_index, dict)
        else [path / "pytorch_model.bin"]
    )
    if all(b.is_file() for b in bins):
        weights: dict[str, torch.Tensor] = {}
        for b in bins:
            weights.update(torch.load(b, map_location="cpu", weights_only=True, mmap=True))
        return weights
    raise UnsupportedModelError(
        f"{path} holds no weights (model.safetensors, sharded safetensors or pytorch_model.bin)"
    )


def hub_shapes(source: ModelSource) -> TensorShapes | None:
    """A Hub model's tensors as shapes, from its safetensors headers on the Hub (no weight is
    downloaded); None where there are none to read that way: a local directory, the local
    cache only (``HF_HUB_OFFLINE``), a repository of ``pytorch_model.bin`` only."""
    if source.repo_id is None or hub_offline():
        return None
    from huggingface_hub import get_safetensors_metadata
    from huggingface_hub.errors import HfHubHTTPError, NotASafetensorsRepoError

    try:
        meta = get_safetensors_metadata(source.repo_id, revision=source.revision)
    except NotASafetensorsRepoError:
        return None
    except (OSError, HfHubHTTPError) as exc:
        raise ModelNotFoundError(
            f"model {source.repo_id!r}: cannot read its safetensors headers from the "
            f"Hugging Face Hub: {exc}"
        ) from exc
    return TensorShapes.from_hub(meta.files_metadata)
