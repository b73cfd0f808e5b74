"""``embedding-server``: the command line, generated from the one settings model.

Flags are not declared here: every field of :class:`ServerSettings` becomes ``--field-name``
(booleans ``--x/--no-x``, lists comma-separated) with the field's description as its help,
so a new setting is a flag and an ``EMBEDDING_SERVER_*`` variable the moment it is added.
Flags the user did not pass are left out, so environment variables and defaults apply
underneath them. A bad setting ends the process before anything loads, with one line that
names the flag and the variable and no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import types
from collections.abc import MutableMapping, Sequence
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsError

from embedding_server.settings import DEFAULT_MODEL, ServerSettings

PROG = "embedding-server"
ENV_PREFIX = "EMBEDDING_SERVER_"

EXIT_BAD_SETTINGS = 2
"""Exit status for invalid settings (argparse's own status for usage errors)."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _unwrap_optional(annotation: Any) -> Any:
    """``X | None`` -> ``X``; anything else unchanged."""
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def _add_field(group: argparse._ArgumentGroup, name: str, field: FieldInfo) -> None:
    annotation = _unwrap_optional(field.annotation)
    description = (field.description or "").replace("%", "%%")
    default = field.get_default(call_default_factory=True)
    details = [f"env {_env(name)}"]
    if default is not None and annotation is not bool:
        details.append(f"default {default}")
    kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
    if annotation is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
        if default is not None:
            details.append(f"default {'on' if default else 'off'}")
    elif get_origin(annotation) is list:
        kwargs["metavar"] = "A,B,..."
        kwargs["type"] = _comma_list
    elif get_origin(annotation) is Literal:
        # Choices are shown, but validated by the settings model so every bad value is
        # reported the same way (flag + variable named, one line).
        kwargs["metavar"] = "{" + ",".join(str(c) for c in get_args(annotation)) + "}"
    else:
        kwargs["metavar"] = {int: "N", float: "SECONDS" if "timeout" in name else "X"}.get(
            annotation, name.split("_")[-1].upper()
        )
    kwargs["help"] = f"{description} [{'; '.join(details)}]"
    group.add_argument(_flag(name), **kwargs)


def _comma_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def build_parser(settings_model: type[BaseSettings] = ServerSettings) -> argparse.ArgumentParser:
    """The whole command line: ``embedding-server serve [flags]``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="A continuous-batching embedding server with OpenAI-compatible, "
        "Cohere-style and vLLM-style HTTP endpoints.",
        epilog=f"Run '{PROG} serve --help' for every setting. Each flag can also be set with "
        f"an {ENV_PREFIX}* environment variable; a flag wins over its variable.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = commands.add_parser(
        "serve",
        help="Load a model and serve it over HTTP.",
        description="Load an embedding model and serve it over HTTP until SIGTERM/SIGINT, "
        "then finish in-flight requests and exit 0. With no flags it serves the "
        f"packaged all-MiniLM-L6-v2 ('{DEFAULT_MODEL}') on 127.0.0.1:8000.",
    )
    group = serve.add_argument_group("settings")
    for name, field in settings_model.model_fields.items():
        _add_field(group, name, field)
    return parser


def format_settings_error(error: ValidationError | SettingsError) -> str:
    """One line that names each offending setting by flag and variable."""
    if isinstance(error, SettingsError):
        return f"invalid settings: {error}"
    problems: dict[tuple[str, str], str] = {}
    for item in error.errors():
        message = str(item["msg"]).removeprefix("Value error, ")
        loc = item.get("loc") or ()
        if not loc:
            problems.setdefault(("", message), message)
            continue
        name = str(loc[0])
        # The value is not repeated: settings are often fed from Secrets, and this line
        # goes to the pod's log. The flag, the variable and the reason say what to fix.
        # A list setting reports each bad element; name the setting once.
        problems.setdefault((name, message), f"{_flag(name)} / {_env(name)}: {message}")
    return "invalid settings: " + "; ".join(problems.values())


def load_settings(argv: Sequence[str] | None = None) -> ServerSettings:
    """Parse argv (flags win over ``EMBEDDING_SERVER_*`` variables) into settings.

    Raises ``SystemExit`` with :data:`EXIT_BAD_SETTINGS` after writing one line to stderr
    when a setting is invalid.
    """
    parser = build_parser()
    namespace = parser.parse_args(argv)
    given = {k: v for k, v in vars(namespace).items() if k in ServerSettings.model_fields}
    try:
        settings = ServerSettings(**given)
    except (ValidationError, SettingsError) as error:
        sys.stderr.write(f"{PROG}: error: {format_settings_error(error)}\n")
        raise SystemExit(EXIT_BAD_SETTINGS) from None
    local = os.path.expanduser(settings.model)
    if settings.model.startswith(("/", ".", "~")) and not os.path.isdir(local):
        sys.stderr.write(
            f"{PROG}: error: invalid settings: --model / {_env('model')}: no such model directory\n"
        )
        raise SystemExit(EXIT_BAD_SETTINGS)
    return settings


PROCESS_ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Environment the server process sets for itself unless the user set it already.

``OMP_WAIT_POLICY=PASSIVE``: an idle OpenMP worker sleeps at once instead of spinning for
the next parallel region. torch's CPU kernels (OpenMP, and MKL and oneDNN on top of it) spin
by default, and with a forward pass issuing a region every few tens of microseconds the
spinning never stops: it takes a whole core from the event loop, the tokenizer threads and
the other front-end work of this same process, and, under a CPU limit, the pod's quota
(measured in docs/performance-log.md, "OpenMP wait policy"). OpenMP reads the variable once,
when torch is imported, so this must run first."""


def apply_process_env_defaults(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set :data:`PROCESS_ENV_DEFAULTS` in ``environ`` where unset; return what was set."""
    applied = {key: value for key, value in PROCESS_ENV_DEFAULTS.items() if key not in environ}
    environ.update(applied)
    return applied


def serve(settings: ServerSettings) -> int:
    """Run the HTTP server until a signal; return the process exit status."""
    apply_process_env_defaults(os.environ)  # before anything imports torch
    if settings.api_workers > 1:
        return _serve_workers(settings)
    from embedding_server.api.app import create_app
    from embedding_server.api.server import run_http
    from embedding_server.engine import load_engine
    from embedding_server.logging import configure_logging

    configure_logging(settings.log_level, settings.log_format)
    return run_http(settings, create_app(settings, connect=load_engine))


def _serve_workers(settings: ServerSettings) -> int:
    """``--api-workers N``: this process becomes the engine process and starts N front-ends
    (``workers.py``). They share their metrics through prometheus_client's multiprocess
    mode, whose variable must be set before any of them imports prometheus_client."""
    with tempfile.TemporaryDirectory(prefix="embedding-server-") as shared:
        metrics_dir = os.path.join(shared, "metrics")
        os.mkdir(metrics_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # metrics.MULTIPROCESS_DIR_ENV
        from embedding_server.workers import serve_workers

        return serve_workers(settings, shared)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``embedding-server``)."""
    settings = load_settings(argv)
    return serve(settings)


if __name__ == "__main__":
    sys.exit(main())
