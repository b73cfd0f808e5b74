"""infinity-emb's int8 modes beside ours in ``bench.offline`` (``--infinity-python``).

infinity-emb lives in its own virtualenv (``make bench`` installs it in
``bench/out/infinity-venv``), so each of its modes runs in a worker process of that Python
(``bench/infinity_worker.py``) that loads the model once and embeds the corpus whenever it is
told to: the rounds of ``bench.offline`` alternate between ours and theirs as between ours and
sentence-transformers'. The worker times itself (wall, and its own CPU time over all its
threads), so the pipe between the two processes is not counted against it.

The two int8 modes infinity-emb has on a CPU:

* ``torch`` with ``--dtype int8``: ``torch.quantization.quantize_dynamic`` on every
  ``nn.Linear`` (fbgemm's dynamic int8 kernel, one activation scale per call);
* ``optimum``: onnxruntime on an int8 ONNX file from the model directory (it prefers a file
  named ``*quantize*`` on a CPU). MiniLM's packaged directory has none, so the worker exports
  one first, dynamically quantized by optimum with the configuration for this CPU's
  instruction set, cached under the output folder.

A mode that does not install, export, start or run is reported with its error, never
replaced by something else.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

import numpy as np

from bench import out_dir

WORKER = Path(__file__).resolve().parent / "infinity_worker.py"
MARK = "@@infinity-worker "
START_SECONDS = 900.0
"""How long a worker may take to load, quantize and warm up (onnxruntime's graph optimizer on
a shared 2-core machine takes minutes)."""
EXPORT_SECONDS = 900.0
RUN_SECONDS = 900.0
MODES = ("torch", "optimum")


def _env(threads: int, hf_home: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if hf_home is not None:
        env["HF_HOME"] = str(hf_home)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",  # everything is local: a Hub look-up is a bug
            "OMP_NUM_THREADS": str(threads),
            "INFINITY_ANONYMOUS_USAGE_STATS": "0",
            "DO_NOT_TRACK": "1",
        }
    )
    env.pop("PYTHONPATH", None)  # none of this repository's packages in infinity's process
    return env


def _answers(stream: IO[str]) -> queue.Queue[dict[str, Any]]:
    """The worker's marked lines as they come (other lines are its libraries' and are
    skipped), read on a thread so that waiting for one can have a deadline."""
    answers: queue.Queue[dict[str, Any]] = queue.Queue()

    def read() -> None:
        for line in stream:
            if line.startswith(MARK):
                answers.put(dict(json.loads(line[len(MARK) :])))
        answers.put({"error": "the worker exited without an answer"})

    threading.Thread(target=read, daemon=True).start()
    return answers


def _answer(answers: queue.Queue[dict[str, Any]], seconds: float) -> dict[str, Any]:
    try:
        return answers.get(timeout=seconds)
    except queue.Empty:
        return {"error": f"no answer from the worker in {seconds:.0f} s"}


def _isa() -> str:
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    if "avx512_vnni" in flags:
        return "avx512_vnni"
    return "avx512" if "avx512f" in flags else "avx2"


def onnx_int8_model(python: str, src: Path, label: str, threads: int) -> tuple[Path | None, str]:
    """``src`` exported to ONNX and quantized to int8 in infinity's virtualenv, cached under
    ``label``; or None and why not."""
    isa = _isa()
    dst = out_dir() / f"{re.sub(r'[^A-Za-z0-9.]+', '-', label)}-onnx-int8-{isa}"
    if (dst / "model_quantized.onnx").is_file():
        return dst, f"cached int8 ONNX export ({isa})"
    log = out_dir() / "infinity-export.log"
    with log.open("w") as errors:
        done = subprocess.run(
            [python, str(WORKER), "export", str(src), str(dst), "--isa", isa],
            env=_env(threads),
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            timeout=EXPORT_SECONDS,
            check=False,
        )
    answers = [json.loads(x[len(MARK) :]) for x in done.stdout.splitlines() if x.startswith(MARK)]
    if done.returncode != 0 or not answers or "error" in answers[-1]:
        error = answers[-1].get("error") if answers else f"exit {done.returncode}"
        return None, f"the int8 ONNX export failed ({error}; log {log})"
    return dst, f"int8 ONNX exported by optimum ({isa}): {', '.join(answers[-1]['files'])}"


class InfinityWorker:
    """One infinity-emb engine in its own process; :meth:`run` embeds the corpus once."""

    def __init__(
        self,
        name: str,
        process: subprocess.Popen[str],
        answers: queue.Queue[dict[str, Any]],
        log: IO[str],
    ) -> None:
        self.name = name
        self.process = process
        self.answers = answers
        self.log = log

    @classmethod
    def start(
        cls,
        python: str,
        model: Path,
        engine: str,
        texts_file: Path,
        threads: int,
        batch_size: int,
    ) -> tuple[InfinityWorker | None, str]:
        """A ready worker and infinity-emb's version, or None and the error.

        The optimum engine is started in the model directory and given ``.``: infinity-emb
        0.0.78 lists a local directory's ONNX files with the directory prefixed and passes
        that as ``file_name``, which optimum 2 (optimum-onnx) looks for inside the directory
        again and does not find; a Hub repository's listing is relative, and so is ``.``'s.
        Its optimized-model cache is keyed by that name, so each model gets its own HF_HOME.
        """
        out = out_dir().resolve()
        vectors = out / f"infinity-{engine}-int8.npy"
        log = (out / f"infinity-{engine}-int8.log").open("w")
        relative = engine == "optimum"
        process = subprocess.Popen(
            [
                python,
                str(WORKER),
                "serve",
                "." if relative else str(model),
                "--engine",
                engine,
                "--dtype",
                "int8" if engine == "torch" else "auto",
                "--texts",
                str(texts_file.resolve()),
                "--out",
                str(vectors),
                "--threads",
                str(threads),
                "--batch-size",
                str(batch_size),
            ],
            env=_env(threads, out / "infinity-hf" / model.name if relative else None),
            cwd=model if relative else None,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        assert process.stdout is not None
        answers = _answers(process.stdout)
        answer = _answer(answers, START_SECONDS)
        if not answer.get("ready"):
            process.kill()
            process.wait()
            log.close()
            return None, f"{answer.get('error', answer)} (log {log.name})"
        name = f"infinity-emb {answer['version']} {engine} int8"
        return cls(name, process, answers, log), ""

    def run(self) -> tuple[np.ndarray, float, float]:
        """Embed the corpus once: (vectors, wall seconds, CPU seconds), timed by the worker."""
        assert self.process.stdin is not None
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        answer = _answer(self.answers, RUN_SECONDS)
        if "error" in answer:
            raise RuntimeError(f"{self.name}: {answer['error']}")
        return np.load(answer["vectors"]), float(answer["seconds"]), float(answer["cpu_seconds"])

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def infinity_int8(
    python: str | None,
    model: Path,
    label: str,
    texts: list[str],
    threads: int,
    batch_size: int,
) -> tuple[list[InfinityWorker], list[str]]:
    """infinity-emb's int8 workers that started on ``model`` (named ``label``), and one note
    per mode (what ran, or why it did not)."""
    if not python:
        return [], ["infinity-emb int8: not measured (no --infinity-python)"]
    if not Path(python).exists():
        return [], [
            f"infinity-emb int8: not measured ({python} does not exist; `make bench` installs "
            "infinity-emb in bench/out/infinity-venv)"
        ]
    check = subprocess.run(
        [python, "-c", "import infinity_emb; print(infinity_emb.__version__)"],
        capture_output=True,
        text=True,
        env=_env(threads),
        check=False,
    )
    if check.returncode != 0:
        reason = (check.stderr.strip().splitlines() or ["no output"])[-1]
        return [], [f"infinity-emb int8: not measured (it does not import: {reason})"]
    python = os.path.abspath(python)  # the optimum worker runs elsewhere (not resolved:
    # a virtualenv's python is a symlink to the base interpreter, which has no infinity-emb)
    out_dir().mkdir(parents=True, exist_ok=True)
    texts_file = out_dir() / "infinity-texts.json"
    texts_file.write_text(json.dumps(texts))
    workers, notes = [], []
    for engine in MODES:
        source: Path | None = model
        if engine == "optimum":
            source, how = onnx_int8_model(python, model, label, threads)
            notes.append(f"infinity-emb optimum int8: {how}")
            if source is None:
                continue
        print(f"starting infinity-emb {engine} int8 ...", file=sys.stderr)
        worker, error = InfinityWorker.start(
            python, source, engine, texts_file, threads, batch_size
        )
        if worker is None:
            notes.append(f"infinity-emb {engine} int8: did not start ({error})")
        else:
            workers.append(worker)
    return workers, notes
