"""The benchmark tables of the docs are the committed results, rendered: regenerated, they must
not change.

``bench.render`` writes every table marked on README.md and docs/benchmarks/index.md from
``bench/results/*.json``. A figure edited on a page but not in its JSON (or the reverse) would
leave two versions of one measurement; these tests name the command that fixes it, and hold
the results to what makes a figure comparable: its date, machine and commit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench
from bench import render

FIX = f"run `{render.COMMAND}` and commit the pages"


@pytest.fixture(scope="module")
def results() -> render.Results:
    return render.load()


@pytest.mark.parametrize("page", render.PAGES, ids=lambda page: page.name)
def test_committed_tables_match_the_results(page: Path, results: render.Results) -> None:
    committed = page.read_text(encoding="utf-8")
    assert render.render_page(committed, results) == committed, (
        f"{page.relative_to(bench.REPO)} is out of date with bench/results: {FIX}"
    )


def test_every_table_is_on_a_page_and_every_marker_has_a_table(results: render.Results) -> None:
    marked = render.referenced()
    assert render.HEADLINE in marked
    assert sorted(marked - {render.HEADLINE} - set(results.tables)) == []
    assert sorted(set(results.tables) - marked) == [], "results no page shows"


def test_the_readme_table_stays_short(results: render.Results) -> None:
    """At most eight rows, one date per machine kind, no links (the README is not a docs page:
    a link written for docs/benchmarks/ would break there)."""
    assert render.check_headline(results) == []
    assert 0 < len(render.headline(results).rows) <= render.MAX_HEADLINE_ROWS


def test_every_run_says_where_and_when(results: render.Results) -> None:
    runs = [(name, run) for file in results.runs.values() for name, run in file.items()]
    assert len(runs) >= 10
    for name, run in runs:
        assert {"date", "machine", "commit"} <= set(run), name
        machine = run["machine"]
        assert machine["kind"] in {"amx", "avx512_bf16", "avx2"} or machine["gpus"], name
        assert isinstance(machine["cores"], int) and machine["cores"] > 0, name
        assert set(machine["isa"]) <= set(bench.ISA_FLAGS), name
        assert machine["kind"] == bench.machine_kind(machine["isa"]), name
    tables = results.tables.values()
    assert all(table.runs for table in tables), [t.ref for t in tables if not t.runs]


def test_a_marked_table_is_rewritten_from_its_json(results: render.Results) -> None:
    ref = next(iter(results.tables))
    stale = f"before\n<!-- table: {ref} -->\n| an old | table |\n<!-- /table -->\nafter\n"
    rendered = render.render_page(stale, results)
    assert rendered.startswith(f"before\n<!-- table: {ref} -->\n| ")
    assert rendered.endswith("<!-- /table -->\nafter\n")
    assert "| an old | table |" not in rendered
    assert render.render_table(results.tables[ref]) in rendered
    with pytest.raises(render.ResultsError, match="no table nowhere#at-all"):
        render.render_page("<!-- table: nowhere#at-all -->\n<!-- /table -->", results)


def test_a_fresh_run_records_its_machine_and_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``make bench`` writes: each ``<bench>.json`` opens with the run's keys, the
    figures after them, and the figures cannot overwrite them."""
    monkeypatch.setenv(bench.OUT_ENV, str(tmp_path))
    written = bench.write_results("offline", {"runs": [{"texts_per_s": 1.0}]})
    assert written == tmp_path / "offline.json"
    report = json.loads(written.read_text())
    assert list(report)[: len(bench.RUN_KEYS)] == list(bench.RUN_KEYS)
    assert report["runs"] == [{"texts_per_s": 1.0}]
    assert report["bench"] == "offline" and report["command"].startswith("python -m bench.offline")
    assert len(report["date"]) == len("2026-11-29")
    assert report["commit"] is None or len(report["commit"]) == 40
    machine = report["machine"]
    assert {"kind", "cpu", "cores", "isa", "gpus"} <= set(machine)
    assert machine["cores"] >= 1 and set(machine["isa"]) <= set(bench.ISA_FLAGS)
    with pytest.raises(ValueError, match="machine"):
        bench.write_results("offline", {"machine": "mine"})
