"""``embedding-server inspect --verify``: what the server serves, checked against the model's
authors' own computation, on this machine, before anyone relies on it.

``inspect`` alone says how a model would be served; it cannot say that the vectors are right.
A family we implement natively is checked in our own test suite on tiny checkpoints of its
layout, but a user's checkpoint may hold a combination nobody has tried (a pooling file, a
prompt, a tokenizer template, a config key). So this runs the checkpoint twice on a fixed set
of probe texts and compares:

* the reference, as the authors run it: sentence-transformers when the checkpoint holds its
  pipeline (``modules.json``; ``CrossEncoder`` for task score), else transformers' own model
  class (``AutoModel``, ``AutoModelForSequenceClassification`` for task classify) pooled as
  the checkpoint declares (or as ``--pooling`` says, for a checkpoint with no
  sentence-transformers pooling config: then the flag is the only statement of the model
  card's pooling). The checkpoint's own code runs only with ``--trust-remote-code``; the
  reference is always float32 on the CPU, one text at a time, so nothing about this
  machine's kernels or padding enters it;
* ours: the offline :class:`~embedding_server.engine.Engine` built from the very settings
  ``serve`` takes, with their dtype, device and kernels.

Each kind of input has its own row (short, long, multilingual, instruction-prefixed,
truncated), so that a failure points at its cause: a prompt applied differently fails
``instruction`` alone, a truncation that keeps the wrong tokens ``truncated`` alone. What
cannot be compared honestly (a task with no reference computation here, an image tower,
per-request adapters) raises :class:`UnverifiableError` instead of passing.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from embedding_server.device.hub import locate_model
from embedding_server.device.instructions import GRITLM, InstructionFormat
from embedding_server.request.configuration import EngineInfo
from embedding_server.request.serving import ServingEngine
from embedding_server.request.truncation import Truncation
from embedding_server.settings import EngineSettings

ProbeKind = Literal["short", "long", "multilingual", "instruction", "truncated"]
Metric = Literal["cosine", "abs_diff"]
FloatArray = npt.NDArray[np.float64]

COSINE_THRESHOLDS: dict[str, float] = {"float32": 0.9999, "bfloat16": 0.999, "float16": 0.999}
"""Lowest cosine accepted per served dtype. float32 differs from the reference only by the
order of additions (packed vs padded, fused kernels), far above 0.9999; bfloat16 and float16
keep 8 and 11 mantissa bits, and their rounding through a deep stack costs a few parts in
10,000, so 0.999 is the bar our own parity tests hold them to."""

INT8_COSINE_THRESHOLD = 0.99
"""Lowest cosine accepted with ``--quantization int8``: the bar of the int8 quality test."""

SCORE_THRESHOLDS: dict[str, float] = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-2}
"""Largest absolute score (or class probability) difference accepted per served dtype."""

PROBE_MAX_TOKENS = 8192
"""The longest probe: the ``long`` and ``truncated`` probes are cut here when the model
admits more, so that a float32 CPU reference of a 32k-context decoder takes seconds, not
the memory of a 32k-token forward pass."""

SHORT = ("Hello world.", "a", "What is the capital of France?")
MULTILINGUAL = (
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Le renard brun rapide saute par-dessus le chien paresseux.",
    "敏捷的棕色狐狸跳过了懒狗。",
    "素早い茶色の狐が怠け者の犬を飛び越える。",
    "Быстрая коричневая лиса перепрыгивает через ленивую собаку.",
    "الثعلب البني السريع يقفز فوق الكلب الكسول.",
    "तेज़ भूरी लोमड़ी आलसी कुत्ते के ऊपर कूदती है। 🦊",
)
PARAGRAPH = (
    "Embedding models turn text into vectors, so that texts with similar meanings land "
    "close together. A search engine embeds every document once, stores the vectors, and "
    "at query time embeds the question and returns the nearest documents. "
)
INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages\nQuery: "
"""The instruction prefixed to the ``instruction`` probes of a checkpoint that declares no
prompts (e5-mistral's and gte-Qwen2's form)."""
INSTRUCTION_TASK = "Given a web search query, retrieve relevant passages"
"""The instruction of the ``instruction`` probes of a family whose texts carry it in its own
template (GritLM's ``<|user|>\n{instruction}\n<|embed|>\n``)."""
QUERIES = ("what is a fox?", "where do cats sleep?", "Wie hoch ist der Mount Everest?")
DOCUMENTS = (
    "The fox is a small omnivorous mammal.",
    "Cats sleep anywhere warm, often in the sun.",
    "Der Mount Everest ist 8.849 Meter hoch.",
)


class UnverifiableError(Exception):
    """The model cannot be checked against a reference here (what and why in the message)."""


@dataclass(frozen=True)
class KindResult:
    """One row of the table: the worst agreement over one kind of probe."""

    kind: ProbeKind
    inputs: int
    worst: float
    """The lowest cosine (metric cosine) or the largest absolute difference (abs_diff)."""
    passed: bool
    note: str = ""


@dataclass(frozen=True)
class Verification:
    """The outcome of comparing the served outputs with the reference's."""

    reference: str
    """What ran as the reference (library, class, dtype, device)."""
    served: str
    """What served ours (backend, dtype, device, attention kernel)."""
    metric: Metric
    threshold: float
    rows: list[KindResult]
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(row.passed for row in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "reference": self.reference,
            "served": self.served,
            "metric": self.metric,
            "threshold": self.threshold,
            "kinds": [
                {
                    "kind": r.kind,
                    "inputs": r.inputs,
                    "worst": r.worst,
                    "passed": r.passed,
                    "note": r.note,
                }
                for r in self.rows
            ],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class Probe:
    """Inputs of one kind and how both sides must treat them."""

    kind: ProbeKind
    texts: list[str]
    pairs: list[tuple[str, str]] | None = None
    prompt_name: str | None = None
    prompt: str | None = None
    note: str = ""
    prefixes: list[str] | None = None
    """Per text, the instruction template in front of it that the family's pooling leaves
    out (its authors' ``instruction`` argument); the texts sent hold it already."""


def default_threshold(settings: EngineSettings, info: EngineInfo, metric: Metric) -> float:
    """The bar for the served dtype (:data:`COSINE_THRESHOLDS`, :data:`SCORE_THRESHOLDS`)."""
    if metric == "cosine" and settings.quantization == "int8":
        return INT8_COSINE_THRESHOLD
    table = COSINE_THRESHOLDS if metric == "cosine" else SCORE_THRESHOLDS
    return table.get(info.dtype, table["bfloat16"])


def verify(
    engine: ServingEngine, settings: EngineSettings, *, threshold: float | None = None
) -> Verification:
    """Compare what ``engine`` (built from ``settings``, as ``serve`` builds it) serves with
    the reference on the probe set; :class:`UnverifiableError` when there is none."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    info = engine.info()
    _check_verifiable(info)
    path = _reference_files(settings)
    native = _native_reference(_config(path), settings.trust_remote_code)
    if info.backend == "native":
        _check_family(path, info, native)
    notes: list[str] = []
    if "image" in info.modalities:
        if native is None or native.text_features is None:
            raise UnverifiableError(
                f"{info.architecture} embeds images: image towers (and their text towers) "
                "are not verified yet"
            )
        notes.append("images are not verified: only the text tower's vectors are compared")
    limit = min(info.max_input_tokens, PROBE_MAX_TOKENS)
    served = f"{info.backend}, {info.dtype} on {info.device}, attention {info.attention}"
    if settings.quantization != "none":
        served += f", quantization {settings.quantization}"
    metric: Metric = "cosine" if info.task == "embed" else "abs_diff"
    bar = threshold if threshold is not None else default_threshold(settings, info, metric)
    trust = settings.trust_remote_code
    if info.task == "embed":
        reference = _embed_reference(path, info, settings, limit, trust, notes)
    else:
        reference = _score_reference(path, info, limit, trust)
    rows: list[KindResult] = []
    template = native.instruction if native is not None else None
    for probe in _probes(engine, info, limit, template):
        ours = _served(engine, info, probe, limit)
        theirs = reference.run(probe)
        if metric == "cosine":
            worst = float(_cosines(ours, theirs).min())
            passed = worst >= bar
        else:
            worst = float(np.abs(ours - theirs).max())
            passed = worst <= bar
        rows.append(KindResult(probe.kind, len(probe.texts), worst, passed, probe.note))
    return Verification(reference.name, served, metric, bar, rows, notes)


def _check_verifiable(info: EngineInfo) -> None:
    if info.backend == "fake":
        raise UnverifiableError("the fake backend has no weights: there is nothing to verify")
    if info.adapters:
        raise UnverifiableError(
            f"{info.architecture} chooses task LoRA adapters per request "
            f"({', '.join(info.adapters)}); outputs with adapters are not verified yet"
        )
    if info.task not in ("embed", "score", "classify"):
        raise UnverifiableError(
            f"task {info.task} is not verified yet (verified: embed, score, classify)"
        )
    if info.task == "embed" and "dense" not in info.outputs:
        raise UnverifiableError(
            f"this model serves {', '.join(info.outputs)} outputs without a dense vector; "
            "only dense vectors are verified yet"
        )
    if info.task == "score" and info.score_method != "cross_encoder":
        raise UnverifiableError(f"scores by {info.score_method} are not verified yet")
    if info.task == "score" and info.architecture.endswith("ForCausalLM"):
        # A language model scored from its answer-token logits in a published prompt
        # (Qwen3-Reranker, mxbai-rerank-v2): CrossEncoder would read a head it has not got.
        raise UnverifiableError(
            f"{info.architecture} is served as a yes/no reranker (its prompt, answer-token "
            "logits); yes/no rerankers are not verified yet"
        )


def _check_family(path: str, info: EngineInfo, native: NativeReference | None) -> None:
    """Refuse a native family whose authors' computation is neither sentence-transformers'
    nor transformers' (nor declared in :data:`NATIVE_REFERENCES`): compared with those, it
    would fail for being right."""
    from embedding_server.device.models import lookup

    instruction = getattr(lookup(_config(path)), "instruction", None)
    if instruction is not None and (native is None or native.instruction != instruction):
        raise UnverifiableError(
            f"{info.architecture} pools only the tokens after its {instruction.name} "
            "instruction template, as its authors' own package computes it; neither "
            "sentence-transformers nor transformers computes that, so it is not verified yet"
        )


# -- the probe set ---------------------------------------------------------------------------
def _fill(engine: ServingEngine, tokens: int) -> str:
    """:data:`PARAGRAPH` repeated to about ``tokens`` tokens of this model's tokenizer."""
    per = max(1, len(engine.tokenize(PARAGRAPH, add_special_tokens=False)[0]))
    return PARAGRAPH * max(1, math.ceil(tokens / per))


def _long(engine: ServingEngine, tokens: int) -> str:
    """The longest repetition of :data:`PARAGRAPH`'s words that stays within ``tokens``."""
    words = _fill(engine, tokens).split(" ")
    low, high = 1, len(words)
    while low < high:  # bisect on words: a tokenizer's counts are not additive
        mid = (low + high + 1) // 2
        if len(engine.tokenize(" ".join(words[:mid]))[0]) <= tokens:
            low = mid
        else:
            high = mid - 1
    return " ".join(words[:low])


def _probes(
    engine: ServingEngine,
    info: EngineInfo,
    limit: int,
    template: InstructionFormat | None = None,
) -> list[Probe]:
    long_text = _long(engine, max(1, (limit * 3) // 4))
    over = _fill(engine, limit * 2)
    clipped = f"clipped at {limit} tokens"
    if info.task == "score":
        return [
            Probe("short", list(QUERIES), list(zip(QUERIES, DOCUMENTS, strict=True))),
            Probe("long", [QUERIES[0]], [(QUERIES[0], long_text)]),
            Probe("multilingual", list(MULTILINGUAL[:-1]), list(pairwise(MULTILINGUAL))),
            Probe("truncated", [QUERIES[0]], [(QUERIES[0], over)], note=clipped),
        ]
    probes = [
        Probe("short", list(SHORT)),
        Probe("long", [long_text]),
        Probe("multilingual", list(MULTILINGUAL)),
    ]
    if info.task == "embed":
        if info.prompts:
            for name in info.prompts:
                probe = Probe("instruction", list(QUERIES), prompt_name=name, note=f"prompt {name}")
                probes.append(probe)
        else:
            note = "no prompts declared: an 'Instruct: ...' prefix"
            probes.append(Probe("instruction", list(QUERIES), prompt=INSTRUCTION, note=note))
    probes.append(Probe("truncated", [over], note=clipped))
    if template is not None and info.task == "embed":
        return [_templated(probe, template) for probe in probes]
    return probes


def _templated(probe: Probe, template: InstructionFormat) -> Probe:
    """``probe`` as a family whose texts carry its instruction template sends it: the
    instruction probe with :data:`INSTRUCTION_TASK`, the others with the template alone."""
    task = INSTRUCTION_TASK if probe.kind == "instruction" else ""
    prefix = template.example(task, "")
    note = f"{template.name}'s template" + (f", {probe.note}" if probe.note else "")
    if probe.kind == "instruction":
        note = f"{template.name}'s template with an instruction"
    return Probe(
        probe.kind,
        [template.example(task, text) for text in probe.texts],
        note=note,
        prefixes=[prefix] * len(probe.texts),
    )


# -- our side ---------------------------------------------------------------------------------
def _truncation(info: EngineInfo, limit: int) -> Truncation:
    return Truncation(max_tokens=limit if limit < info.max_input_tokens else None)


def _served(engine: ServingEngine, info: EngineInfo, probe: Probe, limit: int) -> FloatArray:
    truncate = _truncation(info, limit)
    if info.task == "score":
        assert probe.pairs is not None
        a, b = [p[0] for p in probe.pairs], [p[1] for p in probe.pairs]
        return np.asarray(engine.score(a, b, truncate=truncate), dtype=np.float64)
    if info.task == "classify":
        result = engine.classify(probe.texts, truncate=truncate)
        return np.asarray(result.probs, dtype=np.float64)
    options: dict[str, Any] = {"truncate": truncate}
    if probe.prompt_name is not None:
        options["prompt_name"] = probe.prompt_name
    if probe.prompt is not None:
        options["prompt"] = probe.prompt
    return np.asarray(engine.embed(probe.texts, **options), dtype=np.float64)


# -- the reference ----------------------------------------------------------------------------
@dataclass
class Reference:
    name: str
    run: Callable[[Probe], FloatArray]


REFERENCE_FILES = ("*.json", "*.py", "*.txt", "*.model", "*.tiktoken", "*/*.json", "*/*.py")
"""What a Hub snapshot needs beyond what the server fetched for the reference to load as its
authors' libraries load it (sentence_bert_config.json, a module's own code, tokenizer
vocabularies); never weights, which the server fetched already."""


def _reference_files(settings: EngineSettings) -> str:
    """The local directory the reference loads, found as the server found it (the packaged
    default, a local directory, a Hub snapshot); a Hub snapshot, served at its commit, gets
    :data:`REFERENCE_FILES` fetched into it."""
    source = locate_model(settings.model, revision=settings.revision, cache_dir=settings.cache_dir)
    if source.repo_id is None:
        return str(source.path)
    from huggingface_hub import snapshot_download

    path: str = snapshot_download(
        source.repo_id,
        revision=source.revision,
        cache_dir=source.cache_dir,
        allow_patterns=list(REFERENCE_FILES),
    )
    return path


def _has_sentence_transformers(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "modules.json"))


def _config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as file:
        config: dict[str, Any] = json.load(file)
    return config


def _remote_code_note(path: str, trust: bool) -> str:
    """Whether the checkpoint's own code ran, for the reference's description."""
    if "auto_map" not in _config(path):
        return ""
    return "; its own code" if trust else "; its own code not run (no --trust-remote-code)"


@contextmanager
def _reference_loading(trust: bool) -> Iterator[None]:
    """Loading the reference: what a checkpoint the libraries cannot load raises becomes
    :class:`UnverifiableError`, with a hint at ``--trust-remote-code`` when it was off."""
    try:
        yield
    except (OSError, ValueError, ImportError, KeyError, TypeError) as error:
        hint = "" if trust else " (a checkpoint that needs its own code needs --trust-remote-code)"
        raise UnverifiableError(
            f"the reference could not be loaded: {type(error).__name__}: {error}{hint}"
        ) from error


def _embed_reference(
    path: str,
    info: EngineInfo,
    settings: EngineSettings,
    limit: int,
    trust: bool,
    notes: list[str],
) -> Reference:
    dims = info.dimensions
    config = _config(path)
    builder = _native_reference(config, trust)
    if builder is not None:
        _check_pipeline_is_pooling_only(path)
    elif _has_sentence_transformers(path):
        from sentence_transformers import SentenceTransformer

        with _reference_loading(trust):
            st = SentenceTransformer(
                path,
                device="cpu",
                trust_remote_code=trust,
                model_kwargs={"dtype": torch.float32},
            )
        st.float()
        _authors_special_tokens(st.tokenizer, info, notes)
        if st.max_seq_length is not None and st.max_seq_length != info.max_input_tokens:
            notes.append(
                f"sentence-transformers' max_seq_length is {st.max_seq_length}, the server's "
                f"limit {info.max_input_tokens}; the reference was run at the server's"
            )
        st.max_seq_length = limit

        def run_st(probe: Probe) -> FloatArray:
            with torch.inference_mode():
                out = st.encode(
                    probe.texts,
                    prompt_name=probe.prompt_name,
                    prompt=probe.prompt,
                    batch_size=1,
                    convert_to_numpy=True,
                    normalize_embeddings=False,
                )
            return _first(np.asarray(out, dtype=np.float64), dims)

        name = "sentence-transformers SentenceTransformer, float32 on cpu"
        return Reference(name + _remote_code_note(path, trust), run_st)

    from transformers import AutoModel, AutoTokenizer

    pooling = settings.pooling if settings.pooling != "auto" else info.pooling
    with _reference_loading(trust):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
        if builder is not None:
            model = builder.load(path, config).eval()
        else:
            model = AutoModel.from_pretrained(
                path, dtype=torch.float32, trust_remote_code=trust
            ).eval()
    model.float()
    bidirectional = builder is not None and builder.bidirectional
    features = builder.text_features if builder is not None else None
    if builder is not None:
        notes.append(f"the reference is {builder.description}")
    _authors_special_tokens(tokenizer, info, notes)
    source = "--pooling" if settings.pooling != "auto" else "as the checkpoint declares"
    if features is None:
        notes.append(f"the reference pools {pooling} ({source}): no sentence-transformers pooling")

    def run_hf(probe: Probe) -> FloatArray:
        rows = []
        for i, text in enumerate(probe.texts):
            full = (probe.prompt or "") + text
            enc = tokenizer(full, truncation=True, max_length=limit, return_tensors="pt")
            skip = len(tokenizer(probe.prefixes[i])["input_ids"]) if probe.prefixes else 0
            if bidirectional:  # additive: zero everywhere, every token sees every token
                n = enc["input_ids"].shape[1]
                enc["attention_mask"] = torch.zeros(1, 1, n, n)
            with torch.inference_mode():
                if features is not None:
                    rows.append(features(model, enc["input_ids"]).float().numpy())
                    continue
                states = model(**enc)[0][0].float()
            rows.append(_pool(states[skip:], pooling).numpy())
        return _first(np.stack(rows).astype(np.float64), dims)

    name = f"transformers {type(model).__name__}, float32 on cpu"
    return Reference(name + _remote_code_note(path, trust), run_hf)


@dataclass(frozen=True)
class NativeReference:
    """transformers' computation of a family whose Hub checkpoints run only their authors'
    code (``auto_map``): the same math under a transformers class, which the reference runs
    when that code is not run (no ``--trust-remote-code``)."""

    description: str
    load: Callable[[str, dict[str, Any]], Any]
    """Loads the checkpoint directory (its ``config.json`` given) as that class, float32."""
    bidirectional: bool = False
    """Every token attends to every token of its text (an all-zero additive 4-D mask, eager
    attention), where the class itself is a causal decoder."""
    instruction: InstructionFormat | None = None
    """The template the family's texts carry their instruction in, which its authors leave
    out of the pooling (BOS and the template's tokens): the probes are sent in it."""
    text_features: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    """A dual encoder's text vector from ``(model, input_ids [1, n])``, its projection
    included, in place of pooling token states; the text side of an image model."""


_REMOTE_CONFIG_KEYS = ("model_type", "architectures", "auto_map", "transformers_version")


def _as_config(model_type: str, config: dict[str, Any], **overrides: Any) -> Any:
    """``config.json`` read as transformers' ``model_type`` config, the remote code's own
    keys dropped."""
    from transformers import AutoConfig

    kept = {k: v for k, v in config.items() if k not in _REMOTE_CONFIG_KEYS}
    return AutoConfig.for_model(model_type, **{**kept, **overrides})


def _llama_bidirectional(path: str, config: dict[str, Any]) -> Any:
    from transformers import LlamaModel

    return LlamaModel.from_pretrained(
        path,
        config=_as_config("llama", config),
        dtype=torch.float32,
        attn_implementation="eager",
    )


def _auto_model(path: str, config: dict[str, Any]) -> Any:
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, dtype=torch.float32)


def _clip_text(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """CLIP's ``get_text_features``: the projected state at the end-of-text token."""
    return model.get_text_features(input_ids=ids).pooler_output[0]  # type: ignore[no-any-return]


def _siglip_text(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """SigLIP's ``get_text_features`` on the text padded to ``max_length`` with the pad id
    and no attention mask, as its processor is documented to be called and as it was
    trained (the tower pads itself)."""
    text = model.config.text_config
    pad = torch.full((1, text.max_position_embeddings - ids.shape[1]), text.pad_token_id)
    padded = torch.cat([ids, pad.to(ids.dtype)], dim=1)
    return model.get_text_features(input_ids=padded).pooler_output[0]  # type: ignore[no-any-return]


def _gritlm(path: str, config: dict[str, Any]) -> Any:
    """GritLM's embedding mode: its authors run the Mistral body with ``is_causal=False``
    and no sliding window."""
    from transformers import MistralModel

    return MistralModel.from_pretrained(
        path,
        config=_as_config("mistral", config, is_causal=False, sliding_window=None),
        dtype=torch.float32,
        attn_implementation="eager",
    )


def _gte_from_new(path: str, config: dict[str, Any]) -> Any:
    """Alibaba's new-impl (``model_type: new``) as transformers' GteModel, whose weight names
    it shares: only the rope keys differ. new-impl's fixed ``ntk`` scaling is, from the
    first position, a base ``theta * factor`` with the frequencies divided by
    ``factor ** (2 / head_dim)``: transformers' ``linear`` rope with those two numbers."""
    from transformers import GteModel

    theta = float(config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or {}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling:
        if scaling.get("type") != "ntk":
            raise UnverifiableError(f"new rope_scaling {scaling!r} has no reference computation")
        factor = float(scaling["factor"])
        head_dim = int(config["hidden_size"]) // int(config["num_attention_heads"])
        rope = {
            "rope_type": "linear",
            "factor": factor ** (2 / head_dim),
            "rope_theta": theta * factor,
        }
    kept = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    return GteModel.from_pretrained(
        path,
        config=_as_config("gte", kept, rope_parameters=rope),
        dtype=torch.float32,
        attn_implementation="eager",
    )


NATIVE_REFERENCES: dict[str, NativeReference] = {
    "llama_bidirec": NativeReference(
        "transformers' LlamaModel attending bidirectionally (NVIDIA's LlamaBidirectionalModel "
        "is a LlamaModel without the causal mask)",
        _llama_bidirectional,
        bidirectional=True,
    ),
    "new": NativeReference(
        "transformers' GteModel, the same math as Alibaba's new-impl, its rope keys translated",
        _gte_from_new,
    ),
    "GritLM": NativeReference(
        "transformers' MistralModel attending bidirectionally without a sliding window, "
        "mean-pooled over the tokens after BOS and the instruction template, as GritLM's "
        "own gritlm package computes it",
        _gritlm,
        bidirectional=True,
        instruction=GRITLM,
    ),
    "clip": NativeReference(
        "transformers' CLIPModel.get_text_features (the text tower)",
        _auto_model,
        text_features=_clip_text,
    ),
    **{
        name: NativeReference(
            f"transformers' {cls}.get_text_features (the text tower), the text padded to "
            "max_length without a mask",
            _auto_model,
            text_features=_siglip_text,
        )
        for name, cls in (("siglip", "SiglipModel"), ("siglip2", "Siglip2Model"))
    },
}
"""The declared reference per architecture name or ``model_type`` (the name first) of a
family that transformers runs only under another class, or whose authors pool in a way
neither sentence-transformers nor transformers does; looked up only when the checkpoint's
own code is not run."""


def _native_reference(config: dict[str, Any], trust: bool) -> NativeReference | None:
    if trust and "auto_map" in config:
        return None  # the authors' own code is the reference
    for name in (*(config.get("architectures") or ()), config.get("model_type")):
        if str(name) in NATIVE_REFERENCES:
            return NATIVE_REFERENCES[str(name)]
    return None


_POOLING_ONLY = ("Transformer", "Pooling", "Normalize")
"""sentence-transformers modules whose computation a declared reference makes as well (the
body, the declared pooling; normalization does not change a cosine)."""


def _check_pipeline_is_pooling_only(path: str) -> None:
    """A declared reference is the body and its pooling: a pipeline that adds more (a Dense
    layer) cannot be compared with it."""
    if not _has_sentence_transformers(path):
        return
    with open(os.path.join(path, "modules.json"), encoding="utf-8") as file:
        modules = json.load(file)
    extra = [m["type"] for m in modules if not str(m["type"]).endswith(_POOLING_ONLY)]
    if extra:
        raise UnverifiableError(
            f"the sentence-transformers pipeline adds {', '.join(extra)} after the body, which "
            "needs the checkpoint's own code to load (pass --trust-remote-code if you trust it)"
        )


def _authors_special_tokens(tokenizer: Any, info: EngineInfo, notes: list[str]) -> None:
    """Give the reference's tokenizer the special tokens the server adds where they are not
    ``tokenizer.json``'s own: there the pinned transformers departs from the authors (it
    drops ``tokenizer_config.json``'s ``add_eos_token``, and the checkpoint's tokenizer code
    that appends gte-Qwen2's ``<|endoftext|>`` is not run), and their model cards add the
    tokens by hand. Which tokens those are is checked against the model cards' own code in
    the tokenizer tests; here the rest of the computation is compared."""
    from tokenizers import processors

    tokens = info.special_tokens
    if tokens.source == "tokenizer.json":
        return
    backend = tokenizer.backend_tokenizer
    single = " ".join([*tokens.before, "$A", *tokens.after])
    ids = [(t, backend.token_to_id(t)) for t in dict.fromkeys([*tokens.before, *tokens.after])]
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=ids)
    notes.append(
        f"the reference tokenizer was given the server's {tokens.template} (from "
        f"{tokens.source}), which the pinned transformers leaves out and the model card adds"
    )


def _pool(states: torch.Tensor, method: str) -> torch.Tensor:
    """One sequence's token states ``[n, hidden]`` pooled as sentence-transformers does."""
    n = states.shape[0]
    if method == "cls":
        return states[0]
    if method == "last":
        return states[-1]
    if method == "max":
        return states.max(dim=0).values
    if method == "mean":
        return states.mean(dim=0)
    if method == "mean_sqrt_len":
        return states.sum(dim=0) / math.sqrt(n)
    if method == "weightedmean":
        weights = torch.arange(1, n + 1, dtype=states.dtype).unsqueeze(1)
        return (states * weights).sum(dim=0) / weights.sum()
    raise UnverifiableError(f"pooling {method!r} has no reference computation")


def _first(vectors: FloatArray, dims: int) -> FloatArray:
    """The reference's first ``dims`` dimensions (Matryoshka truncation, as served)."""
    if vectors.shape[1] < dims:
        raise UnverifiableError(
            f"the reference makes {vectors.shape[1]}-dimensional vectors and the server "
            f"{dims}-dimensional ones: they are not the same model output"
        )
    return vectors[:, :dims]


def _score_reference(path: str, info: EngineInfo, limit: int, trust: bool) -> Reference:
    if info.task == "score":
        from sentence_transformers import CrossEncoder

        with _reference_loading(trust):
            ce = CrossEncoder(
                path,
                device="cpu",
                max_length=limit,
                trust_remote_code=trust,
                model_kwargs={"dtype": torch.float32},
            )
        ce.model.float()

        def run_ce(probe: Probe) -> FloatArray:
            assert probe.pairs is not None
            with torch.inference_mode():
                out = ce.predict(probe.pairs, batch_size=1, convert_to_numpy=True)
            return np.asarray(out, dtype=np.float64).reshape(-1)

        name = "sentence-transformers CrossEncoder, float32 on cpu"
        return Reference(name + _remote_code_note(path, trust), run_ce)

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    with _reference_loading(trust):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=torch.float32, trust_remote_code=trust
        ).eval()
    model.float()

    def run_classifier(probe: Probe) -> FloatArray:
        rows = []
        for text in probe.texts:
            enc = tokenizer(text, truncation=True, max_length=limit, return_tensors="pt")
            with torch.inference_mode():
                logits = model(**enc).logits[0].float()
            probs = torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, -1)
            rows.append(probs.numpy())
        return np.stack(rows).astype(np.float64)

    name = f"transformers {type(model).__name__} (softmax), float32 on cpu"
    return Reference(name + _remote_code_note(path, trust), run_classifier)


def _cosines(a: FloatArray, b: FloatArray) -> FloatArray:
    if a.shape != b.shape:
        raise UnverifiableError(f"served outputs {a.shape} and reference {b.shape} differ")
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.asarray(np.sum(a * b, axis=1) / np.maximum(norms, 1e-30), dtype=np.float64)


def format_verification(result: Verification) -> str:
    """The comparison as an aligned table, one row per kind of probe, for people."""
    header = "lowest cosine" if result.metric == "cosine" else "largest difference"
    rows: dict[ProbeKind, list[KindResult]] = {}
    for row in result.rows:
        rows.setdefault(row.kind, []).append(row)
    table: list[tuple[str, str, str, str, str]] = [("kind", "inputs", header, "", "")]
    for kind, group in rows.items():
        pick = min if result.metric == "cosine" else max
        worst = pick(group, key=lambda r: r.worst)
        notes = ", ".join(r.note for r in group if r.note)
        table.append(
            (
                kind,
                str(sum(r.inputs for r in group)),
                f"{worst.worst:.6f}" if result.metric == "cosine" else f"{worst.worst:.2e}",
                "ok" if all(r.passed for r in group) else "FAIL",
                notes,
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines = [
        f"reference  {result.reference}",
        f"served     {result.served}",
        "",
    ]
    for cells in table:
        line = "  ".join(
            cell.rjust(width) if column in (1, 2) else cell.ljust(width)
            for column, (cell, width) in enumerate(zip(cells, [*widths, 0], strict=True))
        )
        lines.append(line.rstrip())
    lines.extend(result.notes)
    comparison = ">=" if result.metric == "cosine" else "<="
    outcome = "passed" if result.passed else "FAILED"
    lines.append(f"verification {outcome}: every kind must be {comparison} {result.threshold:g}")
    return "\n".join(lines) + "\n"


__all__ = [
    "COSINE_THRESHOLDS",
    "SCORE_THRESHOLDS",
    "KindResult",
    "UnverifiableError",
    "Verification",
    "format_verification",
    "verify",
]
