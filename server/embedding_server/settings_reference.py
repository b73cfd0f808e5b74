"""The server-flags reference page, generated from the settings model.

Every ``embedding-server serve`` flag and ``EMBEDDING_SERVER_*`` variable derives from a field
of :class:`~embedding_server.settings.ServerSettings` (``cli.py`` builds the parser from the
fields), so the reference page is rendered from the same fields: flag, variable, type,
default, limits and the field's description, which is also its ``--help`` text.

The gateway's flags (``embedding-server gateway``, :class:`GatewaySettings`) get their own
page the same way, ``docs/reference/gateway-flags.md`` (:func:`render_gateway_reference`).

This module imports nothing of the server but the settings: no torch, no HTTP stack.
:func:`render_reference` is pure; running the module rewrites both pages (``--check`` only
compares), and
``tests/server/test_settings_reference.py`` fails when the committed page drifts::

    python -m embedding_server.settings_reference
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, get_args, get_origin

from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from embedding_server.gateway.settings import GatewaySettings
from embedding_server.settings import EngineSettings, ServerSettings, unwrap_optional

REPO_ROOT = Path(__file__).resolve().parents[2]
OUTPUT_PATH = REPO_ROOT / "docs" / "reference" / "server-flags.md"
GATEWAY_OUTPUT_PATH = REPO_ROOT / "docs" / "reference" / "gateway-flags.md"
COMMAND = "python -m embedding_server.settings_reference"

_MARKDOWN_SPECIAL = set("\\`*_[]|")
_ENTITIES = {"<": "&lt;", ">": "&gt;", "&": "&amp;"}


def _text(value: str) -> str:
    """Prose for a Markdown table cell, shown exactly as written."""
    return "".join(
        _ENTITIES.get(char, "\\" + char if char in _MARKDOWN_SPECIAL else char) for char in value
    )


def flag_names(name: str, field: FieldInfo) -> list[str]:
    """The command-line spellings of a settings field (booleans take a ``--no-`` form)."""
    flag = "--" + name.replace("_", "-")
    if unwrap_optional(field.annotation) is bool:
        return [flag, "--no-" + flag.removeprefix("--")]
    return [flag]


def env_name(name: str, model: type[BaseSettings] = ServerSettings) -> str:
    """The environment variable of a settings field."""
    return str(model.model_config.get("env_prefix", "")) + name.upper()


_TYPE_NAMES = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    SecretStr: "string (secret: printed masked)",
}


def _type(field: FieldInfo) -> str:
    annotation = unwrap_optional(field.annotation)
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{choice}`" for choice in get_args(annotation))
    if get_origin(annotation) is list:
        (item,) = get_args(annotation)
        return f"comma-separated list of {_TYPE_NAMES.get(item, str(item))}s"
    return _TYPE_NAMES.get(annotation, str(annotation))


def _limits(field: FieldInfo) -> str:
    """Numeric bounds pydantic enforces (``gt``, ``ge``, ``lt``, ``le``) in words."""
    words = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    found = []
    for constraint in field.metadata:
        for key, symbol in words.items():
            bound = getattr(constraint, key, None)
            if bound is not None:
                found.append(f"{symbol} {bound}")
    return ", ".join(found)


def _default(field: FieldInfo) -> str:
    default = field.get_default(call_default_factory=True)
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "on" if default else "off"
    return f"`{default}`"


def _row(name: str, field: FieldInfo, model: type[BaseSettings] = ServerSettings) -> str:
    # An anchor per flag, so other pages can link straight to it (server-flags.md#max-batch-tokens).
    anchor = f'<a id="{name.replace("_", "-")}"></a>'
    flags = anchor + " / ".join(f"`{flag}`" for flag in flag_names(name, field))
    kind = _type(field)
    limits = _limits(field)
    if limits:
        kind += f" ({_text(limits)})"
    description = _text(" ".join((field.description or "").split()))
    cells = [flags, f"`{env_name(name, model)}`", kind, _default(field), description]
    return "| " + " | ".join(cells) + " |"


def _table(
    fields: Sequence[tuple[str, FieldInfo]], model: type[BaseSettings] = ServerSettings
) -> list[str]:
    lines = [
        "| Flag | Environment variable | Type | Default | Description |",
        "| --- | --- | --- | --- | --- |",
    ]
    return [*lines, *(_row(name, field, model) for name, field in fields), ""]


def render_reference() -> str:
    """The server-flags page for the current settings model, as Markdown."""
    fields = list(ServerSettings.model_fields.items())
    engine = [(n, f) for n, f in fields if n in EngineSettings.model_fields]
    server = [(n, f) for n, f in fields if n not in EngineSettings.model_fields]
    lines = [
        f"<!-- Generated from embedding_server.settings by `{COMMAND}`. Do not edit: edit the "
        "settings model and rerun. -->",
        "",
        "# Server flags",
        "",
        "Every setting of `embedding-server serve` is a flag and an environment variable; both "
        "derive from one settings model (`server/embedding_server/settings.py`), and this page "
        f"is generated from it (`{COMMAND}`), so it matches `embedding-server serve --help`.",
        "",
        "- A flag wins over its environment variable; a setting given by neither takes its "
        "default.",
        "- Booleans take `--name` / `--no-name` on the command line and `true` / `false` in "
        "the environment.",
        "- Lists are comma-separated (`--matryoshka-dimensions 256,512`), in the environment too.",
        "- An invalid value, or an invalid combination (a queue smaller than one batch, a "
        "request limit larger than the queue), stops the server at start with exit status 2 "
        "and one line naming the setting but never its value (settings often come from "
        "Secrets).",
        "- Settings left unset (dtype, pooling, lengths, batch budget) are decided from the "
        "model and the device at load; `GET /info` shows the resolved model configuration.",
        "",
        "## Engine settings",
        "",
        "The model, its numerics, batching and admission. The offline API takes the same "
        "settings by field name: `Engine.from_pretrained(model, max_batch_tokens=4096)`.",
        "",
        *_table(engine),
        "## HTTP server settings",
        "",
        "The HTTP server around the engine, its limits and its processes.",
        "",
        *_table(server),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


def render_gateway_reference() -> str:
    """The gateway-flags page (``embedding-server gateway``), as Markdown."""
    lines = [
        f"<!-- Generated from embedding_server.gateway.settings by `{COMMAND}`. Do not edit: "
        "edit the settings model and rerun. -->",
        "",
        "# Gateway flags",
        "",
        "Every setting of `embedding-server gateway` is a flag and an `EMBEDDING_GATEWAY_*` "
        "environment variable; both derive from one settings model "
        "(`server/embedding_server/gateway/settings.py`), and this page is generated from it "
        f"(`{COMMAND}`), so it matches `embedding-server gateway --help`. The gateway itself "
        "is described in [the gateway guide](../gateway.md).",
        "",
        "- A flag wins over its environment variable; a setting given by neither takes its "
        "default.",
        "- Lists are comma-separated, in the environment too.",
        "- An invalid value, or an invalid combination (static discovery without routes), "
        "stops the gateway at start with exit status 2 and one line naming the setting.",
        "",
        *_table(list(GatewaySettings.model_fields.items()), GatewaySettings),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or with ``--check`` compare) the reference page; return the exit status."""
    parser = argparse.ArgumentParser(
        prog=COMMAND, description="Generate the server-flags reference from the settings."
    )
    parser.add_argument("--output", type=Path, default=OUTPUT_PATH, help="Page to write.")
    parser.add_argument(
        "--check", action="store_true", help="Exit 1 if the page differs; write nothing."
    )
    parser.add_argument(
        "--gateway-output", type=Path, default=GATEWAY_OUTPUT_PATH, help="Gateway page to write."
    )
    args = parser.parse_args(argv)
    pages = [(args.output, render_reference()), (args.gateway_output, render_gateway_reference())]
    if args.check:
        stale = False
        for path, page in pages:
            current = path.read_text(encoding="utf-8") if path.exists() else ""
            if current != page:
                sys.stderr.write(f"{path} is out of date: run {COMMAND}\n")
                stale = True
        return 1 if stale else 0
    for path, page in pages:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
