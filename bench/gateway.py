"""The gateway's cost and its routing: added latency, requests/s, least-backlog vs random.

Not a test: a measurement on loopback, with real ``embedding-server serve`` processes on the
fake backend (a real HTTP server, tokenizer, scheduler and pooling around a weightless
model, so the numbers are the gateway's and the server's, not a model's) and real
``embedding-server gateway`` processes with a static routes file. In order:

1. **Added latency.** One client, one request at a time, alternating rounds of direct calls
   to the server and calls through the gateway; p50/p99 of each and the difference (best of
   the rounds, as the box is shared). Target: under 1 ms added at p50. The same for the
   two client libraries the gateway could forward with (aiohttp, which it uses, and httpx).
2. **Requests/s.** ``--clients`` concurrent clients for ``--seconds``, direct and through the
   gateway, and the gateway process's CPU seconds per request: the requests/s one gateway
   core carries (the fleet it can front without being the bottleneck).
3. **Least-backlog vs random.** Two servers whose forward pass takes ``--pass-ms`` for at
   most ``--batch-tokens`` tokens; an open loop (Poisson arrivals, the same rate and the
   same request sequence for both) of short requests (one short text) and long ones
   (``--long-texts`` texts of ``--long-bytes`` bytes, many forward passes each), through a
   gateway with ``--balancing least-backlog`` and then ``random`` (kube-proxy's choice).
   p50/p99 of short and of all requests.

    python -m bench.gateway                 # about three minutes
    python -m bench.gateway --rounds 1 --sequential 200 --seconds 2 --requests 200  # smoke

Writes bench/out/gateway.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench import out_dir, write_results
from e2e.harness.proc import child_process, free_port

OUT = out_dir()
BIN = Path(sys.executable).parent
MODEL = "fake-embedder"
TARGET_ADDED_P50_MS = 1.0


def _env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("EMBEDDING_SERVER_", "EMBEDDING_GATEWAY_"))
    }


def _wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 120) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {process.returncode}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(url + "/ready", timeout=2) as answer,
        ):
            if answer.status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


@contextlib.contextmanager
def server(model: str, *extra: str) -> Iterator[str]:
    port = free_port()
    argv = [str(BIN / "embedding-server"), "serve", "--model", model, "--port", str(port)]
    argv += ["--served-model-name", MODEL, "--log-level", "warning", *extra]
    with child_process(argv, env=_env(), stdout=subprocess.DEVNULL) as process:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, process)
        yield url


@contextlib.contextmanager
def gateway(endpoints: list[str], *extra: str) -> Iterator[tuple[str, psutil.Process]]:
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        routes = Path(folder) / "routes.json"
        routes.write_text(json.dumps({"models": [{"name": MODEL, "endpoints": endpoints}]}))
        argv = [str(BIN / "embedding-server"), "gateway", "--port", str(port)]
        argv += ["--routes-file", str(routes), "--log-level", "warning", *extra]
        argv += ["--models-listing", "full"]  # _wait_routed reads the ready endpoints
        with child_process(argv, env=_env(), stdout=subprocess.DEVNULL) as process:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(url, process)
            _wait_routed(url, len(endpoints))
            yield url, psutil.Process(process.pid)


def _wait_routed(url: str, endpoints: int) -> None:
    import urllib.request

    for _ in range(200):
        with urllib.request.urlopen(url + "/v1/models", timeout=2) as answer:
            if json.load(answer)["data"][0]["ready_endpoints"] == endpoints:
                return
        time.sleep(0.05)
    raise RuntimeError("the gateway never saw its endpoints ready")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _body(texts: list[str]) -> bytes:
    return json.dumps({"model": MODEL, "input": texts}).encode()


async def sequential(url: str, count: int) -> list[float]:
    """``count`` requests one at a time; their latencies in ms."""
    body = _body(["How far is the moon from the earth?"])
    headers = {"Content-Type": "application/json"}
    latencies = []
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(count + 20):
            started = time.perf_counter()
            async with session.post(url + "/v1/embeddings", data=body, headers=headers) as r:
                await r.read()
                assert r.status == 200, r.status
            latencies.append((time.perf_counter() - started) * 1000)
    return latencies[20:]  # the first ones open the connection and warm the path


async def closed_loop(url: str, clients: int, seconds: float) -> int:
    """Requests answered by ``clients`` concurrent clients within ``seconds``."""
    body = _body(["How far is the moon from the earth?"])
    headers = {"Content-Type": "application/json"}
    done = 0
    stop = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                async with session.post(url + "/v1/embeddings", data=body, headers=headers) as r:
                    await r.read()
                    assert r.status == 200, r.status
                done += 1

        await asyncio.gather(*(client() for _ in range(clients)))
    return done


def mixed_workload(args: argparse.Namespace) -> list[tuple[float, bool, bytes]]:
    """(arrival second, is_long, body) for the open loop; the same for both policies."""
    rng = random.Random(7)
    at = 0.0
    work = []
    long_body = _body(["x" * args.long_bytes] * args.long_texts)
    for index in range(args.requests):
        at += rng.expovariate(args.rate)
        is_long = rng.random() < args.long_share
        short = _body([f"short query number {index}"])
        work.append((at, is_long, long_body if is_long else short))
    return work


async def open_loop(url: str, work: list[tuple[float, bool, bytes]]) -> list[tuple[bool, float]]:
    headers = {"Content-Type": "application/json"}
    results: list[tuple[bool, float]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()

        async def one(at: float, is_long: bool, body: bytes) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sent = time.perf_counter()
            async with session.post(url + "/v1/embeddings", data=body, headers=headers) as r:
                await r.read()
                assert r.status == 200, r.status
            results.append((is_long, (time.perf_counter() - sent) * 1000))

        await asyncio.gather(*(one(*item) for item in work))
    return results


async def sequential_httpx(url: str, count: int) -> list[float]:
    """As :func:`sequential`, with httpx's AsyncClient: the other client the gateway could
    have been built on."""
    import httpx

    body = _body(["How far is the moon from the earth?"])
    headers = {"Content-Type": "application/json"}
    latencies = []
    async with httpx.AsyncClient(base_url=url) as client:
        for _ in range(count + 20):
            started = time.perf_counter()
            answer = await client.post("/v1/embeddings", content=body, headers=headers)
            assert answer.status_code == 200, answer.status_code
            latencies.append((time.perf_counter() - started) * 1000)
    return latencies[20:]


def bench_overhead(args: argparse.Namespace) -> dict[str, Any]:
    with server("fake?dim=32") as direct, gateway([direct]) as (through, process):
        rounds = []
        for _ in range(args.rounds):
            d = asyncio.run(sequential(direct, args.sequential))
            g = asyncio.run(sequential(through, args.sequential))
            rounds.append(
                {
                    "direct_p50": statistics.median(d),
                    "direct_p99": percentile(d, 0.99),
                    "gateway_p50": statistics.median(g),
                    "gateway_p99": percentile(g, 0.99),
                }
            )
        best = min(rounds, key=lambda r: r["gateway_p50"] - r["direct_p50"])
        # The client library the gateway forwards with, measured the same way (direct).
        clients = []
        for _ in range(args.rounds):
            a = asyncio.run(sequential(direct, args.sequential))
            h = asyncio.run(sequential_httpx(direct, args.sequential))
            clients.append((statistics.median(a), statistics.median(h)))
        aiohttp_p50, httpx_p50 = min(clients, key=lambda pair: pair[0] + pair[1])
        rps_direct = asyncio.run(closed_loop(direct, args.clients, args.seconds)) / args.seconds
        cpu_before = sum(process.cpu_times()[:2])
        answered = asyncio.run(closed_loop(through, args.clients, args.seconds))
        cpu = sum(process.cpu_times()[:2]) - cpu_before
    return {
        **best,
        "added_p50": best["gateway_p50"] - best["direct_p50"],
        "added_p99": best["gateway_p99"] - best["direct_p99"],
        "client_aiohttp_p50": aiohttp_p50,
        "client_httpx_p50": httpx_p50,
        "rps_direct": rps_direct,
        "rps_gateway": answered / args.seconds,
        "gateway_cpu_ms_per_request": cpu / answered * 1000,
        "rps_per_gateway_core": answered / cpu if cpu else float("inf"),
    }


def bench_balancing(args: argparse.Namespace) -> dict[str, Any]:
    model = f"fake?dim=32&delay_ms={args.pass_ms}&max_len={args.long_bytes + 2}"
    flags = ("--max-batch-tokens", str(args.batch_tokens))
    work = mixed_workload(args)
    figures: dict[str, Any] = {}
    runs: dict[str, list[list[tuple[bool, float]]]] = {"least-backlog": [], "random": []}
    with server(model, *flags) as a, server(model, *flags) as b:
        # Alternating, so a noisy spell on the shared box hits both policies alike; the
        # round with the lowest p99 of each counts.
        for _ in range(args.rounds):
            for policy in runs:
                with gateway([a, b], "--balancing", policy) as (url, _):
                    asyncio.run(open_loop(url, work[:20]))  # warm both servers' paths
                    runs[policy].append(asyncio.run(open_loop(url, work)))
    for policy, rounds in runs.items():
        best = min(rounds, key=lambda results: percentile([ms for _, ms in results], 0.99))
        short = [ms for is_long, ms in best if not is_long]
        every = [ms for _, ms in best]
        figures[policy] = {
            "short_p50": statistics.median(short),
            "short_p99": percentile(short, 0.99),
            "all_p50": statistics.median(every),
            "all_p99": percentile(every, 0.99),
        }
    return figures


def report(overhead: dict[str, Any], balancing: dict[str, Any], args: argparse.Namespace) -> str:
    o = overhead
    if not o:
        return _report_balancing(balancing, args)
    verdict = "met" if o["added_p50"] < TARGET_ADDED_P50_MS else "MISSED"
    lines = [
        "Gateway overhead (one client, sequential; best of "
        f"{args.rounds} rounds of {args.sequential}):",
        f"  direct   p50 {o['direct_p50']:.3f} ms  p99 {o['direct_p99']:.3f} ms",
        f"  gateway  p50 {o['gateway_p50']:.3f} ms  p99 {o['gateway_p99']:.3f} ms",
        f"  added    p50 {o['added_p50']:.3f} ms  p99 {o['added_p99']:.3f} ms"
        f"   (target p50 < {TARGET_ADDED_P50_MS:.0f} ms: {verdict})",
        f"Client library, direct, one client: aiohttp p50 {o['client_aiohttp_p50']:.3f} ms, "
        f"httpx p50 {o['client_httpx_p50']:.3f} ms",
        f"Requests/s ({args.clients} clients, {args.seconds:.0f} s): direct "
        f"{o['rps_direct']:.0f}, through the gateway {o['rps_gateway']:.0f}; gateway CPU "
        f"{o['gateway_cpu_ms_per_request']:.3f} ms/request = "
        f"{o['rps_per_gateway_core']:.0f} requests/s per gateway core",
        _report_balancing(balancing, args),
    ]
    return "\n".join(lines)


def _report_balancing(balancing: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"Least-backlog vs random (2 servers, {args.rate:.0f} req/s open loop, "
        f"{args.long_share:.0%} long = {args.long_texts}x{args.long_bytes} B, "
        f"{args.pass_ms} ms per {args.batch_tokens}-token pass):",
    ]
    for policy, f in balancing.items():
        lines.append(
            f"  {policy:<14} short p50 {f['short_p50']:.1f} ms  p99 {f['short_p99']:.1f} ms"
            f"   all p50 {f['all_p50']:.1f} ms  p99 {f['all_p99']:.1f} ms"
        )
    lb, rnd = balancing["least-backlog"], balancing["random"]
    lines.append(
        f"  random / least-backlog: short p99 x{rnd['short_p99'] / lb['short_p99']:.2f}, "
        f"all p99 x{rnd['all_p99'] / lb['all_p99']:.2f} (target: > 1)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (each part)")
    parser.add_argument("--sequential", type=int, default=1000, help="requests per round")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients")
    parser.add_argument("--seconds", type=float, default=5.0, help="closed-loop duration")
    parser.add_argument("--requests", type=int, default=800, help="open-loop requests")
    parser.add_argument("--rate", type=float, default=40.0, help="open-loop requests/s")
    parser.add_argument("--long-share", type=float, default=0.1, help="share of long requests")
    parser.add_argument("--long-texts", type=int, default=16, help="texts per long request")
    parser.add_argument("--long-bytes", type=int, default=500, help="bytes per long text")
    parser.add_argument("--pass-ms", type=float, default=10.0, help="fake forward-pass time")
    parser.add_argument("--batch-tokens", type=int, default=1024, help="tokens per pass")
    parser.add_argument("--skip-overhead", action="store_true", help="routing comparison only")
    args = parser.parse_args()
    overhead = {} if args.skip_overhead else bench_overhead(args)
    balancing = bench_balancing(args)
    text = report(overhead, balancing, args)
    print(text)
    write_results("gateway", {"args": vars(args), "overhead": overhead, "balancing": balancing})


if __name__ == "__main__":
    main()
