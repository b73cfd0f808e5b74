"""A tiny GritLM checkpoint of parasail-ai/GritLM-7B-vllm's layout, and its authors' vectors.

The checkpoint is a 2-layer Mistral (GQA 4:2, a 4-token sliding window in its config, which
GritLM's embedding mode does not use) saved as ``architectures: ["GritLM"]``. Its tokenizer
is shaped as Mistral's sentencepiece one: a ``▁`` prepended to the text, spaces as ``▁``,
BPE pieces with byte fallback (``<0x0A>`` for a newline), BOS ``<s>`` added in front, and
the pieces GritLM's template tokenizes into (``▁<``, ``<``, ``|``, ``user``, ``embed``,
``>``), so ``<|user|>`` and ``<|embed|>`` are not special tokens, as on the Hub.

:func:`authors_vectors` computes what ``gritlm.GritLM.encode`` does in embedding mode:
``instruction + text`` tokenized with BOS, the model run with ``is_causal=False`` and no
sliding window, and the mean over the tokens after the first ``len(tokenize(instruction))``
(BOS and instruction), each text alone.
"""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, normalizers
from tokenizers.processors import TemplateProcessing
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerFast

from tests.support.models import _DECODER, _save_model, rewrite_checkpoint

WINDOW = 4
"""The config's sliding_window: shorter than the texts, so a windowed run would differ."""

_PIECES = ("▁<", "us", "use", "user", "em", "emb", "embe", "embed")
_MERGES = [
    ("▁", "<"),
    ("u", "s"),
    ("us", "e"),
    ("use", "r"),
    ("e", "m"),
    ("em", "b"),
    ("emb", "e"),
    ("embe", "d"),
]


def gritlm_tokenizer() -> Tokenizer:
    """Mistral's tokenizer shape with GritLM's template pieces (see the module docstring)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in ("▁", *string.ascii_letters, *string.digits, *".,?!'|<>", *_PIECES):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_MERGES, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def build_gritlm(path: Path) -> tuple[Path, Path]:
    """``(gritlm, mistral)``: the GritLM checkpoint at ``path / "gritlm"``, and the same
    weights as the plain MistralModel transformers saved (the reference's)."""
    mistral = path / "mistral"
    mistral.mkdir(parents=True, exist_ok=True)
    tok = gritlm_tokenizer()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=10**30,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    ).save_pretrained(str(mistral))
    _save_model(
        "mistral",
        mistral,
        tok.get_vocab_size(),
        seed=45,
        **{
            **_DECODER,
            "sliding_window": WINDOW,
            "rope_theta": 10000.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
        },
    )
    gritlm = rewrite_checkpoint(mistral, path / "gritlm", config={"architectures": ["GritLM"]})
    return gritlm, mistral


def gritlm_instruction(instruction: str) -> str:
    """The instruction prefix GritLM's README builds (its ``gritlm_instruction``)."""
    return f"<|user|>\n{instruction}\n<|embed|>\n" if instruction else "<|embed|>\n"


def authors_vectors(
    mistral: Path, items: list[tuple[str, str]], dtype: torch.dtype = torch.float32
) -> np.ndarray:
    """What ``GritLM.encode(text, instruction=gritlm_instruction(instruction))`` returns,
    unnormalized, for each ``(instruction, text)``: see the module docstring."""
    tok = AutoTokenizer.from_pretrained(str(mistral))
    model = AutoModel.from_pretrained(str(mistral), attn_implementation="eager", dtype=dtype)
    model.eval()
    model.config.is_causal = False
    model.config.sliding_window = None
    rows = []
    with torch.no_grad():
        for instruction, text in items:
            prefix = gritlm_instruction(instruction)
            ids = tok(prefix + text, return_tensors="pt")["input_ids"]
            skip = len(tok(prefix)["input_ids"])
            mask = torch.ones_like(ids)
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state[0]
            rows.append(hidden[skip:].float().mean(0).numpy())
    return np.stack(rows)
