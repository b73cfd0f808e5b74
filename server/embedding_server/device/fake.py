"""The ``fake`` backend: a real pipeline around a weightless model, for fast tests and demos.

``Engine.from_pretrained("fake")`` gives an engine whose tokenizer (byte-level: one token per
UTF-8 byte, plus ``<s>``/``</s>``), scheduler, pooling and API are the real ones; only the
transformer body is replaced by a deterministic function of (token id, position). Vectors are
therefore stable across runs and batch compositions, so tests can compare a request's vector
alone and in a crowd.

Options ride on the model name as a query string, which also works from the CLI and in a
Kubernetes manifest (e.g. to make a load test fill the queue):
``fake?dim=64&max_len=128&delay_ms=20&matryoshka=false&pooling=mean``.

``image_tokens=N`` makes it a model that takes images too (``info().modalities`` lists
``image``): each image costs N tokens, and its vector is a deterministic function of its
pixels' bytes (:class:`FakeRunner`), never of its placeholder ids. ``chat=true`` gives its
tokenizer a small chat template (:data:`FAKE_CHAT_TEMPLATE`), as an instruction-tuned
decoder embedder has, for ``messages`` requests.

**The device-shaped benchmark model** (:data:`DEVICE_MODEL`,
``fake?tokenizer=minilm&device_us_per_token=1&device_launch_us=200``): what a GPU serving
all-MiniLM-L6-v2 looks like to the host, for measuring the front end (``bench.frontend``).
``tokenizer=minilm`` tokenizes with the packaged all-MiniLM-L6-v2's own tokenizer (the same
WordPiece, the same token counts as the real model), and every forward pass *waits*
``device_launch_us + device_us_per_token * tokens`` microseconds in ``time.sleep``, which
releases the GIL and spends no CPU, as a host thread blocked on a CUDA synchronize does. The
figures are an H100's order of magnitude for MiniLM (an estimate, not a measurement): its 6
layers of 384 wide hold 10.6M weights besides the embeddings, about 21 MFLOP a token with
attention, so at 2% of an H100's ~990 TFLOP/s dense bfloat16 it runs a million tokens a second
(1 us a token: small matrices keep it far from peak); a forward pass's fixed cost (its ~100
small kernels, the synchronize, the copy back) is a couple of hundred microseconds whatever
the batch. Both default to 0 (no wait), as the fake model always was. What a GPU computes
on the device, the per-token lookups and the pooling over them, the device-shaped model does
not spend on the host: :class:`FakeRunner` pools its ``mean``, ``cls`` and ``last`` batches
from the token ids (:meth:`FakeModel.pooled`, one ``embedding_bag``: about a tenth of a
microsecond a token), and its forward pass returns rows that hold no memory. The host work a
GPU server pays too stays real: batch packing, the attention plan, the pooling call's small
tensors and the copy back. Batches that want token states, leave a prompt out of pooling or
pool another way take the real rows. Vectors are those of the plain fake model, within float
rounding: deterministic, batch-independent.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from urllib.parse import parse_qsl

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from embedding_server.device.fake_images import FakeImageProcessor
from embedding_server.device.hub import resolve_model_path
from embedding_server.device.loading import LoadedModel
from embedding_server.device.models.base import PackedBatch
from embedding_server.device.runner import ModelRunner, PreparedBatch
from embedding_server.device.sentence_transformers import SentenceTransformerConfig
from embedding_server.device.tokenizer_files import load_tokenizer
from embedding_server.errors import InvalidRequestError
from embedding_server.request.configuration import EngineInfo
from embedding_server.request.media.inputs import ChatTemplate
from embedding_server.request.pooling import POOLING_METHODS, PoolingMethod, parse_pooling_method
from embedding_server.request.sequences import SequenceInput
from embedding_server.settings import DEFAULT_MODEL

FAKE_MODEL = "fake"
DEVICE_MODEL = "fake?tokenizer=minilm&device_us_per_token=1&device_launch_us=200"
"""The device-shaped benchmark model: MiniLM's tokenizer and an H100's time for MiniLM."""
TOKENIZERS = ("bytes", "minilm")
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")

FAKE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The fake tokenizer's chat template with ``chat=true`` (the shape of a Zephyr-style
template: a tag per role, the end-of-sequence token after each turn)."""


def is_fake(model: str) -> bool:
    return model == FAKE_MODEL or model.startswith(FAKE_MODEL + "?")


@dataclass(frozen=True)
class FakeOptions:
    dim: int = 384
    max_len: int = 512
    delay_ms: float = 0.0
    matryoshka: bool = True
    pooling: PoolingMethod = "mean"
    prompts: bool = True
    device_error_after: int = 0
    """Forward passes (warm-up included) after which every one raises a CUDA-style fatal
    error, as a poisoned device does; 0 = never. For the failure-path tests."""
    image_tokens: int = 0
    """Tokens one image costs; 0: the model takes text only."""
    chat: bool = False
    """Give the tokenizer :data:`FAKE_CHAT_TEMPLATE`."""
    tokenizer: str = "bytes"
    """``bytes``: one token per UTF-8 byte (:func:`build_fake_tokenizer`); ``minilm``: the
    packaged all-MiniLM-L6-v2's tokenizer, so requests cost the real model's tokens."""
    device_us_per_token: float = 0.0
    """Device time a forward pass waits per token of its batch, GIL released (microseconds)."""
    device_launch_us: float = 0.0
    """Device time every forward pass waits besides its tokens' (microseconds)."""

    @classmethod
    def parse(cls, model: str) -> FakeOptions:
        _, _, query = model.partition("?")
        fields: dict[str, str] = dict(parse_qsl(query, strict_parsing=bool(query)))
        known = {
            "dim",
            "max_len",
            "delay_ms",
            "matryoshka",
            "pooling",
            "prompts",
            "image_tokens",
            "chat",
            "tokenizer",
            "device_us_per_token",
            "device_launch_us",
        }
        unknown = set(fields) - known - {"device_error_after"}
        if unknown:
            raise InvalidRequestError(
                f"unknown fake-model options {sorted(unknown)}", param="model"
            )
        pooling_method = parse_pooling_method(fields.get("pooling", "mean"))
        if pooling_method is None:
            raise InvalidRequestError(
                f"fake pooling must be one of {POOLING_METHODS}", param="model"
            )
        try:
            options = cls(
                dim=int(fields.get("dim", 384)),
                max_len=int(fields.get("max_len", 512)),
                delay_ms=float(fields.get("delay_ms", 0.0)),
                matryoshka=_bool(fields.get("matryoshka", "true")),
                pooling=pooling_method,
                prompts=_bool(fields.get("prompts", "true")),
                device_error_after=int(fields.get("device_error_after", 0)),
                image_tokens=int(fields.get("image_tokens", 0)),
                chat=_bool(fields.get("chat", "false")),
                tokenizer=fields.get("tokenizer", "bytes"),
                device_us_per_token=float(fields.get("device_us_per_token", 0.0)),
                device_launch_us=float(fields.get("device_launch_us", 0.0)),
            )
        except ValueError as exc:
            raise InvalidRequestError(f"bad fake-model option: {exc}", param="model") from exc
        if not 0 <= options.image_tokens <= options.max_len:
            raise InvalidRequestError(
                f"fake image_tokens must be between 0 and max_len ({options.max_len})",
                param="model",
            )
        if options.tokenizer not in TOKENIZERS:
            raise InvalidRequestError(
                f"fake tokenizer must be one of {TOKENIZERS}, not {options.tokenizer!r}",
                param="model",
            )
        waits = (options.device_us_per_token, options.device_launch_us)
        if not all(math.isfinite(w) and w >= 0 for w in waits):
            raise InvalidRequestError(
                "fake device_us_per_token and device_launch_us must be finite and >= 0",
                param="model",
            )
        return options


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


def build_fake_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: ids 0-3 are specials, then one id per byte (260 in all)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


class FakeModel:
    """hidden[t] = E[id_t] + 0.1 * P[pos_t]: deterministic, batch-independent."""

    causal = False
    sliding_window: int | None = None
    position_offset = 0

    def __init__(
        self, vocab_size: int, options: FakeOptions, device: torch.device, dtype: torch.dtype
    ) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.hidden_size = options.dim
        self.max_positions = options.max_len
        self.delay_s = options.delay_ms / 1000.0
        self.device_s_per_token = options.device_us_per_token / 1e6
        self.device_launch_s = options.device_launch_us / 1e6
        self.device_error_after = options.device_error_after
        self.tokens = torch.randn(vocab_size, options.dim, generator=generator).to(device, dtype)
        self.positions = (0.1 * torch.randn(options.max_len, options.dim, generator=generator)).to(
            device, dtype
        )
        self.calls = 0
        """Forward passes run (tests use it to observe batching)."""
        self.device_pools = bool(self.device_s_per_token or self.device_launch_s)
        """The device-shaped model: its runner may pool ``mean``, ``cls`` and ``last`` from the
        token ids (:meth:`pooled`) instead of pooling per-token rows on the host."""
        self._placeholder = torch.zeros(1, options.dim, device=device, dtype=dtype)
        if self.device_pools:
            # float32 tables for pooled(): a sequence's positions are 0..L-1, so their sum
            # is one row of a running sum.
            self._tokens32 = self.tokens.float()
            self._positions32 = self.positions.float()
            self._position_sums = torch.cat(
                [
                    torch.zeros(1, options.dim, device=device),
                    torch.cumsum(self._positions32, 0),
                ]
            )

    def placeholder(self, tokens: int) -> torch.Tensor:
        """``[tokens, dim]`` rows that hold no memory (one zero row, expanded): what the
        device-shaped model's forward pass returns when its runner pools with :meth:`pooled`."""
        return self._placeholder.expand(tokens, -1)

    def is_placeholder(self, hidden: torch.Tensor) -> bool:
        return hidden.data_ptr() == self._placeholder.data_ptr()

    def pooled(
        self, input_ids: torch.Tensor, seqlens: Sequence[int], method: PoolingMethod
    ) -> torch.Tensor:
        """The ``method`` pooling of the rows :meth:`forward` would return for the packed
        sequences ``input_ids`` (lengths ``seqlens``), in float32, from the token ids: one
        ``embedding_bag`` over the ids and one row of the positions' running sum per sequence
        for ``mean``, two rows per sequence for ``cls`` and ``last``. Equal to pooling the
        rows within float rounding, at a fraction of the host's CPU (docs/performance-log.md,
        "The device-shaped front end in rounds"): a GPU pools on the device, not on the host."""
        lens = torch.tensor(seqlens, dtype=torch.int64, device=input_ids.device)
        ends = torch.cumsum(lens, 0)
        starts = ends - lens
        if method == "mean":
            ids = input_ids[: int(ends[-1])] if len(seqlens) else input_ids[:0]
            sums = torch.nn.functional.embedding_bag(ids, self._tokens32, starts, mode="sum")
            return (sums + self._position_sums.index_select(0, lens)) / lens.unsqueeze(1)
        if method == "cls":
            rows, positions = starts, torch.zeros_like(lens)
        elif method == "last":
            rows, positions = ends - 1, lens - 1
        else:
            raise ValueError(f"the device-shaped fake model pools mean, cls or last, not {method}")
        return self._tokens32.index_select(
            0, input_ids.index_select(0, rows)
        ) + self._positions32.index_select(0, positions)

    def device_seconds(self, tokens: int) -> float:
        """How long a forward pass over ``tokens`` tokens waits for the simulated device."""
        if not (self.device_s_per_token or self.device_launch_s):
            return 0.0
        return self.device_launch_s + self.device_s_per_token * tokens

    def forward(self, batch: PackedBatch, *, rows: bool = True) -> torch.Tensor:
        """``hidden[t] = E[id_t] + P[pos_t]`` after the simulated device's wait;
        ``rows=False``: :meth:`placeholder` rows instead, for a runner that pools with
        :meth:`pooled`."""
        self.calls += 1
        if self.device_error_after and self.calls > self.device_error_after:
            raise RuntimeError(
                "CUDA error: an illegal memory access was encountered (simulated by the fake "
                "model's device_error_after)"
            )
        if self.delay_s:
            time.sleep(self.delay_s)  # simulates a slow accelerator; runs in the forward thread
        wait = self.device_seconds(batch.input_ids.numel())
        if wait:
            # An accelerator's time: the GIL is free and no CPU is spent (time.sleep), as on
            # a host thread blocked in a CUDA synchronize.
            time.sleep(wait)
        if not rows:
            return self.placeholder(batch.input_ids.numel())
        # index_select, not advanced indexing: the same rows at a fraction of the host's CPU
        # (docs/performance-log.md, "The front end on a device-shaped model"), which the
        # device model must not spend.
        hidden = self.tokens.index_select(0, batch.input_ids)
        return hidden.add_(self.positions.index_select(0, batch.position_ids))


def load_fake(model: str, *, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """The fake model as a LoadedModel, configured from the query string of ``model``."""
    options = FakeOptions.parse(model)
    if options.tokenizer == "minilm":
        # The real server's tokenizer of the packaged default, loaded as it loads it.
        tokenizer, _ = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    else:
        tokenizer = build_fake_tokenizer()
    body = FakeModel(tokenizer.get_vocab_size(with_added_tokens=True), options, device, dtype)
    prompts = {"query": "query: ", "document": "passage: "} if options.prompts else {}
    st = SentenceTransformerConfig(
        present=True,
        pooling=options.pooling,
        normalize=True,
        max_seq_length=options.max_len,
        prompts=prompts,
    )
    config = {
        "model_type": "fake",
        "architectures": ["FakeModel"],
        "hidden_size": options.dim,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "is_matryoshka": options.matryoshka,
    }
    return LoadedModel(
        name=model,
        path=None,
        config=config,
        architecture="FakeModel",
        model=body,
        tokenizer=tokenizer,
        tokenizer_max_length=options.max_len,
        st=st,
        default_pooling=options.pooling,
        dtype=dtype,
        head_dim=options.dim,
        backend="fake",
    )


def fake_images(loaded: LoadedModel) -> FakeImageProcessor | None:
    """The fake model's image processor, where its options make it take images."""
    tokens = FakeOptions.parse(loaded.name).image_tokens
    return FakeImageProcessor(tokens) if tokens > 0 else None


def fake_chat_template(loaded: LoadedModel) -> ChatTemplate | None:
    """The fake tokenizer's chat template, with ``chat=true``."""
    if not FakeOptions.parse(loaded.name).chat:
        return None
    return ChatTemplate(FAKE_CHAT_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})


def fake_info(loaded: LoadedModel, info: EngineInfo) -> EngineInfo:
    """``info`` with the fake model's modalities."""
    tokens = FakeOptions.parse(loaded.name).image_tokens
    if tokens <= 0:
        return info
    return replace(info, modalities=["text", "image"], image_tokens=tokens)


DEVICE_POOLING: tuple[PoolingMethod, ...] = ("mean", "cls", "last")
"""The pooling methods the device-shaped model pools from token ids (:meth:`FakeModel.pooled`)."""


class FakeRunner(ModelRunner):
    """The fake model's runner: an image's sequence runs as ids drawn from a hash of its
    pixels' bytes (its placeholder ids say nothing about it), so its vector depends on the
    image alone, as a real vision tower's does, and never on the batch it is in.

    With the device-shaped model, a batch pooled ``mean``, ``cls`` or ``last`` over whole
    sequences (no prompt left out, no token states asked for) is pooled from its token ids
    (:meth:`FakeModel.pooled`), and its forward pass returns rows that hold no memory: the
    per-token lookups and the pooling over them are what a GPU computes, and the host's CPU
    must not spend them in a benchmark of the host. Any other batch takes the real rows."""

    model: FakeModel

    def _prepare(self, seqs: Sequence[SequenceInput]) -> PreparedBatch:
        if any(s.pixels is not None for s in seqs):
            seqs = [_hashed(s) if s.pixels is not None else s for s in seqs]
        return super()._prepare(seqs)

    def _forward(self, batch: PackedBatch, ordered: Sequence[SequenceInput]) -> torch.Tensor:
        pools_on_device = (
            self.model.device_pools
            and self.token_pooler is None
            and self.include_prompt
            and self.pooling in DEVICE_POOLING
            and not any(s.want_tokens for s in ordered)
        )
        return (
            self.model.forward(batch, rows=False)
            if pools_on_device
            else super()._forward(batch, ordered)
        )

    def _pool(
        self,
        hidden: torch.Tensor,
        batch: PackedBatch,
        seqlens: Sequence[int],
        skip: Sequence[int] | None,
    ) -> torch.Tensor:
        if self.model.is_placeholder(hidden):
            return self.head.project(self.model.pooled(batch.input_ids, seqlens, self.pooling))
        return super()._pool(hidden, batch, seqlens, skip)


def _hashed(seq: SequenceInput) -> SequenceInput:
    assert seq.pixels is not None
    pixels = np.ascontiguousarray(seq.pixels, dtype=np.float32)
    digest = hashlib.sha256(pixels.tobytes()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    ids = rng.integers(len(SPECIAL_TOKENS), 256 + len(SPECIAL_TOKENS), size=len(seq.ids))
    return SequenceInput([int(i) for i in ids])
