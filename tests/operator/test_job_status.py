"""An EmbeddingJob's status from facts: the planner's message, the worker Job's index lists,
the workers' messages, the rate and the ETA, and the phase they add up to."""

from __future__ import annotations

import json
from typing import Any

import pytest
from embedding_operator.jobs.builders import ROWS_ANNOTATION
from embedding_operator.jobs.status import (
    JobFacts,
    MessageError,
    Plan,
    WorkerFacts,
    compute_job_status,
    count_indexes,
    parse_indexes,
    parse_plan_message,
    parse_worker_message,
    planner_message,
)
from embedding_operator.status import Problem


def test_planner_message() -> None:
    assert parse_plan_message('{"shards": 4, "rows": 20000}') == Plan(4, 20000)
    assert parse_plan_message('{"shards": 0, "rows": 0}') == Plan(0, 0)
    for bad in ("", "Traceback (most recent call last):", "[4]", '{"shards": -1, "rows": 2}'):
        with pytest.raises(MessageError):
            parse_plan_message(bad)
    with pytest.raises(MessageError):
        parse_plan_message('{"shards": true, "rows": 2}')


def test_index_lists() -> None:
    assert parse_indexes("0-3,5") == [(0, 3), (5, 5)]
    assert count_indexes("0-3,5") == 5
    assert count_indexes("") == 0 and count_indexes(None) == 0
    assert count_indexes("7") == 1 and count_indexes("0-99999") == 100000
    for bad in ("a-b", "3-1", "-2"):
        with pytest.raises(MessageError):
            parse_indexes(bad)


def test_worker_message() -> None:
    report = parse_worker_message(
        '{"shard": 3, "rows": 5000, "failed": 2, "seconds": 4.5, "skipped": false}'
    )
    assert (report.shard, report.rows, report.failed, report.skipped) == (3, 5000, 2, False)
    with pytest.raises(MessageError):
        parse_worker_message('{"rows": 1}')


def _pod(
    index: int, rows: int, finished: str, *, skipped: bool = False, phase: str = "Succeeded"
) -> dict[str, Any]:
    message = json.dumps(
        {"shard": index, "rows": rows, "failed": 1, "seconds": 10.0, "skipped": skipped}
    )
    return {
        "metadata": {"name": f"corpus-work-{index}-x"},
        "status": {
            "phase": phase,
            "containerStatuses": [
                {
                    "state": {
                        "terminated": {"exitCode": 0, "message": message, "finishedAt": finished}
                    }
                }
            ],
        },
    }


def _job(
    status: dict[str, Any], completions: int = 8, rows: int = 8000, suspend: bool = False
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "corpus-work",
            "uid": "w",
            "annotations": {ROWS_ANNOTATION: str(rows)},
        },
        "spec": {"completions": completions, "suspend": suspend, "completionMode": "Indexed"},
        "status": status,
    }


def test_rows_and_shards_done_come_from_the_facts() -> None:
    job = _job({"startTime": "2026-12-03T10:00:00Z", "completedIndexes": "0-1,3"})
    pods = [
        _pod(0, 1000, "2026-12-03T10:00:10Z"),
        _pod(1, 1000, "2026-12-03T10:00:15Z"),
        _pod(3, 1000, "2026-12-03T10:00:20Z"),
        _pod(3, 1000, "2026-12-03T10:00:25Z"),  # a raced retry's twin: counted once
        _pod(2, 999, "2026-12-03T10:00:20Z", phase="Failed"),  # not committed
    ]
    facts = WorkerFacts.from_live(job, pods)
    assert (facts.shards, facts.shards_done, facts.rows, facts.rows_done) == (8, 3, 8000, 3000)
    assert facts.failed_rows == 3
    # 3000 rows embedded and 3 failed in the 20 s since the Job started.
    assert facts.rows_per_second == 150.2
    # 8000 - 3000 - 3 rows left at 150.2 rows/s, counted from the last commit.
    assert facts.eta == "2026-12-03T10:00:53Z"


def test_shards_an_earlier_run_committed_are_done_but_not_in_the_rate() -> None:
    job = _job({"startTime": "2026-12-03T10:00:00Z", "completedIndexes": "0-1"})
    pods = [
        _pod(0, 1000, "2026-12-03T10:00:01Z", skipped=True),
        _pod(1, 1000, "2026-12-03T10:00:10Z"),
    ]
    facts = WorkerFacts.from_live(job, pods)
    assert facts.rows_done == 2000 and facts.rows_per_second == 100.1  # 1001 rows in 10 s


def _status(facts: JobFacts) -> tuple[dict[str, Any], dict[str, Any], str]:
    status, conditions, phase = compute_job_status(1, facts)
    return status, {c.type: c for c in conditions}, phase


PLANNER_DONE = {
    "status": {
        "startTime": "2026-12-03T09:59:00Z",
        "completionTime": "2026-12-03T09:59:30Z",
        "conditions": [{"type": "Complete", "status": "True"}],
    }
}


def test_phases() -> None:
    _, conds, phase = _status(JobFacts(suspend=False))
    assert phase == "Pending" and conds["Complete"].status == "False"

    _, conds, phase = _status(JobFacts(suspend=False, planner={"status": {"active": 1}}))
    assert phase == "Planning" and conds["Complete"].reason == "Planning"

    status, conds, phase = _status(
        JobFacts(suspend=False, planner=PLANNER_DONE, planner_message='{"shards": 0, "rows": 0}')
    )
    assert phase == "Complete" and conds["Complete"].status == "True"
    assert status["completionTime"] == "2026-12-03T09:59:30Z"

    running = WorkerFacts.from_live(
        _job({"startTime": "2026-12-03T10:00:00Z", "completedIndexes": "0"}),
        [_pod(0, 1000, "2026-12-03T10:00:10Z")],
    )
    status, conds, phase = _status(JobFacts(False, PLANNER_DONE, None, running))
    assert phase == "Running" and status["rowsDone"] == 1000 and status["shardsDone"] == 1
    assert status["startTime"] == "2026-12-03T09:59:00Z" and "eta" in status

    status, conds, phase = _status(JobFacts(True, PLANNER_DONE, None, running))
    assert phase == "Suspended" and conds["Suspended"].status == "True"
    assert conds["Suspended"].reason == "SuspendedBySpec" and "eta" not in status


def test_complete_and_failed() -> None:
    done = _job(
        {
            "startTime": "2026-12-03T10:00:00Z",
            "completedIndexes": "0-7",
            "completionTime": "2026-12-03T10:05:00Z",
            "conditions": [{"type": "Complete", "status": "True"}],
        }
    )
    status, conds, phase = _status(JobFacts(False, worker=WorkerFacts.from_live(done, [])))
    assert phase == "Complete" and conds["Complete"].reason == "Completed"
    assert conds["Failed"].status == "False" and status["completionTime"] == "2026-12-03T10:05:00Z"

    failed = _job(
        {
            "completedIndexes": "0-5",
            "failedIndexes": "6-7",
            "conditions": [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "FailedIndexes",
                    "lastTransitionTime": "2026-12-03T10:06:00Z",
                }
            ],
        }
    )
    status, conds, phase = _status(JobFacts(False, worker=WorkerFacts.from_live(failed, [])))
    assert phase == "Failed" and conds["Failed"].status == "True"
    assert conds["Failed"].reason == "ShardsFailed" and "6-7" in conds["Failed"].message
    assert status["shardsFailed"] == 2 and status["failedIndexes"] == "6-7"
    assert status["completionTime"] == "2026-12-03T10:06:00Z"


def test_a_failed_or_unreadable_plan_fails_the_job() -> None:
    planner = {
        "status": {
            "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]
        }
    }
    _, conds, phase = _status(JobFacts(False, planner, "NoSuchBucket: corpus"))
    assert phase == "Failed" and conds["Failed"].reason == "PlanFailed"
    assert "NoSuchBucket: corpus" in conds["Failed"].message
    _, conds, phase = _status(JobFacts(False, PLANNER_DONE, "oops"))
    assert phase == "Failed" and conds["Failed"].reason == "PlanUnreadable"


def test_a_problem_that_may_pass_keeps_the_job_pending() -> None:
    problem = Problem("ServiceNotReady", "spec.service: EmbeddingService minilm is not Ready", True)
    _, conds, phase = _status(
        JobFacts(False, PLANNER_DONE, '{"shards": 2, "rows": 9}', problem=problem)
    )
    assert phase == "Pending" and conds["Complete"].reason == "ServiceNotReady"
    assert conds["Failed"].status == "False"


def test_planner_message_prefers_the_succeeded_pod() -> None:
    ok = {
        "status": {
            "phase": "Succeeded",
            "containerStatuses": [{"state": {"terminated": {"message": "{}"}}}],
        }
    }
    bad = {
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {"state": {"terminated": {"message": "boom", "finishedAt": "1"}}}
            ],
        }
    }
    assert planner_message([bad, ok]) == "{}"
    assert planner_message([bad]) == "boom"
    assert planner_message([]) is None


def test_a_resumed_job_keeps_its_rate_from_the_first_worker() -> None:
    """Resuming a suspended Job moves its startTime; the rate still counts from the first
    worker pod's start, so it never turns negative or infinite."""
    job = _job({"startTime": "2026-12-03T11:00:00Z", "completedIndexes": "0-1"})
    pods = [_pod(0, 999, "2026-12-03T10:00:10Z"), _pod(1, 999, "2026-12-03T11:00:20Z")]
    for pod, began in zip(pods, ("2026-12-03T10:00:00Z", "2026-12-03T11:00:00Z"), strict=True):
        pod["status"]["containerStatuses"][0]["state"]["terminated"]["startedAt"] = began
    facts = WorkerFacts.from_live(job, pods)
    # 2000 rows processed (999 + 1 failed, twice) from 10:00:00 to 11:00:20.
    assert facts.rows_per_second == round(2000 / 3620, 1)
