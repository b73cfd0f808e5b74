"""The job's plan, ``OUTPUT/_plan.json``: what the corpus is and how it is cut, written once.

``embedding-server job plan`` lists the inputs, cuts every file into shards
(:mod:`embedding_server.batch.corpus`) and commits the plan atomically; every worker of the
job reads it and takes the shard of its index. Planning twice with the same arguments
reuses the plan that is there (an operator may run the planner again after a restart), so
the shards, and the part names that come from their indexes, never move under a running job.
A plan made for other arguments is refused, naming it: the output prefix belongs to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from embedding_server.batch.corpus import FORMATS, Fields, Format, Shard, cut
from embedding_server.batch.storage import Location, commit_bytes, expand

PLAN_NAME = "_plan.json"
PLAN_VERSION = 1

OutputFormat = Literal["parquet", "jsonl"]
OUTPUT_FORMATS: tuple[OutputFormat, ...] = ("parquet", "jsonl")


class PlanError(Exception):
    """No plan, a plan that is not one, or a plan for other arguments."""


@dataclass(frozen=True)
class PlanArguments:
    """What decides a plan: two plans for equal arguments are the same plan.

    Exactly one of ``text_field`` and ``image_field`` names the column embedded. The output
    format is the plan's too, so one output prefix never holds parts of two formats, and a
    worker reads the format from the plan instead of being told it again. A plan written
    before these existed reads as text and Parquet, which is what it was."""

    inputs: tuple[str, ...]
    format: Format
    id_field: str
    text_field: str | None
    shard_rows: int
    output_format: OutputFormat = "parquet"
    image_field: str | None = None

    def __post_init__(self) -> None:
        if (self.text_field is None) == (self.image_field is None):
            raise ValueError("a plan embeds exactly one of a text field and an image field")

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": list(self.inputs),
            "format": self.format,
            "id_field": self.id_field,
            "text_field": self.text_field,
            "image_field": self.image_field,
            "shard_rows": self.shard_rows,
            "output_format": self.output_format,
        }

    @property
    def fields(self) -> Fields:
        if self.image_field is not None:
            return Fields(self.id_field, self.image_field, image=True)
        return Fields(self.id_field, str(self.text_field))


@dataclass(frozen=True)
class Plan:
    arguments: PlanArguments
    files: tuple[str, ...]
    shards: tuple[Shard, ...]

    @property
    def rows(self) -> int:
        return sum(shard.rows for shard in self.shards)

    def to_bytes(self) -> bytes:
        body = {
            "version": PLAN_VERSION,
            "arguments": self.arguments.to_json(),
            "files": list(self.files),
            "rows": self.rows,
            "shards": [shard.to_json() for shard in self.shards],
        }
        return orjson.dumps(body, option=orjson.OPT_INDENT_2) + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Plan:
        try:
            body = orjson.loads(data)
            if body.get("version") != PLAN_VERSION:
                raise PlanError(
                    f"{where}: plan version {body.get('version')!r}, not {PLAN_VERSION}"
                )
            given = body["arguments"]
            fmt = given["format"]
            if fmt not in FORMATS:
                raise PlanError(f"{where}: format {fmt!r} is not one of {', '.join(FORMATS)}")
            output_format = given.get("output_format", "parquet")
            if output_format not in OUTPUT_FORMATS:
                raise PlanError(
                    f"{where}: output format {output_format!r} is not one of "
                    + ", ".join(OUTPUT_FORMATS)
                )
            text_field, image_field = given.get("text_field"), given.get("image_field")
            arguments = PlanArguments(
                tuple(given["inputs"]),
                fmt,
                str(given["id_field"]),
                None if text_field is None else str(text_field),
                int(given["shard_rows"]),
                output_format,
                None if image_field is None else str(image_field),
            )
            shards = tuple(Shard.from_json(shard) for shard in body["shards"])
            return cls(arguments, tuple(body["files"]), shards)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as error:
            raise PlanError(f"{where}: not a job plan ({error!r})") from None


def plan_location(output: Location) -> Location:
    return output.child(PLAN_NAME)


def read_plan(output: Location) -> Plan:
    """The plan under ``output``; :class:`PlanError` when there is none or it is not one."""
    where = plan_location(output)
    if not where.exists():
        raise PlanError(f"{where.url}: no plan; run 'embedding-server job plan' first")
    return Plan.from_bytes(where.read_bytes(), where.url)


def make_plan(
    arguments: PlanArguments, output: Location, s3_endpoint: str | None = None
) -> tuple[Plan, bool]:
    """The plan for ``arguments`` under ``output`` and whether it was there already: the one
    there when it was made for these arguments, else a new one, committed. :class:`PlanError`
    when ``output`` holds a plan for other arguments."""
    where = plan_location(output)
    if where.exists():
        existing = read_plan(output)
        if existing.arguments != arguments:
            difference = _difference(existing.arguments, arguments)
            raise PlanError(
                f"{where.url} is the plan of another job ({difference});"
                " give this job its own output, or delete that plan and the parts beside it"
            )
        return existing, True
    files = [location for pattern in arguments.inputs for location in expand(pattern, s3_endpoint)]
    unique = list({location.url: location for location in files}.values())
    shards = tuple(
        shard
        for location in unique
        for shard in cut(location, arguments.format, arguments.fields, arguments.shard_rows)
    )
    plan = Plan(arguments, tuple(location.url for location in unique), shards)
    commit_bytes(where, plan.to_bytes(), output)
    return plan, False


def _difference(old: PlanArguments, new: PlanArguments) -> str:
    was, now = old.to_json(), new.to_json()
    changed = [f"{name} {was[name]!r}, not {now[name]!r}" for name in was if was[name] != now[name]]
    return "its " + "; ".join(changed)
