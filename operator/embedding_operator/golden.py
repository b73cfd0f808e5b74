"""Golden vectors: what the first ready pod of a model embeds is the record every later pod of
that model must match (issue 47, item 2).

The server does the embedding and the comparing (``--golden-vectors``, ``GET /golden``); the
operator does the two things only it can:

* **record**: when the ConfigMap ``<name>-golden`` holds no record for the spec's contract key
  (``builders/golden.py``) and a pod of that key is Ready, it reads the pod's ``/golden`` on
  the probe port and writes it there, with the pod and node it came from. The ConfigMap then
  holds that key's record only: pods of an earlier model lose their file and compare no more,
  which is right, since the record they matched is no longer the service's.
* **name the pods that differ**: while the Deployment is not settled, it reads ``/golden`` of
  each not-ready pod of the current key; one whose server found its vectors changed makes the
  ``VectorsChanged`` problem, naming the pod, its node, the lowest cosine and which fingerprint
  inputs differ. The server keeps that pod's ``/ready`` at 503, so it never takes traffic
  whatever the operator does; the operator's part is to say so.

Everything in ``status.contract`` is computed from the ConfigMap each reconcile (facts, not
memory), so an operator restart or a second replica reports the same. The operator never adopts
a ConfigMap of that name it did not create: it is reported, and no record is written.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from embedding_operator.builders.common import PROBE_PORT, Owner, owner_reference
from embedding_operator.builders.golden import (
    CONTRACT_LABEL,
    configmap_name,
    contract_key,
    record_file,
)
from embedding_operator.kube import ApiError, Cluster, ObjectRef, controller_of
from embedding_operator.spec import EmbeddingServiceSpec
from embedding_operator.status import Problem

log = logging.getLogger(__name__)

VECTORS_CHANGED = "VectorsChanged"
GOLDEN_CONFLICT = "GoldenRecordConflict"
RECORD_FIELDS = ("probe_set", "fingerprint", "fingerprint_inputs", "model", "dimensions")
RECORD_DATA_FIELDS = ("probes", "vectors")
MAX_ANSWER_BYTES = 4 << 20
"""A record is a few hundred kilobytes at most (8 probes of 4,096 float32 dimensions, base64);
an answer past this is not one, and is not read on."""
MAX_PODS_ASKED = 8
"""Not-ready pods asked per reconcile: enough to name the first that differ, bounded however
many replicas roll at once."""
FETCH_TIMEOUT_SECONDS = 2.0
"""A probe port answers at once or not at all (a pod on the same network, a fixed answer):
waiting longer only holds a reconcile thread."""
RETRY_FIRST_SECONDS = 10.0
RETRY_MOST_SECONDS = 60.0
"""A record due but not taken, or a pod still comparing, is looked at again after 10 s, then
twice as long each time up to a minute (an unreachable probe port costs a minute's wait per
try, not a reconcile thread every 10 s)."""


class GoldenUnreachable(Exception):
    """A pod's ``/golden`` could not be read (refused, timed out, not JSON)."""


Fetch = Callable[[str], dict[str, Any]]
"""Pod IP -> its ``/golden`` answer; raises :class:`GoldenUnreachable`."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A pod runs whatever image its spec names: its answer must not send the operator on to
    another address (the API server, a cloud metadata service)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


# No proxy either: a pod address is reached directly, whatever HTTP_PROXY the operator has.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())


def http_fetch(ip: str, timeout: float = FETCH_TIMEOUT_SECONDS) -> dict[str, Any]:
    host = f"[{ip}]" if ":" in ip else ip
    url = f"http://{host}:{PROBE_PORT}/golden"
    try:
        with _OPENER.open(url, timeout=timeout) as answer:
            body = answer.read(MAX_ANSWER_BYTES + 1)
    except (OSError, urllib.error.URLError) as exc:
        raise GoldenUnreachable(f"GET {url}: {exc}") from exc
    if len(body) > MAX_ANSWER_BYTES:
        raise GoldenUnreachable(f"GET {url}: the answer is over {MAX_ANSWER_BYTES} bytes")
    try:
        parsed = json.loads(body)
    except ValueError as exc:
        raise GoldenUnreachable(f"GET {url}: not JSON ({exc})") from exc
    if not isinstance(parsed, dict):
        raise GoldenUnreachable(f"GET {url}: not a JSON object")
    return parsed


@dataclass(frozen=True)
class PodFacts:
    """What the golden step reads of a server pod."""

    name: str
    node: str
    ip: str
    ready: bool
    key: str
    terminating: bool

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> PodFacts:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        return cls(
            name=str(meta.get("name") or ""),
            node=str((pod.get("spec") or {}).get("nodeName") or ""),
            ip=str(status.get("podIP") or ""),
            ready=conditions.get("Ready") == "True",
            key=str((meta.get("labels") or {}).get(CONTRACT_LABEL) or ""),
            terminating=bool(meta.get("deletionTimestamp")),
        )


@dataclass(frozen=True)
class GoldenOutcome:
    """``status.contract``; the problem a pod that differs makes; ``retry_after`` when a
    record is due but could not be taken yet (a ready pod not answering)."""

    status: dict[str, Any]
    problem: Problem | None = None
    retry_after: float | None = None


def changed_message(pod: PodFacts, check: Mapping[str, Any], threshold: float) -> str:
    lowest = check.get("min_cosine")
    probe = check.get("probe")
    where = f"pod {pod.name} on node {pod.node or '(unscheduled)'}"
    if isinstance(lowest, int | float):
        said = f"{where}: lowest cosine {lowest:.6f} on probe {probe}, under {threshold:g}"
    else:
        said = f"{where}: {check.get('reason') or 'its vectors differ from the record'}"
    differs = check.get("differs") or {}
    if isinstance(differs, Mapping) and differs:
        parts = []
        for name, pair in sorted(differs.items()):
            if isinstance(pair, list | tuple) and len(pair) == 2:
                parts.append(f"{name} {pair[0]} -> {pair[1]}")
            else:
                parts.append(str(name))
        said += "; its fingerprint differs in " + ", ".join(parts)
    elif check.get("expected_fingerprint"):
        said += "; its fingerprint inputs are the record's (the same inputs gave other vectors)"
    return said + "; it is kept out of the Service"


def record_status(
    key: str, spec: EmbeddingServiceSpec, record: Mapping[str, Any] | None, **extra: Any
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "key": key,
        "policy": spec.contract.policy,
        "minCosine": spec.contract.threshold,
    }
    if record is not None:
        status["state"] = "Recorded"
        status["fingerprint"] = str(record.get("fingerprint") or "")
        status["probeSet"] = str(record.get("probe_set") or "")
        source = record.get("recordedFrom") or {}
        if isinstance(source, Mapping):
            status["recordedFrom"] = {
                "pod": str(source.get("pod") or ""),
                "node": str(source.get("node") or ""),
            }
        if record.get("recordedAt"):
            status["recordedAt"] = str(record["recordedAt"])
    status.update(extra)
    return status


def _parse_record(text: object) -> dict[str, Any] | None:
    if not isinstance(text, str):
        return None
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) and parsed.get("vectors") else None


def _configmap_ref(owner: Owner) -> ObjectRef:
    return ObjectRef("v1", "ConfigMap", owner.namespace, configmap_name(owner))


def record_of(live: Mapping[str, Any] | None, owner: Owner, key: str) -> dict[str, Any] | None:
    """``key``'s record in ``live``, when ``live`` is this EmbeddingService's own ConfigMap."""
    if live is None or (controller_of(live) or {}).get("uid") != owner.uid:
        return None
    return _parse_record((live.get("data") or {}).get(record_file(key)))


class GoldenKeeper:
    """The golden step of a reconcile, against a ``Cluster`` and a way to reach pods."""

    def __init__(self, cluster: Cluster, fetch: Fetch, clock: Callable[[], str]) -> None:
        self._cluster = cluster
        self._fetch = fetch
        self._clock = clock
        # (namespace, name) -> how many looks in a row came back for more. Reconciles of one
        # object never overlap (the work queue's guarantee), so no lock.
        self._again: dict[tuple[str, str], int] = {}

    def forget(self, namespace: str, name: str) -> None:
        self._again.pop((namespace, name), None)

    def step(
        self,
        owner: Owner,
        spec: EmbeddingServiceSpec,
        pods: Callable[[], Iterable[Mapping[str, Any]]],
        *,
        settled: bool,
        live: Mapping[str, Any] | None,
        keep: tuple[str, ...] = (),
    ) -> GoldenOutcome:
        """One look (:meth:`_step`), its ``retry_after`` backed off while looks keep asking for
        another."""
        outcome = self._step(owner, spec, pods, settled=settled, live=live, keep=keep)
        key = (owner.namespace, owner.name)
        if outcome.retry_after is None:
            self._again.pop(key, None)
            return outcome
        tries = self._again.get(key, 0)
        self._again[key] = tries + 1
        delay = min(RETRY_FIRST_SECONDS * 2**tries, RETRY_MOST_SECONDS)
        return GoldenOutcome(outcome.status, outcome.problem, delay)

    def read(self, owner: Owner) -> dict[str, Any] | None:
        """The live ConfigMap ``<name>-golden`` (one GET), whoever owns it."""
        return self._cluster.get(_configmap_ref(owner))

    def _step(
        self,
        owner: Owner,
        spec: EmbeddingServiceSpec,
        pods: Callable[[], Iterable[Mapping[str, Any]]],
        *,
        settled: bool,
        live: Mapping[str, Any] | None,
        keep: tuple[str, ...] = (),
    ) -> GoldenOutcome:
        """``live`` is what :meth:`read` returned; ``keep``, the contract keys whose records
        stay when this one's is written (the running model's, during a blue/green change).
        ``pods`` is called only when needed: a settled Deployment with a record has every
        pod ready, so there is none to ask."""
        key = contract_key(spec)
        if spec.contract.policy == "disabled":
            said = "spec.contract.policy is disabled: no golden vectors are recorded or checked"
            return GoldenOutcome(record_status(key, spec, None, state="Disabled", message=said))
        ref = _configmap_ref(owner)
        if live is not None and (controller_of(live) or {}).get("uid") != owner.uid:
            message = (
                f"ConfigMap {ref.name} exists and is not this EmbeddingService's: the operator "
                "never adopts it, so no golden vectors are recorded or checked; delete or "
                "rename it"
            )
            return GoldenOutcome(
                record_status(key, spec, None, state="Conflict", message=message),
                problem=Problem(GOLDEN_CONFLICT, message),
            )
        record = _parse_record(((live or {}).get("data") or {}).get(record_file(key)))
        if record is not None and settled:
            return GoldenOutcome(record_status(key, spec, record))
        mine = [
            p for p in map(PodFacts.from_pod, pods()) if p.key == key and p.ip and not p.terminating
        ]
        if record is None:
            return self._record(owner, spec, key, live, [p for p in mine if p.ready], keep)
        status = record_status(key, spec, record)
        comparing = False
        for pod in [p for p in mine if not p.ready][:MAX_PODS_ASKED]:
            try:
                answer = self._fetch(pod.ip)
            except GoldenUnreachable as exc:
                log.debug("%s/%s: %s", owner.namespace, pod.name, exc)
                comparing = True  # still starting, most likely
                continue
            check = answer.get("check") or {}
            state = check.get("state") if isinstance(check, Mapping) else None
            if state == "changed":
                message = changed_message(pod, check, spec.contract.threshold)
                return GoldenOutcome(status, problem=Problem(VECTORS_CHANGED, message, True))
            comparing = comparing or state == "unchecked"
        # A pod still loading or comparing makes no event when it is done (it stays not
        # ready if its vectors changed): come back rather than wait for the resync.
        return GoldenOutcome(status, retry_after=RETRY_FIRST_SECONDS if comparing else None)

    def _record(
        self,
        owner: Owner,
        spec: EmbeddingServiceSpec,
        key: str,
        live: Mapping[str, Any] | None,
        ready: list[PodFacts],
        keep: tuple[str, ...],
    ) -> GoldenOutcome:
        if not ready:
            waiting = "no golden vectors yet: they are recorded from the first ready pod"
            return GoldenOutcome(record_status(key, spec, None, state="Pending", message=waiting))
        failures = []
        for pod in ready[:2]:
            try:
                answer = self._fetch(pod.ip)
            except GoldenUnreachable as exc:
                failures.append(str(exc))
                continue
            check = answer.get("check") or {}
            if isinstance(check, Mapping) and check.get("state") == "unsupported":
                reason = str(check.get("reason") or "this task has no embedding to record")
                return GoldenOutcome(
                    record_status(key, spec, None, state="Unsupported", message=reason)
                )
            if not answer.get("vectors"):
                failures.append(f"pod {pod.name}: /golden has no vectors yet")
                continue
            record = {k: answer[k] for k in (*RECORD_FIELDS, *RECORD_DATA_FIELDS) if k in answer}
            record["recordedFrom"] = {"pod": pod.name, "node": pod.node}
            record["recordedAt"] = self._clock()
            if not self._write(owner, key, live, record, keep):
                failures.append(f"ConfigMap {configmap_name(owner)} changed while written")
                break
            log.info(
                "%s/%s: golden vectors recorded from pod %s on node %s (fingerprint %s)",
                owner.namespace,
                owner.name,
                pod.name,
                pod.node,
                record.get("fingerprint"),
            )
            return GoldenOutcome(record_status(key, spec, record))
        message = "could not read a ready pod's /golden: " + "; ".join(failures)
        return GoldenOutcome(
            record_status(key, spec, None, state="Pending", message=message),
            retry_after=RETRY_FIRST_SECONDS,
        )

    def _write(
        self,
        owner: Owner,
        key: str,
        live: Mapping[str, Any] | None,
        record: dict[str, Any],
        keep: tuple[str, ...],
    ) -> bool:
        """Write the record; False when the ConfigMap changed hands meanwhile (a 409)."""
        data = {record_file(key): json.dumps(record, separators=(",", ":"))}
        for other in keep:
            kept = ((live or {}).get("data") or {}).get(record_file(other))
            if other != key and kept is not None:
                data[record_file(other)] = kept
        manifest: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": configmap_name(owner),
                "namespace": owner.namespace,
                "labels": {CONTRACT_LABEL: key},
                "ownerReferences": [owner_reference(owner)],
            },
            # This key's record, and those kept: a server-side apply drops the rest.
            "data": data,
        }
        if live is not None:
            # Written with the uid it was read with: a ConfigMap replaced since is refused.
            manifest["metadata"]["uid"] = (live.get("metadata") or {}).get("uid")
        try:
            self._cluster.apply(manifest, force=live is not None)
        except ApiError as exc:
            if exc.status != 409:
                raise
            log.warning("%s/%s: golden record not written: %s", owner.namespace, owner.name, exc)
            return False
        return True
