"""Tiny decoder checkpoints whose special tokens are not all in ``tokenizer.json``.

* :func:`e5_mistral_shaped`: intfloat/e5-mistral-7b-instruct's layout. Its ``tokenizer.json``
  template adds ``<s>`` only; its ``tokenizer_config.json`` says ``LlamaTokenizer`` with
  ``add_bos_token: true, add_eos_token: true``, and its model card appends ``</s>`` before
  last-token pooling.
* :func:`gte_qwen2_shaped`: Alibaba-NLP/gte-Qwen2-7B-instruct's layout. A bidirectional
  ``qwen2`` (``is_causal: false``) whose ``tokenizer.json`` post-processor is ``ByteLevel``
  alone; ``<|endoftext|>`` is appended by its own ``tokenization_qwen.Qwen2TokenizerFast``
  (named in ``auto_map``, ``add_eos_token: true``), with sentence-transformers files pooling
  the last token.
* :func:`agreeing`: a Llama-family config whose switches say what its template does.

The weights are :func:`~tests.support.models.build_decoder`'s; only the tokenizer files and
config keys differ.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, processors
from transformers import PreTrainedTokenizerFast

from tests.support.models import build_decoder, byte_tokenizer

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
"""As many specials as build_decoder's tokenizer has, so the byte ids and the embedding
table's size are the same; ``<|endoftext|>`` is Qwen2's EOS and pad."""

TOKENIZATION_QWEN = '''\
"""gte-Qwen2's tokenization_qwen.py, restated for transformers 5.

The authors' file subclasses transformers 4's Qwen2TokenizerFast (which read tokenizer.json as
it is) and rebuilds the post-processor from the add_eos_token switch at every load, as
transformers 4's LlamaTokenizerFast did. transformers 5 has no such module, so this subclasses
its generic fast tokenizer, which reads tokenizer.json as it is.
"""

from tokenizers import processors
from transformers import TokenizersBackend


class Qwen2Tokenizer(TokenizersBackend):
    pass


class Qwen2TokenizerFast(TokenizersBackend):
    slow_tokenizer_class = Qwen2Tokenizer

    @classmethod
    def convert_to_native_format(cls, **kwargs):
        return TokenizersBackend.convert_to_native_format(**kwargs)

    def __init__(self, *args, add_bos_token=False, add_eos_token=False, **kwargs):
        super().__init__(*args, **kwargs)
        self._add_bos_token = add_bos_token
        self._add_eos_token = add_eos_token
        self.update_post_processor()

    @property
    def add_bos_token(self):
        return self._add_bos_token

    @property
    def add_eos_token(self):
        return self._add_eos_token

    def update_post_processor(self):
        bos, eos = self.bos_token, self.eos_token
        if bos is None and self.add_bos_token:
            raise ValueError("add_bos_token = True but bos_token = None")
        if eos is None and self.add_eos_token:
            raise ValueError("add_eos_token = True but eos_token = None")
        first = [f"{bos}:0"] if self.add_bos_token else []
        first += ["$A:0"] + ([f"{eos}:0"] if self.add_eos_token else [])
        second = [f"{bos}:1"] if self.add_bos_token else []
        second += ["$B:1"] + ([f"{eos}:1"] if self.add_eos_token else [])
        single, pair = " ".join(first), " ".join(first + second)
        special_tokens = []
        if self.add_bos_token:
            special_tokens.append((bos, self.bos_token_id))
        if self.add_eos_token:
            special_tokens.append((eos, self.eos_token_id))
        self._tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special_tokens
        )
'''


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data, indent=2))


def _set_post_processor(path: Path, processor: Any) -> None:
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.post_processor = processor
    tok.save(str(path / "tokenizer.json"))


def llama_shaped(path: Path, *, add_bos: bool | None, add_eos: bool | None) -> Path:
    """A tiny Mistral whose tokenizer.json adds ``<s>`` only (``<s> $A``, pairs
    ``<s> $A <s> $B``, as Mistral's does) and whose tokenizer_config.json names
    LlamaTokenizer with the given switches (None: left out)."""
    build_decoder(path, "mistral")
    _set_post_processor(
        path,
        processors.TemplateProcessing(
            single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
        ),
    )
    _edit_json(
        path / "tokenizer_config.json",
        backend=None,
        tokenizer_class="LlamaTokenizer",
        add_bos_token=add_bos,
        add_eos_token=add_eos,
    )
    return path


def e5_mistral_shaped(path: Path) -> Path:
    """intfloat/e5-mistral-7b-instruct's tokenizer shape (module docstring)."""
    return llama_shaped(path, add_bos=True, add_eos=True)


def agreeing(path: Path) -> Path:
    """A Llama-family config whose switches say what tokenizer.json does (``<s> $A``)."""
    return llama_shaped(path, add_bos=True, add_eos=False)


def gte_qwen2_shaped(path: Path) -> Path:
    """Alibaba-NLP/gte-Qwen2-7B-instruct's shape (module docstring)."""
    build_decoder(path, "qwen2", is_causal=False)
    tok = byte_tokenizer(QWEN_SPECIALS, "$A", [])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=32768,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    ).save_pretrained(str(path))
    _edit_json(
        path / "tokenizer_config.json",
        backend=None,
        tokenizer_class="Qwen2Tokenizer",
        auto_map={
            "AutoTokenizer": [
                "tokenization_qwen.Qwen2Tokenizer",
                "tokenization_qwen.Qwen2TokenizerFast",
            ]
        },
        add_eos_token=True,
        bos_token=None,
    )
    (path / "tokenization_qwen.py").write_text(TOKENIZATION_QWEN)
    _edit_json(
        path / "config.json",
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=None,
        auto_map={"AutoModel": "modeling_qwen.Qwen2Model"},
    )
    (path / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ]
        )
    )
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_lasttoken": True})
    )
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    return path
