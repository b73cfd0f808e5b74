"""Tensor parallelism: one model split over N ranks of one process tree.

Rank 0 is the engine's own process (HTTP, tokenization, the scheduler and pooling stay
there). It starts ranks 1..N-1 as child processes (``python -m
embedding_server.device.tensor_parallel``), each loading its share of the weights
(``distributed.Shard``, ``models.layers.HeadSplit``) onto its own GPU (NCCL) or CPU (gloo).
Per batch, rank 0 broadcasts the plan once, a header and one int64 payload (packed token
ids, positions, sequence lengths), and every rank then runs the same forward pass, whose
only collectives are the all-reduces after the row-parallel projections. Only rank 0's
output is used: the residual stream is whole on every rank.

With a prompt-prefix cache (``device.prefix_cache``) rank 0's cache decides: a prefix it
misses is sent to every rank (``_PREFIX``), which computes and keeps its own heads of it; a
forward's payload names each sequence's prefix, and the prefixes rank 0 evicted since the
last one, which the workers drop after that forward (it may still read them).

Failure is fatal, never a hang: a rank that exits is noticed within
:data:`WATCH_INTERVAL_S`; a forward pass or the idle heartbeat (every
:data:`HEARTBEAT_INTERVAL_S`) that takes longer than ``tensor_parallel_timeout`` means a rank
hangs. Either way the group fails once: the engine stops being ready, the remaining ranks are
killed (which also unblocks rank 0's own collective), and the failure callbacks run (the
server's exits non-zero). Workers read their stdin, a pipe from rank 0, until it closes, so
they exit when rank 0 does, however it ends; they run in their own session, so a terminal's
Ctrl-C reaches rank 0 only, and rank 0 drains and stops them.

The ranks meet at rank 0's TCPStore, which has no authentication of its own. It listens on
127.0.0.1 only (the ranks are rank 0's children: nothing outside the pod can reach it), and
each start draws a secret that rank 0 hands the workers on their stdin with the settings.
Every key the group uses lives under a prefix derived from it, and what a rank reports (its
shard loaded, or why it failed) carries an HMAC under it: a process in the pod that is not a
rank can neither guess the keys nor forge a report, so its writes cannot fail the group.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import IO, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from embedding_server.device.attention import Backend, probe, select_backend
from embedding_server.device.distributed import Shard
from embedding_server.device.loading import load_shard
from embedding_server.device.models.base import EmbeddingModel, PackedBatch
from embedding_server.device.prefix_cache import PrefixEntry, PrefixKey, PrefixModel
from embedding_server.device.runner import SMALL_BATCH_TOKENS
from embedding_server.errors import NotReadyError, UnsupportedModelError
from embedding_server.settings import EngineSettings

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
"""How often rank 0 checks that every worker process is alive."""
HEARTBEAT_INTERVAL_S = 5.0
"""Idle time after which rank 0 checks, with one collective, that every rank answers."""
STOP_GRACE_S = 10.0
"""How long a worker gets to exit after being told to stop before it is killed."""

_FORWARD, _PING, _STOP, _PREFIX = 0, 1, 2, 3

T = TypeVar("T")


class RankFailedError(NotReadyError):
    """A tensor-parallel rank died, hung or failed; the group cannot run forward passes."""


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the ``rank``-th GPU after ``base`` on CUDA, else ``base``."""
    if base.type == "cuda":
        return torch.device("cuda", (base.index or 0) + rank)
    return base


def _pack_keys(keys: Sequence[PrefixKey]) -> list[int]:
    """``keys`` as one int list: their count, each one's length, then their ids."""
    return [len(keys), *(len(k) for k in keys), *(i for k in keys for i in k)]


def _unpack_keys(flat: Sequence[int], start: int = 0) -> tuple[list[PrefixKey], int]:
    """The keys :func:`_pack_keys` packed at ``flat[start:]``, and where they end."""
    count = flat[start]
    lens = flat[start + 1 : start + 1 + count]
    at = start + 1 + count
    keys = []
    for n in lens:
        keys.append(tuple(flat[at : at + n]))
        at += n
    return keys, at


def _sequence_prefixes(batch: PackedBatch) -> list[PrefixKey]:
    """Each sequence's cached prefix (empty: none), or none at all without prefixes."""
    prefix = batch.prefix
    if prefix is None:
        return []
    return [() if slot < 0 else prefix.keys[slot] for slot in prefix.slots]


def _send(
    kind: int,
    batch: PackedBatch | None,
    device: torch.device,
    *,
    drops: Sequence[PrefixKey] = (),
    prefixes: Sequence[PrefixKey] = (),
) -> None:
    """Rank 0's half of one plan: the header, then (for a forward, or the prefixes to
    compute) the payload. A forward carries each sequence's cached prefix and the prefixes
    the workers drop after it (evicted on rank 0)."""
    tokens = 0 if batch is None else batch.input_ids.shape[0]
    sequences = 0 if batch is None else len(batch.seqlens)
    adapters = batch is not None and batch.adapter_ids is not None
    key_lens = batch is not None and batch.key_lens is not None
    extra: list[int] = []
    if kind == _FORWARD and batch is not None:
        extra = _pack_keys(_sequence_prefixes(batch)) + _pack_keys(drops)
    elif kind == _PREFIX:
        extra = _pack_keys(prefixes)
    header = [kind, tokens, sequences, int(adapters), int(key_lens), len(extra)]
    dist.broadcast(torch.tensor(header, dtype=torch.int64, device=device), 0)
    if batch is not None:
        lens = torch.tensor(batch.seqlens, dtype=torch.int64, device=device)
        parts = [batch.input_ids, batch.position_ids, lens]
        if batch.adapter_ids is not None:  # each token's task adapter (jina-embeddings-v3)
            parts.append(batch.adapter_ids)
        if batch.key_lens is not None:  # each sequence's keys (ColBERT's augmented queries)
            parts.append(torch.tensor(batch.key_lens, dtype=torch.int64, device=device))
        parts.append(torch.tensor(extra, dtype=torch.int64, device=device))
        dist.broadcast(torch.cat(parts), 0)
    elif extra:
        dist.broadcast(torch.tensor(extra, dtype=torch.int64, device=device), 0)
    if kind == _PING:
        dist.all_reduce(torch.ones(1, device=device))


@dataclass(frozen=True)
class _Plan:
    """What a worker received: the kind, and for a forward its batch and the prefixes to
    drop after it; for ``_PREFIX`` the prefixes to compute."""

    kind: int
    batch: PackedBatch | None = None
    drops: tuple[PrefixKey, ...] = ()
    prefixes: tuple[PrefixKey, ...] = ()


def _receive(device: torch.device, attention: Backend) -> _Plan:
    """A worker's half of :func:`_send`."""
    header = torch.empty(6, dtype=torch.int64, device=device)
    dist.broadcast(header, 0)
    kind, tokens, sequences, adapters, key_lens, extra = header.tolist()
    if kind == _PING:
        dist.all_reduce(torch.ones(1, device=device))
    if kind == _PREFIX:
        packed = torch.empty(extra, dtype=torch.int64, device=device)
        dist.broadcast(packed, 0)
        prefixes, _ = _unpack_keys(packed.tolist())
        return _Plan(kind, prefixes=tuple(prefixes))
    if kind != _FORWARD:
        return _Plan(kind)
    adapter_rows = tokens if adapters else 0
    keys = sequences if key_lens else 0
    sizes = [tokens, tokens, sequences, adapter_rows, keys, extra]
    payload = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    dist.broadcast(payload, 0)
    ids, positions, lens, adapter_ids, key_len, tail = torch.split(payload, sizes)
    flat = tail.tolist()
    per_sequence, at = _unpack_keys(flat)
    drops, _ = _unpack_keys(flat, at)
    batch = PackedBatch.of(
        ids,
        positions,
        lens.tolist(),
        attention=attention,
        key_lens=key_len.tolist() if key_lens else None,
        prefixes=[key or None for key in per_sequence] if per_sequence else None,
    )
    if adapters:
        batch.adapter_ids = adapter_ids
    return _Plan(kind, batch, tuple(drops))


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _local_transport() -> None:
    """All ranks share one host: gloo talks over loopback, never over whatever interface the
    host name resolves to (a pod's IP, or nothing in some containers). Inherited by workers."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _loopback_store(size: int, timeout: float) -> TCPStore:
    """Rank 0's store, listening on 127.0.0.1 only: TCPStore binds every interface when it
    opens its own socket, so it is handed one bound to loopback."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(socket.SOMAXCONN)
        store = TCPStore(
            "127.0.0.1",
            listener.getsockname()[1],
            world_size=size,
            is_master=True,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the socket now
    return store


class _Keys:
    """The group's view of the store: under a prefix derived from this start's secret, and
    with what ranks report signed by it (see the module docstring)."""

    def __init__(self, store: Store, secret: str) -> None:
        self._secret = secret.encode()
        prefix = hmac.new(self._secret, b"prefix", hashlib.sha256).hexdigest()[:16]
        self.store: Store = PrefixStore(f"embedding-server/{prefix}/", store)

    def _tag(self, key: str, value: str) -> str:
        message = f"{key}\0{value}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def report(self, key: str, value: str) -> None:
        """Set ``key`` to ``value``, signed."""
        self.store.set(key, f"{self._tag(key, value)}:{value}")

    def reported(self, key: str) -> str | None:
        """``key``'s value if a rank set it (signed with the secret); None if it is unset or
        forged (a forgery is dropped, so that the rank's own report can take its place)."""
        if not self.store.check([key]):
            return None
        tag, _, value = self.store.get(key).decode(errors="replace").partition(":")
        if hmac.compare_digest(tag, self._tag(key, value)):
            return value
        logger.warning("ignoring %s in the tensor-parallel store: not written by a rank", key)
        with contextlib.suppress(Exception):  # gone already: nothing to drop
            self.store.delete_key(key)
        return None


class TensorParallelGroup:
    """Rank 0's handle on the group: starts the workers, sends plans, watches for failure."""

    def __init__(self, settings: EngineSettings, device: torch.device) -> None:
        self.size = settings.tensor_parallel_size
        self.timeout = settings.tensor_parallel_timeout
        self.device = rank_device(device, 0)
        self.shard = Shard(0, self.size)
        self.failure: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._busy_since: float | None = None
        self._idle_since = time.monotonic()
        self._closed = threading.Event()
        self._workers: list[subprocess.Popen[bytes]] = []
        self._watcher: threading.Thread | None = None
        if dist.is_initialized():
            raise UnsupportedModelError(
                "a tensor-parallel engine is already running in this process; close it first"
            )
        if device.type == "cuda":
            first = self.device.index or 0
            if torch.cuda.device_count() < first + self.size:
                raise UnsupportedModelError(
                    f"tensor_parallel_size {self.size} needs GPUs {first}..{first + self.size - 1}"
                    f"; this process sees {torch.cuda.device_count()}"
                )
        _local_transport()
        self._store = _loopback_store(self.size, self.timeout)
        self._secret = secrets.token_hex(32)
        self._keys = _Keys(self._store, self._secret)
        try:
            for rank in range(1, self.size):
                self._workers.append(self._spawn(rank, settings))
        except BaseException:
            self.close()
            raise

    def _spawn(self, rank: int, settings: EngineSettings) -> subprocess.Popen[bytes]:
        command = [
            sys.executable,
            "-m",
            __name__,
            f"--rank={rank}",
            f"--size={self.size}",
            f"--port={self._store.port}",
            f"--device={rank_device(self.device, rank)}",
            f"--log-level={getattr(settings, 'log_level', 'info')}",
            f"--log-format={getattr(settings, 'log_format', 'text')}",
        ]
        worker = subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True)
        assert worker.stdin is not None
        engine_fields = set(EngineSettings.model_fields)
        # The secret on stdin, never on the command line (which any process can read).
        worker.stdin.write(settings.model_dump_json(include=engine_fields).encode() + b"\n")
        worker.stdin.write(self._secret.encode() + b"\n")
        worker.stdin.flush()
        logger.info("started tensor-parallel rank %d (pid %d)", rank, worker.pid)
        return worker

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (ranks 1..N-1)."""
        return [w.pid for w in self._workers]

    def join(self) -> None:
        """Wait until every worker has loaded its shard, then form the process group.

        Raises :class:`RankFailedError` naming the rank when one fails to load or exits.
        Loading has no deadline of its own (a download can take long); a worker that exits
        is noticed at once.
        """
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL binds rank 0 to the current device
        pending = set(range(1, self.size))
        while pending:
            for rank in sorted(pending):
                code = self._workers[rank - 1].poll()
                error = self._keys.reported(f"tp/{rank}/error")
                if error is not None:
                    raise RankFailedError(f"tensor-parallel rank {rank} failed to load: {error}")
                if code is not None:
                    raise RankFailedError(
                        f"tensor-parallel rank {rank} exited with status {code} while loading"
                    )
                if self._keys.reported(f"tp/{rank}/loaded") is not None:
                    pending.discard(rank)
            time.sleep(0.05)
        dist.init_process_group(
            _backend(self.device),
            store=self._keys.store,
            rank=0,
            world_size=self.size,
            timeout=timedelta(seconds=self.timeout),
        )
        self._idle_since = time.monotonic()
        self._watcher = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watcher.start()
        threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True).start()
        logger.info(
            "tensor-parallel group of %d ranks formed (%s)", self.size, _backend(self.device)
        )

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` (from a watchdog thread) when the group fails."""
        self._callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def forward(
        self, model: EmbeddingModel, batch: PackedBatch, drops: Sequence[PrefixKey] = ()
    ) -> torch.Tensor:
        """Send the plan, then run rank 0's share of the forward pass with the others; the
        workers drop the prefixes ``drops`` after it."""

        def work() -> torch.Tensor:
            _send(_FORWARD, batch, self.device, drops=drops)
            hidden = model.forward(batch)
            if hidden.is_cuda:  # NCCL is asynchronous: wait here, where the watchdog times it
                torch.cuda.synchronize(hidden.device)
            return hidden

        return self._collective(work)

    def prefix_entries(
        self, model: PrefixModel, prefixes: Sequence[PrefixKey], attention: Backend
    ) -> list[PrefixEntry]:
        """Every rank computes (and the workers keep) the states of ``prefixes`` for its own
        heads; rank 0's are returned."""

        def work() -> list[PrefixEntry]:
            _send(_PREFIX, None, self.device, prefixes=prefixes)
            entries = model.prefix_entries(prefixes, attention)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return entries

        return self._collective(work)

    def _ping(self) -> None:
        _send(_PING, None, self.device)

    def _collective(self, work: Callable[[], T]) -> T:
        if self.failure is not None:
            raise RankFailedError(self.failure)
        with self._lock:
            if self._closed.is_set():
                raise RankFailedError("the tensor-parallel ranks have been stopped")
            self._busy_since = time.monotonic()
            try:
                return work()
            except Exception as error:
                # Whatever broke, the ranks are no longer in step: the group is done.
                self._fail(f"tensor-parallel forward pass failed: {type(error).__name__}: {error}")
                raise RankFailedError(self.failure or "tensor-parallel group failed") from error
            finally:
                self._busy_since = None
                self._idle_since = time.monotonic()

    def _heartbeat(self) -> None:
        while not self._closed.wait(WATCH_INTERVAL_S):
            if self.failure is not None:
                return
            if time.monotonic() - self._idle_since < HEARTBEAT_INTERVAL_S:
                continue
            if self._lock.locked():
                continue
            try:
                self._collective(self._ping)
            except RankFailedError:
                return

    def _watch(self) -> None:
        while not self._closed.wait(WATCH_INTERVAL_S):
            for rank, worker in enumerate(self._workers, start=1):
                code = worker.poll()
                if code is not None:
                    self._fail(f"tensor-parallel rank {rank} exited with status {code}")
            busy = self._busy_since
            if busy is not None and time.monotonic() - busy > self.timeout:
                self._fail(
                    f"tensor-parallel ranks did not answer within {self.timeout:g} s "
                    "(tensor_parallel_timeout): a rank hangs"
                )
            if self.failure is not None:
                return

    def _fail(self, message: str) -> None:
        if self.failure is not None or self._closed.is_set():
            return
        self.failure = message
        logger.error("%s; stopping every rank", message)
        # Killing the workers also ends rank 0's own collective if one is blocked.
        _reap(self._workers, grace=0.0)
        for callback in self._callbacks:
            callback(message)

    def close(self) -> None:
        """Stop every rank: tell the workers to exit, then kill any that linger."""
        if self._closed.is_set():
            return
        # From here on nothing starts a collective, and what fails is the shutdown's doing.
        self._closed.set()
        if self.failure is None and dist.is_initialized() and self._lock.acquire(timeout=1.0):
            try:
                _send(_STOP, None, self.device)
            except Exception:  # a broken group: the workers are killed below
                logger.debug("stop message not delivered", exc_info=True)
            finally:
                self._lock.release()
        _reap(self._workers, grace=STOP_GRACE_S)
        # After a failure a collective may still be blocked on the forward thread; the
        # process is exiting then, and tearing the group down could block with it.
        if dist.is_initialized() and self.failure is None:
            dist.destroy_process_group()
        logger.info("tensor-parallel ranks stopped")


def _reap(workers: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    """End the workers: close their stdin (they exit on EOF), wait ``grace``, then kill."""
    for worker in workers:
        _close_quietly(worker.stdin)
    deadline = time.monotonic() + grace
    for worker in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(max(0.0, deadline - time.monotonic()))
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def _close_quietly(stream: IO[bytes] | None) -> None:
    if stream is not None:
        with contextlib.suppress(OSError):
            stream.close()


class TensorParallelModel:
    """Rank 0's model: the same protocol as any body, its forward run in step with the
    workers through the group."""

    def __init__(self, model: EmbeddingModel, group: TensorParallelGroup) -> None:
        self.model, self.group = model, group
        self.hidden_size = model.hidden_size
        self.causal = model.causal
        self.position_offset = model.position_offset
        self.max_positions = model.max_positions
        self.sliding_window = model.sliding_window
        self.adapters: tuple[str, ...] = getattr(model, "adapters", ())
        """The body's task adapters (jina-embeddings-v3), which requests choose by name."""
        self._drops: list[PrefixKey] = []

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        drops, self._drops = self._drops, []
        return self.group.forward(self.model, batch, drops)

    def prefix_entries(
        self, prefixes: Sequence[PrefixKey], attention: Backend = Backend.SDPA_BUCKETED
    ) -> list[PrefixEntry]:
        """Each rank's states of ``prefixes`` (``device.prefix_cache``), computed together;
        the workers keep theirs until rank 0's cache lets go of them (:meth:`drop_prefix`)."""
        if not isinstance(self.model, PrefixModel):
            raise ValueError(f"{type(self.model).__name__} computes no prefix states")
        return self.group.prefix_entries(self.model, prefixes, attention)

    def drop_prefix(self, key: PrefixKey) -> None:
        """Rank 0's cache let go of ``key`` (evicted, or never kept): the workers drop theirs
        after the next forward pass, which may still read it."""
        self._drops.append(key)


# -- the worker ranks -------------------------------------------------------------------------


def _watch_parent(stdin: IO[bytes]) -> None:
    """Exit the moment rank 0's end of our stdin closes: rank 0 stopped, however it ended."""
    while stdin.read(65536):
        pass
    os._exit(0)


class _RankFilter(logging.Filter):
    """Stamp a worker's records with its rank (``tp_rank`` in JSON logs), since every rank
    writes to the pod's one log."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.tp_rank = self.rank
        return True


def _serve(model: EmbeddingModel, device: torch.device, threads: int, attention: Backend) -> None:
    """Run rank 0's plans until told to stop. The prefixes rank 0 has cached are kept here
    too, this rank's heads of them, until a forward's ``drops`` lets them go."""
    kept: dict[PrefixKey, PrefixEntry] = {}
    with torch.inference_mode():
        while True:
            plan = _receive(device, attention)
            if plan.kind == _STOP:
                return
            if plan.kind == _PREFIX:
                if not isinstance(model, PrefixModel):
                    raise ValueError(f"{type(model).__name__} computes no prefix states")
                for entry in model.prefix_entries(plan.prefixes, attention):
                    kept[entry.ids] = entry
                continue
            batch = plan.batch
            if batch is None:
                continue
            if device.type == "cpu":
                wanted = 1 if batch.input_ids.shape[0] < SMALL_BATCH_TOKENS else threads
                if torch.get_num_threads() != wanted:
                    torch.set_num_threads(wanted)
            if batch.prefix is not None:
                batch.prefix.bind([kept[key] for key in batch.prefix.keys])
            model.forward(batch)
            for key in plan.drops:
                kept.pop(key, None)


def worker_main(argv: Sequence[str] | None = None) -> int:
    """A worker rank: load the shard, join the group, run forward passes until told to stop."""
    from embedding_server.device.dtypes import cpu_thread_budget
    from embedding_server.logging import configure_logging

    parser = argparse.ArgumentParser(prog="embedding-server tensor-parallel worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", default="text", choices=["text", "json"])
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_RankFilter(args.rank))
    stdin = sys.stdin.buffer
    settings = EngineSettings.model_validate_json(stdin.readline())
    secret = stdin.readline().decode().strip()
    threading.Thread(target=_watch_parent, args=(stdin,), name="parent-watch", daemon=True).start()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=settings.tensor_parallel_timeout)
    keys = _Keys(TCPStore("127.0.0.1", args.port, is_master=False, timeout=timeout), secret)
    try:
        model, dtype, head_dim, bias, softcap, alibi = load_shard(
            settings.model,
            revision=settings.revision,
            cache_dir=settings.cache_dir,
            dtype=settings.dtype,
            device=device,
            shard=Shard(args.rank, args.size),
            task=settings.task,
            trust_remote_code=settings.trust_remote_code,
        )
        # The same rule on the same facts as rank 0, so every rank runs the same kernel.
        facts = probe(device, dtype, head_dim, bias=bias, softcap=softcap, alibi=alibi)
        attention = select_backend(settings.attention, facts).backend
    except Exception as error:
        logger.debug("rank %d failed to load", args.rank, exc_info=True)
        keys.report(f"tp/{args.rank}/error", f"{type(error).__name__}: {error}")
        return 1
    keys.report(f"tp/{args.rank}/loaded", "1")
    dist.init_process_group(
        _backend(device), store=keys.store, rank=args.rank, world_size=args.size, timeout=timeout
    )
    _serve(model, device, max(1, cpu_thread_budget() // args.size), attention)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
