"""docs/models.md may call a model served only where it names the test that checks it.

The page's per-model tables (those with a "Parity test" column) say, for each checkpoint,
how the server serves it: native, transformers, or refused. A served row must name the test
that checks a tiny checkpoint of that model's layout against its authors' computation, as a
pytest node id or file path in backticks (`tests/server/device/test_x.py::test_y`); a
refused row must say why. The named files must exist and the named functions must be
defined in them: the files are parsed, never imported, so this check stays fast and needs no
torch. A served claim therefore cannot outlive its test, and a test renamed or deleted
without the page fails here, naming the row.

The page must also keep a row for every model vLLM's embedding docs name
(:data:`VLLM_EMBEDDING_EXAMPLES`), so that a user who comes from vLLM finds each one.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "models.md"

TEST_COLUMN = "Parity test"
SERVED_COLUMN = "Served"
WHY_COLUMN = "How, or why refused"
SERVED = ("native", "transformers")
REFUSED = "refused"

VLLM_EMBEDDING_EXAMPLES = (
    # docs/models/pooling_models/embed.md, text-only models and the usage examples
    "BAAI/bge-base-en-v1.5",
    "Snowflake/snowflake-arctic-embed-xs",
    "naver/splade-v3",
    "BAAI/bge-m3",
    "BAAI/bge-multilingual-gemma2",
    "google/embeddinggemma-300m",
    "Snowflake/snowflake-arctic-embed-m-v2.0",
    "Alibaba-NLP/gte-multilingual-base",
    "jinaai/jina-embeddings-v5-text-small",
    "jinaai/jina-embeddings-v5-text-nano",
    "nvidia/llama-nemotron-embed-1b-v2",
    "intfloat/e5-mistral-7b-instruct",
    "Alibaba-NLP/gte-modernbert-base",
    "nomic-ai/nomic-embed-text-v1",
    "nomic-ai/nomic-embed-text-v2-moe",
    "Snowflake/snowflake-arctic-embed-m-long",
    "ssmits/Qwen2-7B-Instruct-embed-base",
    "Alibaba-NLP/gte-Qwen2-7B-instruct",
    "Qwen/Qwen3-Embedding-0.6B",
    "sentence-transformers/all-roberta-large-v1",
    "voyageai/voyage-4-nano",
    "intfloat/multilingual-e5-base",
    "jinaai/jina-embeddings-v3",
    "shibing624/text2vec-base-chinese-sentence",
    "parasail-ai/GritLM-7B-vllm",
    "intfloat/e5-small",
    "Snowflake/snowflake-arctic-embed-m-v1.5",
    # embed.md, multimodal models and examples
    "openai/clip-vit-base-patch32",
    "openai/clip-vit-large-patch14",
    "nvidia/llama-nemotron-embed-vl-1b-v2",
    "royokong/e5-v",
    "TIGER-Lab/VLM2Vec-Full",
    "Qwen/Qwen3-VL-Embedding-2B",
    "google/siglip-base-patch16-224",
    "google/siglip2-base-patch16-224",
    "google/siglip-so400m-patch14-384",
    "MrLight/dse-qwen2-2b-mrl-v1",
    # token_embed.md and specific_models.md, which embed.md links for multi-vector models
    "lightonai/GTE-ModernColBERT-v1",
    "jinaai/jina-colbert-v2",
    "answerdotai/answerai-colbert-small-v1",
    "colbert-ir/colbertv2.0",
    "LiquidAI/LFM2-ColBERT-350M",
    "vidore/colpali-v1.3-hf",
    "ModernVBERT/colmodernvbert-merged",
    "TomoroAI/tomoro-colqwen3-embed-4b",
    "OpenSearch-AI/Ops-Colqwen3-4B",
    "nvidia/nemotron-colembed-vl-4b-v2",
    "athrael-soju/colqwen3.5-4.5B",
)
"""The Hub ids vLLM's embedding pages give as examples (``embed.md``, its older table's
ErnieModel and GritLM rows, and the multi-vector pages it links). Where a page names a
family's sizes (-4b, -8b), the first stands for them."""

_CELL = re.compile(r"(?<!\\)\|")
_CODE = re.compile(r"`([^`]+)`")
_NODE = re.compile(r"^(?P<file>tests/[\w/]+\.py)(?:::(?P<names>\w+(?:::\w+)?))?$")


@dataclass(frozen=True)
class Row:
    """One body row of a per-model table: its line on the page and its cells by header."""

    line: int
    cells: dict[str, str]

    @property
    def model(self) -> str:
        return next(iter(self.cells.values()))


def _split(line: str) -> list[str]:
    return [cell.strip() for cell in _CELL.split(line.strip().strip("|"))]


def model_tables(text: str) -> list[list[Row]]:
    """Every table of ``text`` that has a :data:`TEST_COLUMN`, as its body rows."""
    tables: list[list[Row]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        header, body = _split(lines[start]), lines[start + 2 : i]
        if TEST_COLUMN in header:
            rows = []
            for offset, line in enumerate(body):
                cells = _split(line)
                cells += [""] * (len(header) - len(cells))
                rows.append(Row(start + 3 + offset, dict(zip(header, cells, strict=False))))
            tables.append(rows)
    return tables


@cache
def _defined(path: Path) -> frozenset[str]:
    """The test functions ``path`` defines: ``name`` at top level, ``Class::name`` in a class."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.update(
                f"{node.name}::{item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            )
    return frozenset(names)


def _reference_problems(reference: str, root: Path) -> str | None:
    match = _NODE.match(reference)
    if match is None:
        return f"`{reference}` is not a test file or node id (tests/...py[::test_name])"
    path = root / match["file"]
    if not path.name.startswith("test_"):
        return f"`{reference}`: {match['file']} is not a test module pytest collects"
    if not path.is_file():
        return f"`{reference}`: there is no file {match['file']}"
    names = match["names"]
    if names is not None and not names.rpartition("::")[2].startswith("test"):
        return f"`{reference}`: {names} is not a test pytest collects"
    if names is not None and names not in _defined(path):
        return f"`{reference}`: {match['file']} defines no {names}"
    return None


def problems(text: str, root: Path = REPO) -> list[str]:
    """What is wrong with the per-model tables of the page ``text``, one line per finding,
    each naming the page line and the model."""
    found: list[str] = []
    tables = model_tables(text)
    if not tables:
        return [f"no table with a {TEST_COLUMN!r} column"]
    for rows in tables:
        for row in rows:
            where = f"docs/models.md:{row.line} ({row.model})"
            if SERVED_COLUMN not in row.cells or WHY_COLUMN not in row.cells:
                found.append(f"{where}: the table needs {SERVED_COLUMN!r} and {WHY_COLUMN!r}")
                continue
            words = row.cells[SERVED_COLUMN].replace("`", "").split()
            served = words[0].strip(",;:").lower() if words else ""
            references = _CODE.findall(row.cells[TEST_COLUMN])
            if served in SERVED and not references:
                found.append(f"{where}: served {served} but names no parity test")
            elif served == REFUSED and not row.cells[WHY_COLUMN]:
                found.append(f"{where}: refused without saying why")
            elif served not in (*SERVED, REFUSED):
                found.append(
                    f"{where}: {SERVED_COLUMN!r} must start with native, transformers or "
                    f"refused, not {row.cells[SERVED_COLUMN]!r}"
                )
            for reference in references:
                problem = _reference_problems(reference, root)
                if problem is not None:
                    found.append(f"{where}: {problem}")
    return found


def _first_served_row() -> Row:
    return next(
        row
        for rows in model_tables(PAGE.read_text(encoding="utf-8"))
        for row in rows
        if row.cells.get(SERVED_COLUMN, "").startswith("native")
        and "::" in row.cells.get(TEST_COLUMN, "")
    )


def _with_cells(row: Row, changes: dict[str, str]) -> str:
    """The page with the cells of ``row`` that ``changes`` names (by column) replaced."""
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    cells = row.cells | changes
    lines[row.line - 1] = "| " + " | ".join(cells.values()) + " |"
    return "\n".join(lines)


def test_every_served_model_names_parity_tests_that_exist() -> None:
    assert problems(PAGE.read_text(encoding="utf-8")) == []


def test_every_model_vllms_embedding_docs_name_has_a_row() -> None:
    listed = [row.model for rows in model_tables(PAGE.read_text(encoding="utf-8")) for row in rows]
    missing = [hub_id for hub_id in VLLM_EMBEDDING_EXAMPLES if not any(hub_id in m for m in listed)]
    assert missing == [], "docs/models.md has no row for these models vLLM's docs name"


def test_a_blank_parity_cell_is_reported() -> None:
    row = _first_served_row()
    found = problems(_with_cells(row, {TEST_COLUMN: ""}))
    where = f"docs/models.md:{row.line} ({row.model})"
    assert found == [f"{where}: served native but names no parity test"]


@pytest.mark.parametrize("how", ["function", "file"])
def test_a_misnamed_test_is_reported(how: str) -> None:
    row = _first_served_row()
    node = _CODE.findall(row.cells[TEST_COLUMN])[0]
    file, _, name = node.partition("::")
    wrong = f"{file}::{name}_renamed" if how == "function" else f"{file[:-3]}_gone.py::{name}"
    found = problems(_with_cells(row, {TEST_COLUMN: f"`{wrong}`"}))
    assert len(found) == 1 and f"`{wrong}`" in found[0] and row.model in found[0]


def test_a_refusal_without_a_reason_and_an_unknown_status_are_reported() -> None:
    row = _first_served_row()
    refused = problems(_with_cells(row, {SERVED_COLUMN: "refused", WHY_COLUMN: ""}))
    assert any("refused without saying why" in p for p in refused), refused
    unknown = problems(_with_cells(row, {SERVED_COLUMN: "mostly"}))
    assert any("must start with native, transformers or refused" in p for p in unknown)


@pytest.mark.parametrize(
    ("reference", "complaint"),
    [
        ("test_models.py", "is not a test file or node id"),
        ("tests/support/models.py", "is not a test module pytest collects"),
        ("tests/server/test_models_page.py::problems", "problems is not a test pytest collects"),
    ],
)
def test_a_reference_that_is_not_a_test_is_reported(reference: str, complaint: str) -> None:
    row = _first_served_row()
    found = problems(_with_cells(row, {TEST_COLUMN: f"`{reference}`"}))
    assert len(found) == 1 and complaint in found[0] and row.model in found[0], found
