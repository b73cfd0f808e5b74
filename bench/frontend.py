"""Front-end capacity: requests/s of the HTTP path when the model costs the host no CPU.

Not a test: a measurement of the request path a GPU leaves exposed. On a GPU a small embedder
computes about a million tokens per second, so what caps a server is the CPU work around the
model: HTTP, JSON, validation, tokenization and encoding. This runs our server on the
device-shaped benchmark model (``--model device``, the default:
:data:`embedding_server.device.fake.DEVICE_MODEL`, all-MiniLM-L6-v2's real tokenizer and
forward passes that wait an H100's time for MiniLM with the GIL released and no CPU spent) and
drives, side by side in one run:

* our server (``embedding-server serve``) on that model, once per ``--api-workers`` value;
* the ceiling: a bare ASGI app on the same uvicorn, with orjson and the same ``tokenizers``
  tokenizer, that tokenizes the input and returns a fixed vector of the model's width in the
  OpenAI shape (it never waits for a device: the ceiling of a Python front end);
* infinity-emb, when ``--infinity-python`` names a Python that has it, on the near-zero model
  (a 1-layer, 32-wide BERT with MiniLM's tokenizer, built here with random weights: infinity
  cannot load our fake model), beside our server on that same near-zero model.

``--model bert`` runs our server on the near-zero BERT against the ceiling instead (the
measurement before the device model existed): its forward passes cost the same CPU the
front end needs, which a GPU would not.

Targets, printed beside the figures: single process, on the device model, >= 0.6x
the ceiling's requests/s on single texts and on 32-text requests, at p99 no worse than the
ceiling's plus 10 ms; >= 3x infinity-emb's requests/s on single texts (near-zero model).

The servers run in ``--rounds`` rounds (3 by default): in each, every server starts afresh, is
measured on both loads and stops, in turns. A shared VM's speed drifts between minutes, so one
run of each, minutes apart, can put either side ahead; each ratio is taken within a round and
the figure is the rounds' median, with every round's printed beside it.

Load comes from ``wrk`` (Debian's, C, one thread) with a Lua script cycling through a
deterministic mixed-length corpus: single-text requests, then 32-text requests, 32
connections. Server and client are pinned to different CPUs (``taskset``) so that the client's
own CPU use does not distort the server's figures. Prints requests/s, texts/s, p50, p99, the
CPU time the server's processes spent per request (steadier than requests/s on a shared
machine, whose speed drifts between runs), and the ratios to the ceiling and to
infinity-emb; writes bench/out/frontend.json and .png.

``--api-workers 1,2`` measures our server once per front-end count (``embedding-server xN``
for N > 1) and prints each one's ratio to one process. More front-ends only help where they
get CPUs of their own: the engine process and every front-end share ``--server-cpus``, so give
that as many CPUs as you can spare from wrk (on a 2-CPU machine, ``--server-cpus 0,1
--client-cpus 1`` shares one with wrk, which then understates every server alike).

``--py-spy PATH`` (a py-spy binary) profiles our single-process server on each load in an
extra, unmeasured wrk run (py-spy's sampling is not free) and prints its top frames, by own
time and by time under them, into ``bench/out/frontend-profile-<load>.txt``.

    .venv/bin/python -m bench.frontend [--seconds 15] [--infinity-python PATH]
    .venv/bin/python -m bench.frontend --api-workers 1,2 --server-cpus 0,1 --client-cpus 1
    .venv/bin/python -m bench.frontend --py-spy .venv/bin/py-spy
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench import out_dir, write_results
from bench.corpus import make_corpus
from bench.models import build_tiny_bert
from bench.processes import cpu_seconds, main_thread_cpu_seconds, serve_command
from e2e.harness.proc import child_process, free_port

OUT = out_dir()
MODEL_NAME = "frontend-bert"
DEVICE_DIM = 384
"""The device model's vector width (MiniLM's): the ceiling answers vectors this wide."""
BERT_DIM = 32
"""The near-zero BERT's width."""
CEILING_TARGET = 0.6
INFINITY_TARGET = 3.0
P99_SLACK_MS = 10.0
"""Our p99 may exceed the ceiling's by this much."""

WRK_SCRIPT = r"""
local bodies = {}
local index = 0
function init(args)
  for line in io.lines(args[1]) do bodies[#bodies + 1] = line end
end
function request()
  index = index % #bodies + 1
  return wrk.format("POST", "/v1/embeddings", {["Content-Type"] = "application/json"},
                    bodies[index])
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'RESULT {"requests": %d, "duration_us": %d, "socket_errors": %d, "non2xx": %d, ' ..
    '"p50_us": %d, "p99_us": %d}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99)))
end
"""


@dataclass
class Result:
    server: str
    load: str
    texts_per_request: int
    requests_per_s: float
    texts_per_s: float
    p50_ms: float
    p99_ms: float
    failed: int
    cpu_us_per_request: float
    """CPU time (user + system) the server's processes spent per answered request: steadier
    than requests/s on a shared machine, whose speed drifts between runs."""
    loop_cpu_us_per_request: float
    """The part of it spent on the processes' main threads, which run the event loops (HTTP,
    validation, inline tokenization, the answer); the rest is the model's forward thread,
    batch preparation and tokenizer threads. The ceiling does all its work there."""
    round: int = 0
    """Which round of ``--rounds`` measured it: every server runs once per round, in turns."""


# -- the ceiling: a bare ASGI app --------------------------------------------------------------


def ceiling_app(model_dir: Path, dim: int = BERT_DIM) -> Any:
    """The least a Python server can do per request: parse, tokenize, answer."""
    import orjson
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.enable_truncation(512)
    tokenizer.no_padding()  # MiniLM's tokenizer.json pads to 128; no server does
    vector = [0.125] * dim

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = orjson.loads(body)
        inputs = request["input"] if isinstance(request["input"], list) else [request["input"]]
        tokens = sum(len(e.ids) for e in tokenizer.encode_batch_fast(inputs))
        payload = orjson.dumps(
            {
                "object": "list",
                "data": [
                    {"object": "embedding", "index": i, "embedding": vector}
                    for i in range(len(inputs))
                ],
                "model": request.get("model", MODEL_NAME),
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    return app


def serve_ceiling(model_dir: Path, port: int, dim: int) -> None:
    import uvicorn

    uvicorn.run(
        ceiling_app(model_dir, dim),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
    )


# -- running servers and load ------------------------------------------------------------------


def pinned(cpus: str, command: list[str]) -> list[str]:
    return ["taskset", "-c", cpus, *command] if cpus and shutil.which("taskset") else command


@contextlib.contextmanager
def running(
    name: str, command: list[str], port: int, log: Path
) -> Iterator[tuple[str, psutil.Process]]:
    """Start a server, wait until it embeds a text (deadline 300 s), stop it afterwards."""
    url = f"http://127.0.0.1:{port}"
    with (
        log.open("wb") as out,
        child_process(command, stdout=out, stderr=subprocess.STDOUT, grace=30) as process,
    ):
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                response = httpx.post(
                    f"{url}/v1/embeddings",
                    json={"model": MODEL_NAME, "input": "warm up"},
                    timeout=5,
                )
                if response.status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not serve within 300 s; see {log}")
            time.sleep(0.5)
        yield url, psutil.Process(process.pid)


def write_bodies(path: Path, texts: list[str], per_request: int) -> Path:
    with path.open("w") as out:
        for start in range(0, len(texts) - per_request + 1, per_request):
            chunk = texts[start : start + per_request]
            body = {"model": MODEL_NAME, "input": chunk[0] if per_request == 1 else chunk}
            out.write(json.dumps(body) + "\n")
    return path


def drive(
    url: str, script: Path, bodies: Path, seconds: int, connections: int, cpus: str
) -> dict[str, int]:
    """One wrk run; returns the RESULT line its Lua ``done`` hook prints."""
    command = pinned(
        cpus,
        [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{seconds}s",
            "--timeout",
            "10s",
            "-s",
            str(script),
            url,
            "--",
            str(bodies),
        ],
    )
    out = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60, check=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            parsed: dict[str, int] = json.loads(line.removeprefix("RESULT "))
            return parsed
    raise RuntimeError(f"wrk printed no result:\n{out.stdout}\n{out.stderr}")


def measure(
    name: str,
    url: str,
    server: psutil.Process,
    script: Path,
    loads: dict[str, tuple[int, Path]],
    args: argparse.Namespace,
    round_: int = 0,
) -> list[Result]:
    results = []
    for load, (per_request, bodies) in loads.items():
        drive(url, script, bodies, 3, args.connections, args.client_cpus)  # warm-up
        cpu_before, loop_before = cpu_seconds(server), main_thread_cpu_seconds(server)
        raw = drive(url, script, bodies, args.seconds, args.connections, args.client_cpus)
        # Read in nesting order, so the loops' window lies within the whole's.
        loop_cpu = main_thread_cpu_seconds(server) - loop_before
        cpu = cpu_seconds(server) - cpu_before
        seconds = raw["duration_us"] / 1e6
        ok = raw["requests"] - raw["non2xx"]
        results.append(
            Result(
                server=name,
                load=load,
                texts_per_request=per_request,
                requests_per_s=ok / seconds,
                texts_per_s=ok * per_request / seconds,
                p50_ms=raw["p50_us"] / 1000,
                p99_ms=raw["p99_us"] / 1000,
                failed=raw["non2xx"] + raw["socket_errors"],
                cpu_us_per_request=cpu / max(ok, 1) * 1e6,
                loop_cpu_us_per_request=loop_cpu / max(ok, 1) * 1e6,
                round=round_,
            )
        )
        print(
            f"round {round_ + 1} {name:>16} {load:>8}: {results[-1].requests_per_s:8.0f} req/s "
            f"{results[-1].texts_per_s:8.0f} texts/s  p50 {results[-1].p50_ms:6.1f} ms  "
            f"p99 {results[-1].p99_ms:6.1f} ms  CPU {results[-1].cpu_us_per_request:6.0f} us/req "
            f"(loop {results[-1].loop_cpu_us_per_request:5.0f})  "
            f"failed {results[-1].failed}",
            flush=True,
        )
    return results


def chart(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({r.load for r in results})
    servers = list(dict.fromkeys(r.server for r in results))
    figure, axes = plt.subplots(1, len(loads), figsize=(5 * len(loads), 3.5))
    for axis, load in zip([axes] if len(loads) == 1 else axes, loads, strict=True):
        values = [
            median([r.texts_per_s for r in results if r.server == s and r.load == load])
            for s in servers
        ]
        palette = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860"]
        axis.bar(servers, values, color=[palette[i % len(palette)] for i in range(len(servers))])
        axis.set_title(f"{load} requests: texts/s (median of rounds)")
    figure.tight_layout()
    figure.savefig(path)


def ours_command(model: str, workers: int) -> list[str]:
    """Our server on ``model`` (a directory or the fake device model), ``workers`` front-ends."""
    command = serve_command(
        model, "{port}", "--served-model-name", MODEL_NAME, "--dtype", "float32"
    )
    return [*command, "--api-workers", str(workers)] if workers > 1 else command


def infinity_command(python: str, model: Path) -> list[str]:
    return [
        python,
        "-m",
        "infinity_emb.cli",
        "v2",
        "--model-id",
        str(model),
        "--served-model-name",
        MODEL_NAME,
        "--engine",
        "torch",
        "--device",
        "cpu",
        "--port",
        "{port}",
        # Its routes then match the OpenAI path every server here is driven on.
        "--url-prefix",
        "/v1",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=15, help="length of each measured run")
    parser.add_argument("--connections", type=int, default=32, help="wrk connections")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds: each server runs once per round, in turns; ratios are per round, and "
        "the figure is their median",
    )
    parser.add_argument("--texts", type=int, default=2048, help="corpus size")
    parser.add_argument("--server-cpus", default="0", help="CPUs the servers run on (taskset)")
    parser.add_argument("--client-cpus", default="1", help="CPUs wrk runs on (taskset)")
    parser.add_argument("--infinity-python", help="a Python with infinity-emb installed")
    parser.add_argument(
        "--model",
        choices=("device", "bert"),
        default="device",
        help="what our server runs against the ceiling: the device-shaped benchmark model "
        "(MiniLM's tokenizer, an H100's time, no CPU) or the near-zero BERT",
    )
    parser.add_argument(
        "--api-workers",
        default="1",
        help="our server's --api-workers values to measure, comma-separated (e.g. 1,2)",
    )
    parser.add_argument(
        "--no-ceiling", action="store_true", help="skip the bare ASGI ceiling (saves a run)"
    )
    parser.add_argument(
        "--py-spy", help="a py-spy binary: profile our server on each load (an extra run each)"
    )
    parser.add_argument("--ceiling-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ceiling-dim", type=int, default=BERT_DIM, help=argparse.SUPPRESS)
    parser.add_argument(
        "--model-dir", type=Path, default=OUT / "frontend-model", help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.ceiling_port:  # the child process that serves the ceiling app
        serve_ceiling(args.model_dir, args.ceiling_port, args.ceiling_dim)
        return 0
    if shutil.which("wrk") is None:
        print("wrk is not installed: apt-get install wrk", file=sys.stderr)
        return 2
    # Here, not at the top: the ceiling's process (above) stays free of torch.
    from embedding_server.device.fake import DEVICE_MODEL

    work = OUT / "frontend"
    work.mkdir(parents=True, exist_ok=True)
    bert = build_tiny_bert(args.model_dir)
    script = work / "wrk.lua"
    script.write_text(WRK_SCRIPT)
    texts = make_corpus(args.texts, max_words=120)
    loads = {
        "1-text": (1, write_bodies(work / "single.jsonl", texts, 1)),
        "32-text": (32, write_bodies(work / "batch32.jsonl", texts, 32)),
    }
    device = args.model == "device"
    print(
        f"our server runs {DEVICE_MODEL if device else 'the near-zero BERT'}; "
        f"CPU: {cpu_name()}; server CPUs {args.server_cpus}, wrk CPUs {args.client_cpus}",
        flush=True,
    )
    servers: list[tuple[str, list[str]]] = []
    for workers in sorted({int(n) for n in args.api_workers.split(",") if n.strip()}):
        name = "embedding-server" if workers == 1 else f"embedding-server x{workers}"
        servers.append((name, ours_command(DEVICE_MODEL if device else str(bert), workers)))
    infinity_note = ""
    if args.infinity_python and Path(args.infinity_python).exists():
        if device:  # infinity cannot load the fake model: both run the near-zero BERT
            servers.append((NEAR_ZERO_OURS, ours_command(str(bert), 1)))
        servers.append(("infinity-emb", infinity_command(args.infinity_python, bert)))
    else:
        infinity_note = (
            "infinity-emb: not measured (no --infinity-python with it installed; "
            "`make bench` installs it in bench/out/infinity-venv)"
        )
        print(infinity_note)
    if not args.no_ceiling:
        ceiling = [
            sys.executable,
            "-m",
            "bench.frontend",
            "--model-dir",
            str(bert),
            "--ceiling-port",
            "{port}",
            "--ceiling-dim",
            str(DEVICE_DIM if device else BERT_DIM),
        ]
        servers.append(("ceiling", ceiling))
    results: list[Result] = []
    profile: list[str] = []
    # Rounds: every server once per round, in turns, each in a fresh process. This VM's speed
    # drifts by a third between minutes, so a ratio is taken within a round (its two servers
    # ran minutes apart at most) and the rounds' median is the figure.
    for round_ in range(args.rounds):
        for name, command in servers:
            if name == "infinity-emb" and infinity_note:
                continue  # it failed to start in an earlier round
            port = free_port()
            command = [part.replace("{port}", str(port)) for part in command]
            log = work / f"{name.replace(' ', '-')}.log"
            try:
                with running(name, pinned(args.server_cpus, command), port, log) as (url, server):
                    results.extend(measure(name, url, server, script, loads, args, round_))
                    if args.py_spy and name == "embedding-server" and round_ == 0:
                        for load, (_, bodies) in loads.items():
                            profile += profile_load(load, url, server, script, bodies, args)
            except RuntimeError as error:
                if name != "infinity-emb":
                    raise
                infinity_note = f"infinity-emb: not measured ({error})"
                print(infinity_note)
    summary = ratios(results)
    if infinity_note:
        summary.append(infinity_note)
    for line in summary:
        print(line)
    for line in profile:
        print(line)
    written = write_results(
        "frontend",
        {
            "model": DEVICE_MODEL if device else "near-zero BERT",
            "cpu": cpu_name(),
            "results": [asdict(r) for r in results],
            "ratios": summary,
        },
    )
    chart(results, OUT / "frontend.png")
    print(f"wrote {written} and {OUT / 'frontend.png'}")
    return 0


NEAR_ZERO_OURS = "embedding-server (near-zero BERT)"
"""Our server on the near-zero BERT, run beside infinity-emb when the device model is ours."""


def cpu_name() -> str:
    """The CPU's model name, as the performance log records it."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def profile_load(
    load: str,
    url: str,
    server: psutil.Process,
    script: Path,
    bodies: Path,
    args: argparse.Namespace,
) -> list[str]:
    """py-spy on our server under one load (an extra wrk run, not measured): its top frames
    by own time and by time under them, written to frontend-profile-<load>.txt."""
    raw = OUT / f"frontend-profile-{load}.folded"
    seconds = max(args.seconds, 5)
    command = [
        args.py_spy,
        "record",
        "--pid",
        str(server.pid),
        "--duration",
        str(seconds),
        "--rate",
        "200",
        "--format",
        "raw",
        "--nonblocking",
        "--threads",
        "--output",
        str(raw),
    ]
    spy = subprocess.Popen(
        pinned(args.client_cpus, command), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    time.sleep(1)  # py-spy attaches
    drive(url, script, bodies, seconds, args.connections, args.client_cpus)
    _, error = spy.communicate(timeout=seconds + 60)
    if spy.returncode != 0 or not raw.exists():
        return [f"py-spy failed ({spy.returncode}): {error.decode(errors='replace')[-300:]}"]
    lines = top_frames(raw.read_text(), load)
    (OUT / f"frontend-profile-{load}.txt").write_text("\n".join(lines) + "\n")
    return lines


def top_frames(folded: str, load: str, count: int = 20) -> list[str]:
    """The ``count`` frames with the most samples of their own, and with the most samples
    under them, from py-spy's folded stacks (``thread;frame;frame samples`` per line), as
    percentages of all samples, after each thread's share."""
    own: collections.Counter[str] = collections.Counter()
    under: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in folded.splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack or not samples.isdigit():
            continue
        n = int(samples)
        frames = stack.split(";")
        if frames[0].startswith("process "):
            frames = frames[1:]
        if frames and frames[0].startswith("thread ("):
            threads[frames[0]] += n
            frames = frames[1:]
        if not frames:
            continue
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            under[frame] += n
    if not total:
        return ["py-spy: no samples"]
    out = [f"py-spy, {load}: {total} samples (idle threads left out as py-spy can)"]
    out += [f"  {100 * n / total:5.1f}%  {name}" for name, n in threads.most_common(8)]
    out.append("top frames by own time:")
    out += [f"  {100 * n / total:5.1f}%  {name}" for name, n in own.most_common(count)]
    out.append("top frames by time under them:")
    out += [f"  {100 * n / total:5.1f}%  {name}" for name, n in under.most_common(count)]
    return out


def verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def merged(results: list[Result], server: str, load: str) -> Result | None:
    """``server``'s figures on ``load``: the median of its rounds, field by field."""
    runs = [r for r in results if r.server == server and r.load == load]
    if not runs:
        return None
    return Result(
        server=server,
        load=load,
        texts_per_request=runs[0].texts_per_request,
        requests_per_s=median([r.requests_per_s for r in runs]),
        texts_per_s=median([r.texts_per_s for r in runs]),
        p50_ms=median([r.p50_ms for r in runs]),
        p99_ms=median([r.p99_ms for r in runs]),
        failed=sum(r.failed for r in runs),
        cpu_us_per_request=median([r.cpu_us_per_request for r in runs]),
        loop_cpu_us_per_request=median([r.loop_cpu_us_per_request for r in runs]),
    )


def round_ratios(results: list[Result], server: str, other: str, load: str) -> list[float]:
    """``server``'s requests/s over ``other``'s on ``load``, in each round both ran."""
    by = {(r.server, r.load, r.round): r for r in results}
    out = []
    for round_ in sorted({r.round for r in results}):
        mine, theirs = by.get((server, load, round_)), by.get((other, load, round_))
        if mine is not None and theirs is not None and theirs.requests_per_s > 0:
            out.append(mine.requests_per_s / theirs.requests_per_s)
    return out


def described(ratios: list[float]) -> str:
    """The median of per-round ratios, and each round's."""
    rounds = ", ".join(f"{r:.2f}" for r in ratios)
    return f"{median(ratios):.2f}x requests/s (median of rounds: {rounds})"


def ratios(results: list[Result]) -> list[str]:
    """The comparisons, each a median of per-round ratios, with the targets."""
    lines = []
    for load in dict.fromkeys(r.load for r in results):
        ours = merged(results, "embedding-server", load)
        ceiling = merged(results, "ceiling", load)
        per_round = round_ratios(results, "embedding-server", "ceiling", load)
        if ours is not None and ceiling is not None and per_round:
            ratio = median(per_round)
            p99_limit = ceiling.p99_ms + P99_SLACK_MS
            lines.append(
                f"{load}: embedding-server / ceiling = {described(per_round)} "
                f"(target >= {CEILING_TARGET}x: {verdict(ratio >= CEILING_TARGET)}), "
                f"p99 {ours.p99_ms:.1f} vs {ceiling.p99_ms:.1f} ms (target <= "
                f"{p99_limit:.1f} ms: {verdict(ours.p99_ms <= p99_limit)}), "
                f"CPU per request {ours.cpu_us_per_request:.0f} vs "
                f"{ceiling.cpu_us_per_request:.0f} us"
                + (
                    f" ({ceiling.cpu_us_per_request / ours.cpu_us_per_request:.2f}x)"
                    if ours.cpu_us_per_request > 0
                    else ""
                )
            )
            lines.append(budget_line(load, ours, ceiling, CEILING_TARGET))
        near_zero_name = (
            NEAR_ZERO_OURS
            if any(r.server == NEAR_ZERO_OURS for r in results)
            else "embedding-server"
        )
        near_zero = merged(results, near_zero_name, load)
        infinity = merged(results, "infinity-emb", load)
        per_round = round_ratios(results, near_zero_name, "infinity-emb", load)
        if near_zero is not None and infinity is not None and per_round:
            ratio = median(per_round)
            target = f" (target >= {INFINITY_TARGET}x: {verdict(ratio >= INFINITY_TARGET)})"
            lines.append(
                f"{load}: {near_zero.server} / infinity-emb (near-zero BERT) = "
                f"{described(per_round)}{target if load == '1-text' else ''}, p99 "
                f"{near_zero.p99_ms:.1f} vs {infinity.p99_ms:.1f} ms, CPU per request "
                f"{near_zero.cpu_us_per_request:.0f} vs {infinity.cpu_us_per_request:.0f} us"
            )
    for name in dict.fromkeys(r.server for r in results):
        if not name.startswith("embedding-server x"):
            continue
        for load in dict.fromkeys(r.load for r in results):
            one, many = merged(results, "embedding-server", load), merged(results, name, load)
            per_round = round_ratios(results, name, "embedding-server", load)
            if one and many and per_round:
                lines.append(
                    f"{load}: {name} / embedding-server = {described(per_round)}, "
                    f"p99 {many.p99_ms:.0f} vs {one.p99_ms:.0f} ms"
                )
                per_round = round_ratios(results, name, "ceiling", load)
                if per_round:
                    lines.append(
                        f"{load}: {name} / ceiling = {described(per_round)} "
                        f"(the target is single-process; for comparison)"
                    )
    return lines


def budget_line(load: str, ours: Result, ceiling: Result, target: float) -> str:
    """Where the CPU budget of the target goes: on one CPU, ``target`` x the ceiling's
    requests/s leaves ``ceiling CPU / target`` per request, and the server's threads other
    than the event loop (the model's forward passes, which the ceiling never runs, and the
    tokenizer threads that take big requests off the loop) spend their share of it too."""
    budget = ceiling.cpu_us_per_request / target
    besides_loop = ours.cpu_us_per_request - ours.loop_cpu_us_per_request
    return (
        f"{load}: {target}x the ceiling leaves {budget:.0f} us of CPU per request; ours spends "
        f"{ours.loop_cpu_us_per_request:.0f} us on its event loop (the ceiling's whole "
        f"request: {ceiling.cpu_us_per_request:.0f} us) and {besides_loop:.0f} us on its other "
        "threads (the model's forward passes, batch preparation, tokenizer threads)"
    )


if __name__ == "__main__":
    sys.exit(main())
