"""An EmbeddingJob's status, computed from facts the cluster holds, never from memory.

The facts: the planner Job and its pod's termination message (``{"shards": S, "rows": R}``),
the worker Job (its ``completions`` and :data:`~embedding_operator.jobs.builders.ROWS_ANNOTATION`
repeat S and R; its ``status.completedIndexes`` and ``failedIndexes``, such as ``"0-3,5"``,
count the shards), and the worker pods' termination messages (``{"shard", "rows", "failed",
"seconds", "skipped"}``), which give the rows done and failed. A restarted operator computes
the same status from the same objects.

``phase`` summarises what the conditions say, for ``kubectl get`` (a Job's own status has
no phase; users of batch systems ask for one): Pending, Planning, Running, Suspended, Complete,
Failed. The three conditions ``Complete``, ``Failed`` and ``Suspended`` are shaped like a
Job's (metav1.Condition, with reasons). Rates and the ETA come from pod timestamps, not the
clock, so the status changes only when a fact does and is written only then.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from embedding_operator.jobs.builders import ROWS_ANNOTATION
from embedding_operator.jobs.pods import config_blocked
from embedding_operator.status import Condition, Problem

Phase = Literal["Pending", "Planning", "Running", "Suspended", "Complete", "Failed"]
TERMINAL_PHASES = ("Complete", "Failed")

COMPLETE = "Complete"
FAILED = "Failed"
SUSPENDED = "Suspended"

# Reasons (CamelCase, stable).
COMPLETED = "Completed"
AS_EXPECTED = "AsExpected"
NOT_SUSPENDED = "NotSuspended"
SUSPENDED_BY_SPEC = "SuspendedBySpec"
PENDING = "Pending"
PLANNING = "Planning"
RUNNING = "Running"
INVALID_SPEC = "InvalidSpec"
SERVICE_NOT_FOUND = "ServiceNotFound"
SERVICE_NOT_READY = "ServiceNotReady"
SECRET_NOT_FOUND = "SecretNotFound"
CHILD_CONFLICT = "ChildConflict"
CHILD_REJECTED = "ChildRejected"
PLAN_FAILED = "PlanFailed"
PLAN_UNREADABLE = "PlanUnreadable"
SHARDS_FAILED = "ShardsFailed"
WORKERS_FAILED = "WorkersFailed"

MAX_MESSAGE = 512


class MessageError(ValueError):
    """A termination message that is not the JSON the contract promises."""


@dataclass(frozen=True)
class Plan:
    shards: int
    rows: int


def parse_plan_message(message: str) -> Plan:
    """``{"shards": S, "rows": R}``, the planner's termination message."""
    try:
        data = json.loads(message)
    except ValueError:
        raise MessageError(f"not JSON: {message[:200]!r}") from None
    if not isinstance(data, dict):
        raise MessageError(f"not a JSON object: {message[:200]!r}")
    values = [data.get("shards"), data.get("rows")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise MessageError(f"shards and rows must be whole numbers >= 0: {message[:200]!r}")
    return Plan(shards=int(data["shards"]), rows=int(data["rows"]))


@dataclass(frozen=True)
class ShardReport:
    """What one worker pod said about its shard."""

    shard: int
    rows: int
    failed: int
    seconds: float
    skipped: bool


def parse_worker_message(message: str) -> ShardReport:
    """``{"shard", "rows", "failed", "seconds", "skipped"}``, a worker's termination message."""
    try:
        data = json.loads(message)
    except ValueError:
        raise MessageError(f"not JSON: {message[:200]!r}") from None
    if not isinstance(data, dict):
        raise MessageError(f"not a JSON object: {message[:200]!r}")
    try:
        counts = [int(data["shard"]), int(data.get("rows", 0)), int(data.get("failed", 0))]
        seconds = float(data.get("seconds", 0.0))
    except (KeyError, TypeError, ValueError):
        raise MessageError(f"shard, rows, failed must be numbers: {message[:200]!r}") from None
    if min(counts) < 0:
        raise MessageError(f"negative counts: {message[:200]!r}")
    return ShardReport(
        shard=counts[0],
        rows=counts[1],
        failed=counts[2],
        seconds=seconds,
        skipped=bool(data.get("skipped", False)),
    )


def parse_indexes(text: str | None) -> list[tuple[int, int]]:
    """A Job's ``completedIndexes``/``failedIndexes`` (``"0-3,5,7-9"``) as inclusive ranges."""
    ranges: list[tuple[int, int]] = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high) if high else int(low)
        except ValueError:
            raise MessageError(f"not an index list: {text!r}") from None
        if first < 0 or last < first:
            raise MessageError(f"not an index list: {text!r}")
        ranges.append((first, last))
    return ranges


def count_indexes(text: str | None) -> int:
    return sum(last - first + 1 for first, last in parse_indexes(text))


def in_indexes(index: int, ranges: Iterable[tuple[int, int]]) -> bool:
    return any(first <= index <= last for first, last in ranges)


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def format_time(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def terminated(pod: dict[str, Any]) -> dict[str, Any]:
    """The job container's terminated state, or {} while it runs (or never started)."""
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        state = (container.get("state") or {}).get("terminated")
        if state:
            return dict(state)
    return {}


def job_condition(job: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    """A Job's condition of ``kind`` (Complete, Failed, Suspended) when it is True."""
    for cond in ((job or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind and cond.get("status") == "True":
            return dict(cond)
    return None


def planner_message(pods: Iterable[dict[str, Any]]) -> str | None:
    """The termination message of the planner's succeeded pod, else of its last failed one."""
    succeeded = [p for p in pods if (p.get("status") or {}).get("phase") == "Succeeded"]
    if succeeded:
        return str(terminated(succeeded[-1]).get("message") or "")
    failed = [terminated(p) for p in pods if terminated(p)]
    failed.sort(key=lambda t: str(t.get("finishedAt") or ""))
    return str(failed[-1].get("message") or "") if failed else None


@dataclass(frozen=True)
class WorkerFacts:
    """The worker Job and its pods, reduced to the counts status shows."""

    shards: int
    rows: int
    shards_done: int
    shards_failed: int
    failed_indexes: str
    rows_done: int
    failed_rows: int
    rows_per_second: float | None
    eta: str | None
    start_time: str | None
    completion_time: str | None
    complete: bool
    failed: dict[str, Any] | None
    suspended: bool
    reported: int = 0
    """Committed shards whose pod's report was found (``shards_done`` once every pod is seen)."""

    @classmethod
    def from_live(cls, job: dict[str, Any], pods: Iterable[dict[str, Any]]) -> WorkerFacts:
        spec = job.get("spec") or {}
        status = job.get("status") or {}
        annotations = (job.get("metadata") or {}).get("annotations") or {}
        shards = int(spec.get("completions") or 0)
        try:
            rows = int(annotations.get(ROWS_ANNOTATION, 0))
        except ValueError:
            rows = 0
        completed = parse_indexes(status.get("completedIndexes"))
        reports: dict[int, tuple[ShardReport, datetime | None]] = {}
        started: list[datetime] = []
        for pod in pods:
            if (pod.get("status") or {}).get("phase") != "Succeeded":
                continue
            state = terminated(pod)
            try:
                report = parse_worker_message(str(state.get("message") or ""))
            except MessageError:
                continue
            if not in_indexes(report.shard, completed):
                continue
            # Two pods of one index both succeeded (a retry that raced): the first committed
            # the shard, and that one counts.
            finished = _parse_time(state.get("finishedAt"))
            earlier = reports.get(report.shard)
            if earlier is None or (
                finished is not None and (earlier[1] is None or finished < earlier[1])
            ):
                reports[report.shard] = (report, finished)
            began = _parse_time(state.get("startedAt"))
            if began is not None and not report.skipped:
                started.append(began)
        rows_done = sum(r.rows for r, _ in reports.values())
        failed_rows = sum(r.failed for r, _ in reports.values())
        worked = sum(r.rows + r.failed for r, _ in reports.values() if not r.skipped)
        # From the first worker's start: the Job's startTime moves when it is resumed from
        # suspension, the pods' own start times do not.
        job_start = _parse_time(status.get("startTime"))
        start = min([*started, *([job_start] if job_start else [])], default=None)
        finishes = [t for _, t in reports.values() if t is not None]
        rate: float | None = None
        eta: str | None = None
        if start is not None and finishes and worked:
            last = max(finishes)
            elapsed = (last - start).total_seconds()
            if elapsed > 0:
                rate = round(worked / elapsed, 1)
                left = max(0, rows - rows_done - failed_rows)
                if left and rate > 0:
                    eta = format_time(last + timedelta(seconds=left / rate))
        failed = job_condition(job, "Failed")
        complete = job_condition(job, "Complete")
        completion = status.get("completionTime") or (complete or {}).get("lastTransitionTime")
        if failed is not None:
            completion = failed.get("lastTransitionTime")
        return cls(
            shards=shards,
            rows=rows,
            shards_done=sum(b - a + 1 for a, b in completed),
            shards_failed=count_indexes(status.get("failedIndexes")),
            failed_indexes=str(status.get("failedIndexes") or ""),
            rows_done=rows_done,
            failed_rows=failed_rows,
            rows_per_second=rate,
            eta=eta,
            start_time=status.get("startTime"),
            completion_time=str(completion) if completion else None,
            complete=complete is not None,
            failed=failed,
            suspended=bool(spec.get("suspend")),
            reported=len(reports),
        )


@dataclass(frozen=True)
class JobFacts:
    """Everything ``compute_job_status`` looks at."""

    suspend: bool
    planner: dict[str, Any] | None = None
    planner_message: str | None = None
    worker: WorkerFacts | None = None
    problem: Problem | None = None


def plan_result(facts: JobFacts) -> Plan | Problem | None:
    """The planner's result once it succeeded; a problem when it failed or said nonsense."""
    planner = facts.planner
    if planner is None:
        return None
    failed = job_condition(planner, "Failed")
    if failed is not None:
        said = (facts.planner_message or "").strip()[-MAX_MESSAGE:]
        return Problem(
            PLAN_FAILED,
            f"the planner Job failed ({failed.get('reason') or 'Failed'}): "
            f"{said or failed.get('message') or 'no message'}",
        )
    if job_condition(planner, "Complete") is None:
        return None
    try:
        return parse_plan_message(facts.planner_message or "")
    except MessageError as exc:
        return Problem(PLAN_UNREADABLE, f"the planner's termination message is {exc}")


def compute_job_status(
    generation: int, facts: JobFacts
) -> tuple[dict[str, Any], list[Condition], Phase]:
    """The status document (conditions without timestamps), its conditions and phase."""
    status: dict[str, Any] = {"observedGeneration": generation}
    planner_status = (facts.planner or {}).get("status") or {}
    if planner_status.get("startTime"):
        status["startTime"] = planner_status["startTime"]
    phase: Phase
    failed = Condition(FAILED, "False", AS_EXPECTED, "")
    suspended = Condition(SUSPENDED, "False", NOT_SUSPENDED, "")
    worker = facts.worker
    plan = plan_result(facts)
    problem = facts.problem
    if isinstance(plan, Problem) and worker is None:
        problem = plan
    if isinstance(plan, Plan):
        status.update(shards=plan.shards, rows=plan.rows)
    if worker is not None:
        status.update(
            shards=worker.shards,
            rows=worker.rows,
            shardsDone=worker.shards_done,
            shardsFailed=worker.shards_failed,
            rowsDone=worker.rows_done,
            failedRows=worker.failed_rows,
        )
        if worker.failed_indexes:
            status["failedIndexes"] = worker.failed_indexes
        if worker.rows_per_second is not None:
            status["rowsPerSecond"] = worker.rows_per_second
        if not status.get("startTime") and worker.start_time:
            status["startTime"] = worker.start_time
    counts = (
        f"{status.get('rowsDone', 0)}/{status.get('rows', '?')} rows, "
        f"{status.get('shardsDone', 0)}/{status.get('shards', '?')} shards"
    )
    if problem is not None and not problem.retryable:
        phase = "Failed"
        failed = Condition(FAILED, "True", problem.reason, problem.message)
        complete = Condition(COMPLETE, "False", problem.reason, problem.message)
        completion = (job_condition(facts.planner, "Failed") or {}).get("lastTransitionTime")
        if completion:
            status["completionTime"] = completion
    elif worker is not None and worker.failed is not None:
        phase = "Failed"
        reason = SHARDS_FAILED if worker.shards_failed else WORKERS_FAILED
        message = (
            f"shards {worker.failed_indexes} failed after "
            "backoffLimitPerIndex retries each (the errors are in their pods' logs)"
            if worker.shards_failed
            else f"the worker Job failed ({worker.failed.get('reason')}): "
            f"{worker.failed.get('message') or ''}".strip()
        )
        message = f"{message}; {counts}"
        failed = Condition(FAILED, "True", reason, message)
        complete = Condition(COMPLETE, "False", reason, message)
        if worker.completion_time:
            status["completionTime"] = worker.completion_time
    elif worker is not None and worker.complete:
        phase = "Complete"
        complete = Condition(COMPLETE, "True", COMPLETED, f"every shard is committed; {counts}")
        if worker.completion_time:
            status["completionTime"] = worker.completion_time
    elif isinstance(plan, Plan) and plan.shards == 0 and worker is None:
        phase = "Complete"
        complete = Condition(COMPLETE, "True", COMPLETED, "the input has no rows")
        completion = planner_status.get("completionTime")
        if completion:
            status["completionTime"] = completion
        status.update(shardsDone=0, rowsDone=0, failedRows=0)
    elif facts.suspend:
        phase = "Suspended"
        message = f"spec.suspend is true; {counts}"
        suspended = Condition(SUSPENDED, "True", SUSPENDED_BY_SPEC, message)
        complete = Condition(COMPLETE, "False", SUSPENDED_BY_SPEC, message)
    elif problem is not None:
        phase = "Running" if worker is not None else "Pending"
        complete = Condition(COMPLETE, "False", problem.reason, problem.message)
    elif worker is not None:
        phase = "Running"
        complete = Condition(COMPLETE, "False", RUNNING, counts)
        if worker.eta:
            status["eta"] = worker.eta
    elif facts.planner is not None and not isinstance(plan, Plan):
        phase = "Planning"
        complete = Condition(COMPLETE, "False", PLANNING, "the planner Job lists the input")
    else:
        phase = "Pending"
        complete = Condition(COMPLETE, "False", PENDING, "waiting to start the workers")
    status["phase"] = phase
    return status, [complete, failed, suspended], phase


def container_config_problem(pods: Iterable[dict[str, Any]]) -> Problem | None:
    """A pod the kubelet cannot start, most often the credentials Secret or one of its keys
    missing (``CreateContainerConfigError``); the kubelet's words are not repeated (status is
    read by more people than the Secret is)."""
    for pod in pods:
        if config_blocked(pod):
            name = (pod.get("metadata") or {}).get("name", "")
            return Problem(
                SECRET_NOT_FOUND,
                f"pod {name} cannot start: spec.storage.s3.credentialsSecret (or a key "
                "of it: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) is missing; it starts "
                "once the Secret holds both keys",
                retryable=True,
            )
    return None
