"""The benchmark tables of the docs, written from the results committed under ``bench/results/``.

A page marks each generated table with a pair of comments, and everything between them is
this module's:

    <!-- table: offline#bfloat16-amx-2026-11-29 -->
    | Run | ours bfloat16 | ... |
    <!-- /table -->

``offline#bfloat16-amx-2026-11-29`` is the table ``bfloat16-amx-2026-11-29`` of
``bench/results/offline.json``; ``headline`` is the README's short table, the rows of
``summary.json`` that carry a ``headline``.

A results file holds ``runs`` (each with its date, its machine, the commit it measured and
the command; a machine is an entry of ``machines.json`` or written out as ``<bench>.json``
records it) and ``tables``, each naming the runs it comes from. A row is a list of cells, or
``{"cells": [...], "run": ..., "headline": {...}}``. To publish a fresh run, copy the run's
keys from ``bench/out/<bench>.json`` into a results file, write its figures into a table, mark
the table's place on a page and run this module.

    python -m bench.render            # rewrite the marked tables in place
    python -m bench.render --check    # exit 1, naming the pages, when one is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import REPO

RESULTS = REPO / "bench" / "results"
MACHINES_FILE = "machines.json"
SUMMARY_FILE = "summary"
PAGES = (REPO / "README.md", REPO / "docs" / "benchmarks" / "index.md")
COMMAND = "python -m bench.render"
HEADLINE = "headline"
HEADLINE_COLUMNS = ("machine", "measurement", "result", "target")
MAX_HEADLINE_ROWS = 8
"""The README's table stays short: one date per machine kind, at most this many rows."""

MARKER = re.compile(
    r"(?P<open><!-- table: (?P<ref>[\w.#/-]+) -->\n)(?P<body>.*?)(?P<close><!-- /table -->)",
    re.DOTALL,
)
LINK = re.compile(r"\]\([^)]*\)")


class ResultsError(ValueError):
    """A results file that does not hold what a table needs."""


@dataclass(frozen=True)
class Row:
    cells: list[str]
    run: str | None = None
    headline: dict[str, str] | None = None


@dataclass(frozen=True)
class Table:
    ref: str
    columns: list[str]
    align: str
    rows: list[Row]
    runs: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Results:
    """Every results file: its runs (machines resolved) and its tables, by reference."""

    runs: dict[str, dict[str, dict[str, Any]]]
    tables: dict[str, Table]


def _row(raw: Any, ref: str) -> Row:
    if isinstance(raw, list):
        return Row(cells=[str(cell) for cell in raw])
    if isinstance(raw, dict) and isinstance(raw.get("cells"), list):
        return Row(
            cells=[str(cell) for cell in raw["cells"]],
            run=raw.get("run"),
            headline=raw.get("headline"),
        )
    raise ResultsError(f"{ref}: a row is a list of cells or an object with cells: {raw!r}")


def _table(raw: dict[str, Any], ref: str, runs: dict[str, Any]) -> Table:
    columns = [str(column) for column in raw["columns"]]
    align = str(raw.get("align", "l" * len(columns)))
    if len(align) != len(columns) or set(align) - {"l", "r"}:
        raise ResultsError(f"{ref}: align needs one l or r per column, got {align!r}")
    rows = [_row(row, ref) for row in raw["rows"]]
    table_runs = [str(run) for run in raw.get("runs", [])]
    for row in rows:
        if len(row.cells) != len(columns):
            raise ResultsError(f"{ref}: {len(row.cells)} cells for {len(columns)} columns")
        if row.run is not None:
            table_runs.append(row.run)
    unknown = sorted(set(table_runs) - set(runs))
    if unknown:
        raise ResultsError(f"{ref}: no such runs {unknown}")
    return Table(ref=ref, columns=columns, align=align, rows=rows, runs=table_runs)


def load(root: Path = RESULTS) -> Results:
    """The results under ``root``."""
    machines: dict[str, dict[str, Any]] = json.loads((root / MACHINES_FILE).read_text())
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    tables: dict[str, Table] = {}
    for path in sorted(root.glob("*.json")):
        if path.name == MACHINES_FILE:
            continue
        data = json.loads(path.read_text())
        file_runs: dict[str, dict[str, Any]] = {}
        for name, run in data.get("runs", {}).items():
            machine = run.get("machine")
            if isinstance(machine, str):
                if machine not in machines:
                    raise ResultsError(f"{path.name}: run {name}: no machine {machine!r}")
                run = {**run, "machine": {"id": machine, **machines[machine]}}
            file_runs[name] = run
        runs[path.stem] = file_runs
        for name, raw in data.get("tables", {}).items():
            ref = f"{path.stem}#{name}"
            tables[ref] = _table(raw, ref, file_runs)
    return Results(runs=runs, tables=tables)


def _line(cells: Iterator[str] | list[str]) -> str:
    return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"


def render_table(table: Table) -> str:
    """``table`` as a markdown table, one line a row."""
    lines = [
        _line(table.columns),
        _line("---:" if a == "r" else "---" for a in table.align),
        *(_line(row.cells) for row in table.rows),
    ]
    return "\n".join(lines) + "\n"


def machine_label(machine: dict[str, Any]) -> str:
    """A machine as a reader knows it: its name, or its cores and CPU model."""
    if machine.get("name"):
        return str(machine["name"])
    return f"{machine.get('cores')}-core {machine.get('cpu') or machine.get('kind')}"


def headline(results: Results) -> Table:
    """The README's table: every summary row with a headline, its machine and date first."""
    runs = results.runs.get(SUMMARY_FILE, {})
    rows: list[Row] = []
    previous = ""
    for ref, table in results.tables.items():
        if not ref.startswith(f"{SUMMARY_FILE}#"):
            continue
        for row in table.rows:
            if row.headline is None:
                continue
            if row.run is None:
                raise ResultsError(f"{ref}: a headline row must name its run")
            run = runs[row.run]
            where = f"{machine_label(run['machine'])}, {run['date']}"
            cells = [row.headline[column] for column in HEADLINE_COLUMNS[1:]]
            rows.append(Row(cells=["" if where == previous else where, *cells], run=row.run))
            previous = where
    return Table(ref=HEADLINE, columns=list(HEADLINE_COLUMNS), align="llll", rows=rows)


def check_headline(results: Results) -> list[str]:
    """What is wrong with the README's table: too many rows, more than one date per machine
    kind, or links (its cells render on the README, whose links are not the docs pages')."""
    table = headline(results)
    problems = []
    if len(table.rows) > MAX_HEADLINE_ROWS:
        problems.append(f"{len(table.rows)} headline rows, more than {MAX_HEADLINE_ROWS}")
    dates: dict[str, set[str]] = {}
    runs = results.runs.get(SUMMARY_FILE, {})
    for row in table.rows:
        assert row.run is not None
        run = runs[row.run]
        dates.setdefault(run["machine"]["kind"], set()).add(run["date"])
    problems += [
        f"headline rows of {kind} from {len(found)} dates: {sorted(found)}"
        for kind, found in dates.items()
        if len(found) > 1
    ]
    problems += [
        f"a headline cell with a link: {cell}"
        for row in table.rows
        for cell in row.cells
        if LINK.search(cell)
    ]
    return problems


def render_page(text: str, results: Results) -> str:
    """``text`` with every marked table rewritten from ``results``."""

    def replace(match: re.Match[str]) -> str:
        ref = match["ref"]
        if ref == HEADLINE:
            table = headline(results)
        elif ref in results.tables:
            table = results.tables[ref]
        else:
            raise ResultsError(f"no table {ref} under bench/results")
        return match["open"] + render_table(table) + match["close"]

    return MARKER.sub(replace, text)


def referenced(pages: tuple[Path, ...] = PAGES) -> set[str]:
    """The tables the pages mark."""
    return {match["ref"] for page in pages for match in MARKER.finditer(page.read_text())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    results = load()
    problems = check_headline(results)
    for problem in problems:
        print(f"bench/results: {problem}", file=sys.stderr)
    stale = []
    for page in PAGES:
        text = page.read_text()
        rendered = render_page(text, results)
        if rendered == text:
            continue
        stale.append(page.relative_to(REPO))
        if not args.check:
            page.write_text(rendered)
    for page in stale:
        print(f"{page}: {'out of date' if args.check else 'rewritten'}")
    if args.check and stale:
        print(f"run `{COMMAND}` and commit the pages", file=sys.stderr)
    return 1 if problems or (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
