"""A model's tokenizer: the fast (Rust) tokenizer, through ``transformers.AutoTokenizer`` so
that tokenizer_config.json's switches (``add_eos_token`` ...) apply exactly as
sentence-transformers sees them, with the special tokens its authors compute
(``request/special_tokens.py``) and its declared ``model_max_length``; the original SigLIP's,
which transformers has only in Python, built by :mod:`.siglip_text`. A checkpoint's own
tokenizer code is never run; a model without a fast tokenizer is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from tokenizers import Tokenizer

from embedding_server.device import siglip_text
from embedding_server.device.model_config import read_json
from embedding_server.errors import UnsupportedModelError
from embedding_server.request.special_tokens import SpecialTokens, apply_template, describe_tokens


def load_tokenizer(path: Path) -> tuple[Tokenizer, int | None]:
    """The fast tokenizer and its declared ``model_max_length`` (None when unset/absurd)."""
    loaded = read_tokenizer(path)
    return loaded.tokenizer, loaded.max_length


class ReadTokenizer(NamedTuple):
    tokenizer: Tokenizer
    max_length: int | None
    """``model_max_length`` (None when unset/absurd)."""
    special_tokens: SpecialTokens
    """What a text gets and where it came from (``special_tokens.py``)."""


def read_tokenizer(path: Path) -> ReadTokenizer:
    """The fast tokenizer, with the special tokens its checkpoint's authors computed
    (``special_tokens.apply_template``: tokenizer_config.json's switches, or the template of
    the checkpoint's own tokenizer code), and its declared ``model_max_length``."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoTokenizer

    config = read_json(path / "tokenizer_config.json")
    if isinstance(config, dict) and config.get("tokenizer_class") == siglip_text.TOKENIZER_CLASS:
        tok, max_len = siglip_text.siglip_tokenizer(path, config)
        return ReadTokenizer(tok, max_len, describe_tokens(tok))
    try:
        # Never the checkpoint's own tokenizer code (only the Rust tokenizer is used), and
        # said explicitly: left unset, transformers prompts on stdin for a config with
        # auto_map, which blocks a server with no terminal.
        hf_tok = AutoTokenizer.from_pretrained(str(path), use_fast=True, trust_remote_code=False)
    except (OSError, ValueError, StrictDataclassError, ImportError) as exc:
        # A config transformers rejects, or a tokenizer class that needs a library this
        # server does not install.
        raise UnsupportedModelError(f"cannot load a tokenizer from {path}: {exc}") from exc
    if not getattr(hf_tok, "is_fast", False):
        raise UnsupportedModelError(
            f"{path} has no fast (Rust) tokenizer; convert it with "
            "transformers and save tokenizer.json"
        )
    max_len = getattr(hf_tok, "model_max_length", None)
    sane = int(max_len) if isinstance(max_len, int) and 0 < max_len < 10**7 else None
    backend: Tokenizer = hf_tok.backend_tokenizer
    specials = apply_template(
        backend,
        tokenizer_config=config if isinstance(config, dict) else {},
        model_config=read_json(path / "config.json") or {},
        bos_token=_token_text(hf_tok.bos_token),
        eos_token=_token_text(hf_tok.eos_token),
    )
    return ReadTokenizer(backend, sane, specials)


def _token_text(token: object) -> str | None:
    return token if isinstance(token, str) and token else None
