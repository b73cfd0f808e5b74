"""``embedding-server job plan`` and ``job work``: the two halves of an EmbeddingJob.

``plan`` runs once per job: it lists the inputs, cuts them into shards and commits
``OUTPUT/_plan.json`` (:mod:`embedding_server.batch.plan`). ``work`` runs once per shard,
as one index of a Kubernetes Indexed Job: it reads the plan, takes shard ``--index`` (by
default ``JOB_COMPLETION_INDEX``), has a service embed its rows (:mod:`.embedder`) and
commits the shard's part (:mod:`.parts`). A shard whose part exists is done and is skipped,
so a worker killed mid-shard redoes only its shard, and a part is never written twice.

Each command leaves one JSON line in the termination log (``/dev/termination-log`` in a
container), which the kubelet copies into the pod's status for the operator to count:
``{"shards", "rows"}`` for ``plan``; ``{"shard", "rows", "failed", "seconds", "skipped"}``
for ``work``, or ``{"shard", "error"}`` when it failed. Exit status: 0 done, 1 the
service stayed unreachable (or answered with two fingerprints: the shard is tried again), 2
bad arguments, inputs or plan, images for a service whose model takes none, outputs
(``--vectors``) its model does not give, or an ``--input-type`` it refuses (trying again
cannot help).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx2
import orjson
import pyarrow as pa
from pydantic import ValidationError
from pydantic_settings import SettingsError

from embedding_server.batch.corpus import FORMATS, CorpusError, read
from embedding_server.batch.embedder import (
    DENSE_ONLY,
    PROBE_TEXT,
    VECTORS,
    Embedder,
    InputTypeRefusedError,
    MixedFingerprintsError,
    NoSuchOutputError,
    ServiceUnavailableError,
    TakesNoImagesError,
    Vector,
)
from embedding_server.batch.local import EngineFailedError, EngineRefusedError, LocalHooks
from embedding_server.batch.parts import (
    OtherOutputs,
    PartCounts,
    Provenance,
    RowsPlace,
    ShardOutput,
)
from embedding_server.batch.plan import (
    OUTPUT_FORMATS,
    Plan,
    PlanArguments,
    PlanError,
    make_plan,
    read_plan,
)
from embedding_server.batch.storage import Location, StorageError, locate
from embedding_server.fingerprint import expected_prefix
from embedding_server.settings import EngineSettings, ServerSettings

logger = logging.getLogger(__name__)

PROG = "embedding-server job"
EXIT_UNREACHABLE = 1
EXIT_BAD_JOB = 2
TERMINATION_LOG = Path("/dev/termination-log")
MESSAGE_LIMIT = 1000
"""Characters of an error kept in the termination log, whose whole line the kubelet keeps
only up to 4 KiB."""
INDEX_ENV = "JOB_COMPLETION_INDEX"
API_KEY_ENV = "EMBEDDING_JOB_API_KEY"
"""The service's API key, sent as ``Authorization: Bearer``: from the environment only, so it
is never on a command line (an EmbeddingJob's workers get the service's apiKeySecretRef)."""


AddField = Callable[[argparse._ArgumentGroup, str, Any], None]
"""How ``cli`` adds a settings field as a flag (``cli._add_field``): serve's words and types."""


def add_job_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], add_field: AddField
) -> None:
    """``job plan`` and ``job work`` under ``commands``; ``add_field`` adds serve's engine
    flags to ``work`` as serve has them."""
    job = commands.add_parser(
        "job",
        help="Embed a corpus from files or object storage, one shard per worker (EmbeddingJob).",
        description="The two commands an EmbeddingJob runs: 'plan' once, to cut the corpus into "
        "shards, then 'work' once per shard, to embed it through a service and commit its part. "
        "Exit status: 0 done; 1 the service stayed unreachable (try again); 2 bad arguments, "
        "inputs or plan.",
    )
    steps = job.add_subparsers(dest="job_command", metavar="STEP", required=True)
    plan = steps.add_parser(
        "plan",
        help="Cut the inputs into shards and write OUTPUT/_plan.json.",
        description="List the inputs (globs allowed), cut them into shards of about "
        "--shard-rows rows (Parquet: row-group ranges; JSONL and CSV: row ranges of a file) and "
        "commit OUTPUT/_plan.json atomically. Run again with the same arguments, it reuses the "
        "plan there; a plan made for other arguments exits 2, naming it.",
    )
    plan.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="URL",
        help="A file, or a glob (s3://bucket/corpus/*.parquet, /data/in/*.jsonl); repeatable.",
    )
    plan.add_argument("--format", required=True, choices=FORMATS, help="The inputs' format.")
    plan.add_argument("--id-field", required=True, metavar="F", help="The rows' id column.")
    content = plan.add_mutually_exclusive_group(required=True)
    content.add_argument("--text-field", metavar="F", help="The text to embed.")
    content.add_argument(
        "--image-field",
        metavar="F",
        help="Instead of a text, the image to embed: an http(s) URL or a data: URL, sent as "
        "/v1/embeddings' image input (for a service that takes images, such as CLIP).",
    )
    plan.add_argument(
        "--output-format",
        choices=OUTPUT_FORMATS,
        default="parquet",
        help="The parts' format (default parquet): Parquet with the vectors as fixed-size "
        "lists of float32, or JSONL in the OpenAI batch output format, a line per row. Kept in "
        "the plan, so every worker writes it.",
    )
    plan.add_argument(
        "--shard-rows",
        type=_positive_int,
        default=10000,
        metavar="N",
        help="Rows per shard, about (default 10000; Parquet row groups are never split).",
    )
    _add_common(plan)
    work = steps.add_parser(
        "work",
        help="Embed one shard of the plan through a service and commit its part.",
        description="Read OUTPUT/_plan.json, take shard --index, and unless "
        "OUTPUT/parts/part-NNNNNN.parquet (or .jsonl, as the plan says) exists already, have "
        "SERVICE embed its rows "
        "(POST /v1/embeddings, base64; /v2/embed for --vectors but dense alone; at bulk "
        "priority, honouring Retry-After) and commit the "
        "part atomically, with the rows the API refused in OUTPUT/errors/part-NNNNNN.jsonl. "
        "With --local instead of --service, the model is loaded in this process and the "
        "server's own application embeds the rows, answering each as the HTTP API would.",
    )
    engine = work.add_mutually_exclusive_group(required=True)
    engine.add_argument("--service", metavar="URL", help="The embedding server.")
    engine.add_argument(
        "--local",
        action="store_true",
        help="Instead of a service, load --model in this process with the engine settings "
        "below (as serve and run-batch take them) and embed the shard with the server's own "
        "application here: the same vectors, errors and fingerprint as through a service "
        "(an EmbeddingJob's spec.model).",
    )
    work.add_argument(
        "--index",
        type=_non_negative_int,
        default=None,
        metavar="I",
        help=f"The shard (default: the {INDEX_ENV} environment variable).",
    )
    work.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="The model to ask the service for; with --local, the model to load (a Hub id or "
        "a local path, as serve's --model; default the packaged all-MiniLM-L6-v2).",
    )
    work.add_argument(
        "--expect-fingerprint",
        default=None,
        metavar="FP",
        help="Send X-Expect-Embedding-Fingerprint: FP with every request, so a service that "
        "moved to another computation answers 409 and the shard exits 1 uncommitted (an "
        "EmbeddingJob's spec.fingerprint).",
    )
    work.add_argument(
        "--max-in-flight",
        type=_positive_int,
        default=8,
        metavar="N",
        help="Requests at once (default 8).",
    )
    work.add_argument(
        "--batch-size",
        type=_positive_int,
        default=64,
        metavar="N",
        help="Texts per request (default 64); images go one to a request.",
    )
    work.add_argument(
        "--retry-for",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="How long one request waits out an unreachable or overloaded service before the "
        "shard gives up with exit 1 (default 600).",
    )
    work.add_argument(
        "--vectors",
        type=_vectors,
        default=DENSE_ONLY,
        metavar="LIST",
        help="The outputs the parts keep, comma-separated, of dense, sparse and multi_vector "
        "(default dense): anything but dense alone is asked of POST /v2/embed, all from one "
        "forward pass. sparse: a SPLADE model's or bge-m3's lexical weights; multi_vector: "
        "bge-m3's or a ColBERT checkpoint's per-token vectors; dense with either: bge-m3 "
        "only. A service whose model does not give one (its /info) exits 2 before any row.",
    )
    work.add_argument(
        "--input-type",
        default=None,
        metavar="TYPE",
        help="The API's input_type for the texts (search_document, search_query, a prompt "
        "name of the model...), which selects the model's prompt for that side; default none, "
        "or search_document with multi_vector (a ColBERT checkpoint needs a side).",
    )
    _add_common(work)
    _add_engine_settings(
        work.add_argument_group("engine settings (with --local, as serve takes them)"), add_field
    )


def _add_engine_settings(group: argparse._ArgumentGroup, add_field: AddField) -> None:
    """serve's engine flags but ``--model`` (``job work --model`` names it)."""
    for name, field in EngineSettings.model_fields.items():
        if name != "model":
            add_field(group, name, field)


def local_settings(namespace: argparse.Namespace) -> ServerSettings:
    """The in-process server's settings for ``job work --local``: the engine flags given (the
    ``EMBEDDING_SERVER_*`` variables and serve's defaults underneath) and ``--model``.
    ``--expect-fingerprint`` is the worker's to check once the model is loaded
    (:func:`~embedding_server.batch.local.local_service`): it may be a prefix, which serve's
    own flag does not take."""
    given = {k: v for k, v in vars(namespace).items() if k in EngineSettings.model_fields}
    if namespace.model is None:
        given.pop("model", None)
    return ServerSettings(**given, log_level=namespace.log_level, log_format=namespace.log_format)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output", required=True, metavar="URL", help="The job's output prefix (local or s3://)."
    )
    parser.add_argument(
        "--s3-endpoint",
        default=None,
        metavar="URL",
        help="The S3 endpoint, for S3-compatible stores (default: AWS_ENDPOINT_URL, else AWS).",
    )
    parser.add_argument(
        "--termination-log",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"Where the one-line JSON summary goes (default {TERMINATION_LOG} when writable).",
    )
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default=os.environ.get("EMBEDDING_SERVER_LOG_LEVEL", "info"),
        help="Log level (default info; env EMBEDDING_SERVER_LOG_LEVEL).",
    )
    parser.add_argument(
        "--log-format",
        choices=("json", "text"),
        default=os.environ.get("EMBEDDING_SERVER_LOG_FORMAT", "text"),
        help="json for log collectors, text for people (env EMBEDDING_SERVER_LOG_FORMAT).",
    )


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {number}")
    return number


def _vectors(value: str) -> tuple[Vector, ...]:
    names = [name.strip() for name in value.split(",")]
    unknown = [name for name in names if name not in VECTORS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{', '.join(map(repr, unknown))}: not one of {', '.join(VECTORS)}"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{value!r} names an output twice")
    return tuple(v for v in VECTORS if v in names)


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {number}")
    return number


def run_job(namespace: argparse.Namespace, local: LocalHooks | None = None) -> int:
    """``embedding-server job ...``: the exit status. ``local``: what ``work --local`` loads
    its model with (the program's root hands it over; without it, ``--local`` is refused)."""
    # The client logs every request at INFO; the job logs its progress itself.
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    if namespace.job_command == "plan":
        return plan_command(namespace)
    return work_command(namespace, local)


def plan_command(namespace: argparse.Namespace) -> int:
    arguments = PlanArguments(
        tuple(namespace.input),
        namespace.format,
        namespace.id_field,
        namespace.text_field,
        namespace.shard_rows,
        namespace.output_format,
        namespace.image_field,
    )
    try:
        output = locate(namespace.output, namespace.s3_endpoint)
        plan, reused = make_plan(arguments, output, namespace.s3_endpoint)
    except (PlanError, CorpusError, StorageError) as error:
        return _refuse(namespace, error)
    except OSError as error:
        return _refuse(namespace, error, EXIT_UNREACHABLE)
    logger.info(
        "job plan: %s %s: %d shards, %d rows, from %d files",
        "reused" if reused else "wrote",
        output.child("_plan.json").url,
        len(plan.shards),
        plan.rows,
        len(plan.files),
    )
    _terminate(namespace.termination_log, {"shards": len(plan.shards), "rows": plan.rows})
    return 0


def work_command(namespace: argparse.Namespace, local: LocalHooks | None = None) -> int:
    started = time.monotonic()
    index = namespace.index
    if index is None:
        raw = os.environ.get(INDEX_ENV)
        if raw is None or not raw.isdigit():
            return _refuse(namespace, f"--index: not given, and {INDEX_ENV} is {raw!r}")
        index = int(raw)
    settings: ServerSettings | None = None
    if namespace.local:
        if local is None:
            return _refuse(namespace, "--local: this program cannot load a model", index=index)
        try:
            settings = local_settings(namespace)
        except (ValidationError, SettingsError) as error:
            return _refuse(namespace, local.format_settings_error(error), index=index)
        if namespace.expect_fingerprint is not None:
            try:
                expected_prefix(namespace.expect_fingerprint)
            except ValueError as error:
                return _refuse(namespace, f"--expect-fingerprint: {error}", index=index)
    elif given := sorted(
        f"--{k.replace('_', '-')}"
        for k in vars(namespace)
        if k in EngineSettings.model_fields and k != "model"
    ):
        return _refuse(namespace, f"{', '.join(given)}: engine settings need --local")
    elif not namespace.service.startswith(("http://", "https://")):
        return _refuse(
            namespace, f"--service {namespace.service!r}: not an http:// or https:// URL"
        )
    try:
        output = locate(namespace.output, namespace.s3_endpoint)
        plan = read_plan(output)
    except (PlanError, StorageError) as error:
        return _refuse(namespace, error, index=index)
    except OSError as error:
        return _refuse(namespace, error, EXIT_UNREACHABLE, index=index)
    if index >= len(plan.shards):
        return _refuse(
            namespace, f"--index {index}: the plan has {len(plan.shards)} shards", index=index
        )
    if plan.arguments.fields.image and namespace.vectors != DENSE_ONLY:
        return _refuse(
            namespace,
            f"--vectors {','.join(namespace.vectors)}: images have dense vectors only (sparse "
            "and multi_vector are outputs of texts)",
            index=index,
        )
    shard_output = ShardOutput(output, index, plan.arguments.output_format)
    try:
        done = shard_output.committed()
        if done is not None and done.vectors is not None and done.vectors != namespace.vectors:
            return _refuse(
                namespace,
                f"--vectors {','.join(namespace.vectors)}: shard {index}'s part, committed by an "
                f"earlier run to this output, holds {','.join(done.vectors)} "
                f"({shard_output.part.url}); write to a new output to keep other vectors",
                index=index,
            )
        if done is not None:
            logger.info(
                "job work: shard %d is committed already (%s)", index, shard_output.part.url
            )
            _report(namespace, index, done, started, skipped=True)
            return 0
        counts = asyncio.run(_work(namespace, plan, index, shard_output, settings, local))
    except (
        CorpusError,
        StorageError,
        TakesNoImagesError,
        NoSuchOutputError,
        InputTypeRefusedError,
        EngineRefusedError,
        pa.ArrowInvalid,
    ) as error:
        return _refuse(namespace, error, index=index)
    except (ServiceUnavailableError, MixedFingerprintsError, EngineFailedError, OSError) as error:
        return _refuse(namespace, error, EXIT_UNREACHABLE, index=index)
    _report(namespace, index, counts, started, skipped=False)
    return 0


@contextlib.asynccontextmanager
async def _client(
    namespace: argparse.Namespace, settings: ServerSettings | None, local: LocalHooks | None
) -> AsyncIterator[httpx2.AsyncClient]:
    """The service's client, or with ``settings`` (``--local``) one of the server's own
    application loaded in this process (:mod:`.local`)."""
    if settings is None or local is None:
        timeout = httpx2.Timeout(300.0, connect=10.0)
        async with httpx2.AsyncClient(base_url=namespace.service, timeout=timeout) as client:
            yield client
        return
    local.apply_process_env_defaults(os.environ)  # as serve and run-batch: before torch loads
    async with local.local_service(settings, expect=namespace.expect_fingerprint) as service:
        yield service.client


async def _work(
    namespace: argparse.Namespace,
    plan: Plan,
    index: int,
    shard_output: ShardOutput,
    settings: ServerSettings | None = None,
    local: LocalHooks | None = None,
) -> PartCounts:
    shard = plan.shards[index]
    fields = plan.arguments.fields
    source: Location = locate(shard.file, namespace.s3_endpoint)
    rows = await asyncio.to_thread(read, source, plan.arguments.format, fields, shard)
    logger.info(
        "job work: shard %d, %d rows of %s, to %s",
        index,
        len(rows.texts),
        shard.file,
        namespace.service or f"{settings.model if settings else ''} in this process",
    )
    async with _client(namespace, settings, local) as client:
        embedder = Embedder(
            client,
            # In this process the model is the one loaded: its served name comes back.
            model=None if settings is not None else namespace.model,
            batch_size=namespace.batch_size,
            max_in_flight=namespace.max_in_flight,
            retry_for=namespace.retry_for,
            expect_fingerprint=namespace.expect_fingerprint,
            api_key=os.environ.get(API_KEY_ENV) or None,
            images=fields.image,
            vectors=namespace.vectors,
            input_type=namespace.input_type,
        )
        await embedder.check_outputs()
        if fields.image:
            await embedder.check_takes_images()
        embedded = await embedder.embed(rows.texts)
        dimensions = multi_vector_dimensions = None
        if not any(embedded.embedded()):
            # A text, whatever the job embeds: a service that takes images takes texts too.
            probe = await embedder.embed([PROBE_TEXT], images=False)
            if any(probe.embedded()):
                dimensions, multi_vector_dimensions = probe.widths()
                embedded.model, embedded.fingerprint = probe.model, probe.fingerprint
    ids = rows.ids.to_pylist()
    failures: dict[int, Any] = {
        position: {"message": problem, "type": "invalid_row", "code": "invalid_row"}
        for position, problem in rows.problems.items()
    }
    failures.update(embedded.errors)
    errors = [
        {"id": ids[p], "file": shard.file, "row": rows.first_row + p, "error": failures[p]}
        for p in sorted(failures)
    ]
    provenance = Provenance(
        embedded.model,
        embedded.fingerprint,
        index,
        dimensions,
        vectors=embedded.outputs,
        multi_vector_dimensions=multi_vector_dimensions,
    )
    place = RowsPlace(rows.first_row, embedded.request_ids)
    others = OtherOutputs(embedded.sparse, embedded.multi_vectors)
    return await asyncio.to_thread(
        shard_output.commit,
        rows.ids,
        fields.id,
        embedded.vectors,
        errors,
        provenance,
        place,
        others,
    )


def _report(
    namespace: argparse.Namespace, index: int, counts: PartCounts, started: float, skipped: bool
) -> None:
    seconds = round(time.monotonic() - started, 3)
    logger.info(
        "job work: shard %d %s: %d rows, %d failed, in %.1f s",
        index,
        "skipped (committed before)" if skipped else "committed",
        counts.rows,
        counts.failed,
        seconds,
    )
    _terminate(
        namespace.termination_log,
        {
            "shard": index,
            "rows": counts.rows,
            "failed": counts.failed,
            "seconds": seconds,
            "skipped": skipped,
        },
    )


def _refuse(
    namespace: argparse.Namespace,
    error: object,
    status: int = EXIT_BAD_JOB,
    *,
    index: int | None = None,
) -> int:
    """Say why on stderr and in the termination log; the exit status."""
    message = str(error)
    sys.stderr.write(f"{PROG} {namespace.job_command}: error: {message}\n")
    summary: dict[str, Any] = {"error": message[:MESSAGE_LIMIT]}
    if index is not None:
        summary = {"shard": index, **summary}
    _terminate(namespace.termination_log, summary)
    return status


def _terminate(path: Path | None, summary: dict[str, Any]) -> None:
    """One JSON line in the termination log: ``path``, else the container's when writable."""
    target = path if path is not None else _default_termination_log()
    if target is None:
        return
    line = orjson.dumps(summary) + b"\n"
    try:
        target.write_bytes(line)
    except OSError as error:  # the summary is a courtesy: the exit status says what happened
        logger.warning("could not write the termination log %s: %s", target, error)


def _default_termination_log() -> Path | None:
    return TERMINATION_LOG if os.access(TERMINATION_LOG, os.W_OK) else None
