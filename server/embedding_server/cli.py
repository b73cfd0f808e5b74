"""``embedding-server``: the command line, generated from the one settings model.

Flags are not declared here: every field of :class:`ServerSettings` becomes ``--field-name``
(booleans ``--x/--no-x``, lists comma-separated) with the field's description as its help,
so a new setting is a flag and an ``EMBEDDING_SERVER_*`` variable the moment it is added.
Flags the user did not pass are left out, so environment variables and defaults apply
underneath them. A bad setting ends the process before anything loads, with one line that
names the flag and the variable and no traceback.

Four commands: ``serve`` runs the server; ``gateway`` runs the model router in front of
servers (``embedding_server/gateway/``, with its own ``EMBEDDING_GATEWAY_*`` settings);
``inspect`` takes the engine's settings (the model and everything that decides how it is
served) and prints what ``serve`` would serve, from the model's config files and weight
names alone (``device/inspection.py``); with ``--verify`` it also serves a fixed probe set
and compares it with the model's authors' computation (``device/verification.py``).
``run-batch`` answers a file of requests in the OpenAI batch format with the server's own
application in this process, no port opened (``embedding_server/batch/``), resumably.
``job plan`` and ``job work`` are an EmbeddingJob's two steps: cut a corpus (local files or
``s3://``) into shards, then embed one shard through a service and commit its part
(``embedding_server/batch/job.py``, which owns their flags).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsError

from embedding_server.errors import EmbeddingServerError
from embedding_server.gateway.settings import GATEWAY_ENV_PREFIX, GatewaySettings
from embedding_server.settings import (
    DEFAULT_MODEL,
    EngineSettings,
    ServerSettings,
    unwrap_optional,
)

if TYPE_CHECKING:
    from embedding_server.batch.lines import Key
    from embedding_server.batch.output import BatchOutput
    from embedding_server.batch.storage import Location
    from embedding_server.device.inspection import Inspection

PROG = "embedding-server"
ENV_PREFIX = "EMBEDDING_SERVER_"

EXIT_BAD_SETTINGS = 2
"""Exit status for invalid settings (argparse's own status for usage errors)."""

EXIT_REFUSED = 1
"""Exit status of ``inspect`` for a model the server would refuse (as ``serve`` exits)."""

EXIT_UNVERIFIABLE = 3
"""Exit status of ``inspect --verify`` for a model it cannot compare with a reference (a
task, a modality or a reference that cannot run here): not a pass, and not a failure."""

SettingsT = TypeVar("SettingsT", bound=EngineSettings)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env(name: str, prefix: str = ENV_PREFIX) -> str:
    return prefix + name.upper()


def _add_settings(
    group: argparse._ArgumentGroup, model: type[BaseSettings], prefix: str = ENV_PREFIX
) -> None:
    """A flag in ``group`` for each field of ``model`` (its variables named with ``prefix``)."""
    for name, field in model.model_fields.items():
        _add_field(group, name, field, prefix)


def _add_field(
    group: argparse._ArgumentGroup, name: str, field: FieldInfo, prefix: str = ENV_PREFIX
) -> None:
    annotation = unwrap_optional(field.annotation)
    description = (field.description or "").replace("%", "%%")
    default = field.get_default(call_default_factory=True)
    details = [f"env {_env(name, prefix)}"]
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
    _add_settings(serve.add_argument_group("settings"), settings_model)
    inspect = commands.add_parser(
        "inspect",
        help="Print what a model would be served as, without serving it.",
        description="Decide what 'serve' would serve with these settings, from the model's "
        "config, tokenizer and sentence-transformers files and its weights' names and "
        "shapes (read from the safetensors headers, not the weights), and print it: "
        "architecture, backend, task, pooling, dimensions, prompts, maximum input length, "
        "the attention kernel and dtype on this machine, and the tensors the checkpoint "
        "holds that the server knowingly does not read, with the reasons. A model the "
        "server would refuse exits 1 with the refusal.",
    )
    inspect.add_argument(
        "--json", action="store_true", help="Print one JSON object instead of text."
    )
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="Also load the model, serve a fixed set of probe texts (short, long, "
        "multilingual, instruction-prefixed, truncated) with these settings, and compare "
        "them with the model's authors' computation (sentence-transformers, else "
        "transformers; float32 on the CPU): print the lowest cosine per kind of input (the "
        "largest score difference for score and classify) and exit 1 below the threshold, "
        f"{EXIT_UNVERIFIABLE} when the model cannot be verified here.",
    )
    inspect.add_argument(
        "--verify-threshold",
        type=float,
        default=None,
        metavar="X",
        help="With --verify: the lowest cosine accepted (default 0.9999 in float32, 0.999 in "
        "bfloat16 and float16, 0.99 with int8), or for score and classify the largest "
        "absolute difference (default 1e-4 in float32, 1e-2 in bfloat16 and float16).",
    )
    _add_settings(inspect.add_argument_group("settings (as serve takes them)"), EngineSettings)
    gateway = commands.add_parser(
        "gateway",
        help="Route requests for many models to their servers (no model loaded here).",
        description="One address for every model: route each request by its 'model' field "
        "to the least-loaded ready endpoint of that model, hold requests while a model has "
        "no ready endpoint (scale from zero), and retry once on another endpoint what a "
        "dying one dropped. Models and endpoints come from --routes / --routes-file or, with "
        "--discovery kubernetes, from EmbeddingServices and their EndpointSlices. Each flag "
        f"can also be set with an {GATEWAY_ENV_PREFIX}* environment variable.",
    )
    _add_settings(gateway.add_argument_group("settings"), GatewaySettings, GATEWAY_ENV_PREFIX)
    batch = commands.add_parser(
        "run-batch",
        help="Answer a file of requests (the OpenAI batch format) offline, resumably.",
        description="Load the model as 'serve' would and answer every line of IN, a JSONL file "
        "of {custom_id, method, url, body} requests for this server's routes (/v1/embeddings, "
        "/v2/embed, /pooling, /score, /rerank, /classify, ...), with the server's own "
        "application in this process (no port is opened), writing one line per request to "
        "OUT: {id, custom_id, response: {status_code, request_id, body}, error}, in the order "
        "the answers come. A line that is not a request, or that the server refuses, gets an "
        "error line with the reason and never stops the batch. Run the same command again "
        "after an interruption (SIGKILL included) and it continues where it stopped: every "
        "request is answered once. Exits 0 when every line has an answer, errors included; 2 "
        "when IN or OUT cannot be used (a repeated custom_id, an OUT that is not batch output).",
    )
    batch.add_argument(
        "-i",
        "--input-file",
        required=True,
        metavar="IN",
        help="The requests (JSONL): a local path, or an s3://bucket/key URL, streamed (the "
        "standard AWS_* variables; AWS_ENDPOINT_URL for an S3-compatible store).",
    )
    batch.add_argument(
        "-o",
        "--output-file",
        required=True,
        metavar="OUT",
        help="The answers (JSONL), appended to when it exists: what it answers is not sent "
        "again. A local path: object storage cannot be appended to.",
    )
    batch.add_argument(
        "--max-in-flight",
        type=_positive_int,
        default=64,
        metavar="N",
        help="Requests sent at once (default 64); the engine batches them together, within "
        "--max-batch-tokens. A request answered 429 waits its Retry-After and is sent again.",
    )
    _add_settings(batch.add_argument_group("settings (as serve takes them)"), ServerSettings)
    from embedding_server.batch.job import add_job_parser

    add_job_parser(commands, _add_field)
    return parser


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {number}")
    return number


def format_settings_error(error: ValidationError | SettingsError, prefix: str = ENV_PREFIX) -> str:
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
        problems.setdefault((name, message), f"{_flag(name)} / {_env(name, prefix)}: {message}")
    return "invalid settings: " + "; ".join(problems.values())


def load_settings(argv: Sequence[str] | None = None) -> ServerSettings:
    """Parse argv (flags win over ``EMBEDDING_SERVER_*`` variables) into settings.

    Raises ``SystemExit`` with :data:`EXIT_BAD_SETTINGS` after writing one line to stderr
    when a setting is invalid.
    """
    return _settings(ServerSettings, build_parser().parse_args(argv))


def _settings(model: type[SettingsT], namespace: argparse.Namespace) -> SettingsT:
    """``model`` from the flags given (variables and defaults underneath), or exit 2."""
    given = {k: v for k, v in vars(namespace).items() if k in model.model_fields}
    try:
        settings = model(**given)
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


def _gateway_settings(namespace: argparse.Namespace) -> GatewaySettings:
    """The gateway's settings from the flags given (variables and defaults underneath),
    or exit 2 with one line, as for ``serve``."""
    given = {k: v for k, v in vars(namespace).items() if k in GatewaySettings.model_fields}
    try:
        return GatewaySettings(**given)
    except (ValidationError, SettingsError) as error:
        message = format_settings_error(error, GATEWAY_ENV_PREFIX)
        sys.stderr.write(f"{PROG} gateway: error: {message}\n")
        raise SystemExit(EXIT_BAD_SETTINGS) from None


def gateway(settings: GatewaySettings) -> int:
    """Run the gateway until a signal; return the process exit status. Request plane
    only: nothing here imports torch (pyproject's import contracts)."""
    from embedding_server.gateway.server import run_gateway

    return run_gateway(settings)


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


def inspect(
    settings: EngineSettings,
    *,
    as_json: bool = False,
    verify: bool = False,
    threshold: float | None = None,
) -> int:
    """Print what ``settings`` would serve (``embedding-server inspect``); 1 when the
    server would refuse the model, with the reason on stderr. ``verify``: then compare what
    it serves with the reference (:func:`_verify`)."""
    apply_process_env_defaults(os.environ)  # as serve: before anything imports torch
    from embedding_server.device.inspection import inspect_model

    try:
        inspection = inspect_model(settings)
    except EmbeddingServerError as error:
        message = str(error)
        if not message.startswith("model "):  # load refusals name the model already
            message = f"model {settings.model!r}: {message}"
        sys.stderr.write(f"{PROG} inspect: cannot serve {message}\n")
        return EXIT_REFUSED
    if verify:
        return _verify(settings, inspection, as_json=as_json, threshold=threshold)
    if as_json:
        sys.stdout.write(json.dumps(inspection.to_dict(), indent=2) + "\n")
    else:
        sys.stdout.write(format_inspection(inspection))
    return 0


def _verify(
    settings: EngineSettings, inspection: Inspection, *, as_json: bool, threshold: float | None
) -> int:
    """``inspect --verify``: the inspection, then the served outputs against the authors'
    computation (``device/verification.py``); 0 when every kind of probe is within the
    threshold, 1 when one is not (or the load is refused), :data:`EXIT_UNVERIFIABLE` when
    there is no reference to compare with."""
    from embedding_server.device.verification import (
        UnverifiableError,
        format_verification,
        verify,
    )
    from embedding_server.engine import Engine

    if not as_json:
        sys.stdout.write(format_inspection(inspection) + "\n")
        sys.stdout.flush()
    try:
        engine = Engine.from_settings(settings)
    except EmbeddingServerError as error:
        sys.stderr.write(f"{PROG} inspect: cannot serve model {settings.model!r}: {error}\n")
        return EXIT_REFUSED
    try:
        result = verify(engine, settings, threshold=threshold)
    except UnverifiableError as error:
        sys.stderr.write(f"{PROG} inspect: cannot verify model {settings.model!r}: {error}\n")
        return EXIT_UNVERIFIABLE
    finally:
        engine.close()
    if as_json:
        out = inspection.to_dict()
        out["verification"] = result.to_dict()
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    else:
        sys.stdout.write(format_verification(result))
    return 0 if result.passed else EXIT_REFUSED


def run_batch(
    settings: ServerSettings,
    input_file: str | Path,
    output_file: str | Path,
    *,
    max_in_flight: int = 64,
) -> int:
    """``embedding-server run-batch``: answer ``input_file``'s requests (a path, or an
    ``s3://`` URL) into ``output_file``; the process exit status. The files are checked
    before the model loads."""
    apply_process_env_defaults(os.environ)  # as serve: before anything imports torch
    from embedding_server.batch.lines import BatchFileError
    from embedding_server.batch.output import BatchOutput
    from embedding_server.batch.runner import scan_input
    from embedding_server.batch.storage import S3_SCHEME, StorageError, locate
    from embedding_server.logging import configure_logging

    configure_logging(settings.log_level, settings.log_format)
    # The client logs every request at INFO: the progress line says it once per interval.
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    if str(output_file).startswith(S3_SCHEME):
        sys.stderr.write(
            f"{PROG} run-batch: error: -o {output_file}: the output must be a local file: it is "
            "appended to answer by answer and read back to resume, which object storage "
            "cannot do. Write it locally and copy it when the run ends, or embed a corpus on "
            f"S3 with '{PROG} job' (docs/server/jobs.md)\n"
        )
        return EXIT_BAD_SETTINGS
    output = BatchOutput(Path(output_file))
    source: Path | Location = Path(input_file)
    try:
        if str(input_file).startswith(S3_SCHEME):
            source = locate(str(input_file))
        answered = output.recover()
        scan = scan_input(source, answered)
    except (BatchFileError, OSError, StorageError) as error:
        sys.stderr.write(f"{PROG} run-batch: error: {error}\n")
        return EXIT_BAD_SETTINGS
    if scan.remaining == 0:
        logging.getLogger(__name__).info(
            "run-batch: all %d requests of %s are answered in %s",
            scan.total,
            input_file,
            output_file,
        )
        return 0
    return asyncio.run(
        _run_batch_here(settings, source, output, answered, scan.total, max_in_flight)
    )


async def _run_batch_here(
    settings: ServerSettings,
    input_file: Path | Location,
    output: BatchOutput,
    answered: set[Key],
    total: int,
    max_in_flight: int,
) -> int:
    """The server's application, its engine loaded in this process, driven through
    ``httpx2.ASGITransport``: each line is answered exactly as the HTTP API would answer it."""
    import time

    import httpx2

    from embedding_server.api.app import create_app
    from embedding_server.batch.runner import Progress, run_batch
    from embedding_server.engine import load_engine

    log = logging.getLogger(__name__)
    started = time.monotonic()
    # No key in front of our own calls: the app is reached from this process only.
    app = create_app(settings.model_copy(update={"api_key": None}), connect=load_engine)
    lifecycle = app.state.lifecycle
    async with app.router.lifespan_context(app):
        while not lifecycle.is_ready():
            # A server stays up, not ready, for a refused fingerprint or changed golden
            # vectors (so that a rollout stops at that pod); a batch must end instead.
            engine, golden = lifecycle.engine, lifecycle.golden
            why = lifecycle.failure or lifecycle.refusal
            if why is None and engine is not None and golden is not None and golden.changed:
                why = golden.check.message(engine.info().fingerprint)
            if why is not None:
                sys.stderr.write(f"{PROG} run-batch: {why}\n")
                return 1
            await asyncio.sleep(0.05)
        output.open()
        try:
            transport = httpx2.ASGITransport(app=app)
            async with httpx2.AsyncClient(
                transport=transport, base_url="http://127.0.0.1", timeout=None
            ) as client:
                counts = await run_batch(
                    input_file,
                    output,
                    client,
                    urls=app.direct_paths,
                    answered=answered,
                    total=total,
                    max_in_flight=max_in_flight,
                    progress=Progress(total, len(answered)),
                )
        finally:
            output.close()
    log.info(
        "run-batch: %d requests answered in %.1f s (%d succeeded, %d with an error, %d by an "
        "earlier run) into %s",
        counts.answered,
        time.monotonic() - started,
        counts.succeeded,
        counts.failed,
        counts.already,
        output.path,
    )
    return 0


def job(namespace: argparse.Namespace) -> int:
    """``embedding-server job plan|work``: no model loads here (the request plane only), but
    for ``work --local``, whose model :mod:`embedding_server.inprocess` loads."""
    from embedding_server.batch.job import run_job
    from embedding_server.batch.local import LocalHooks
    from embedding_server.logging import configure_logging

    configure_logging(namespace.log_level, namespace.log_format)
    local = None
    if getattr(namespace, "local", False):
        from embedding_server.inprocess import local_service

        local = LocalHooks(local_service, format_settings_error, apply_process_env_defaults)
    return run_job(namespace, local)


def format_inspection(inspection: Inspection) -> str:
    """The inspection as aligned ``field  value`` lines, for people."""
    info = inspection.info
    notes: list[str] = []
    if info.dimensions != info.full_dimensions:
        notes.append(f"of {info.full_dimensions}")
    if info.full_dimensions != info.hidden_size:
        notes.append(f"Dense layers over hidden size {info.hidden_size}")
    if info.matryoshka:
        sizes = info.matryoshka_dimensions
        allowed = ", ".join(map(str, sizes)) if sizes else f"any up to {info.full_dimensions}"
        notes.append(f"Matryoshka: {allowed}")
    dims = f"{info.dimensions}" + (f" ({'; '.join(notes)})" if notes else "")
    prompts = ", ".join(f"{name}: {text!r}" for name, text in info.prompts.items()) or "none"
    if info.default_prompt_name:
        prompts += f" (default: {info.default_prompt_name})"
    attention = f"{info.attention} on {info.device}"
    if info.sliding_window is not None:
        attention += f", sliding window {info.sliding_window}"
    rows: list[tuple[str, str]] = [
        ("model", info.model + (f" ({info.model_path})" if info.model_path else "")),
        ("architecture", f"{info.architecture} (model_type {info.model_type})"),
        ("backend", inspection.backend),
        (
            "custom code",
            f"{inspection.custom_code} (not run)" if inspection.custom_code else "none",
        ),
        ("task", info.task + (f" (labels: {', '.join(info.labels)})" if info.labels else "")),
    ]
    if info.task == "embed":
        rows += [
            (
                "pooling",
                info.pooling + (" (a guess, see the note)" if inspection.pooling_note else ""),
            ),
            ("normalize", "yes" if info.normalize else "no"),
            ("dimensions", dims),
        ]
    rows += [
        ("attention", ("causal" if inspection.causal else "bidirectional") + f"; {attention}"),
        ("prompts", prompts),
        ("special tokens", info.special_tokens.describe()),
    ]
    if info.adapters:  # jina-embeddings-v3: chosen per request (task, input_type, prompt_name)
        rows.append(("task adapters", ", ".join(info.adapters)))
    rows += [
        ("max input tokens", str(info.max_input_tokens)),
        ("dtype", info.dtype),
        (
            "fingerprint",
            info.fingerprint
            or "unknown until the weights are downloaded (inspect reads only their headers)",
        ),
    ]
    if info.tensor_parallel_size > 1:
        rows.append(("tensor parallel", f"{info.tensor_parallel_size} ranks"))
    rows.append(("tensors", f"{inspection.tensors_read} read, {len(inspection.ignored)} ignored"))
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"{name:<{width}}{value}" for name, value in rows]
    for reason in info.attention_passed_over:
        lines.append(f"{'':<{width}}attention: not using {reason}")
    if inspection.pooling_note:
        lines.append(f"{'':<{width}}note: {inspection.pooling_note}")
    by_reason: dict[str, list[str]] = {}
    for name, reason in inspection.ignored:
        by_reason.setdefault(reason, []).append(name)
    for reason, names in by_reason.items():
        lines.append(f"{'':<{width}}ignored {', '.join(names)}: {reason}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``embedding-server``)."""
    namespace = build_parser().parse_args(argv)
    if namespace.command == "inspect":
        return inspect(
            _settings(EngineSettings, namespace),
            as_json=namespace.json,
            verify=namespace.verify,
            threshold=namespace.verify_threshold,
        )
    if namespace.command == "gateway":
        return gateway(_gateway_settings(namespace))
    if namespace.command == "job":
        return job(namespace)
    if namespace.command == "run-batch":
        return run_batch(
            _settings(ServerSettings, namespace),
            namespace.input_file,
            namespace.output_file,
            max_in_flight=namespace.max_in_flight,
        )
    return serve(_settings(ServerSettings, namespace))


if __name__ == "__main__":
    sys.exit(main())
