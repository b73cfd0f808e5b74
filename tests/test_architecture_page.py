"""docs/architecture.md's package map names every module of the two programs, and no other.

The page names a module by its dotted import name in backticks
(`embedding_server.request.media.fetching`; a package by its own name,
`embedding_server.request`, which stands for its ``__init__.py``). The map is its tables: a
row whose first cell holds a module's name, and whose second cell says what it owns.

This test fails, naming the module and its file, when a module under
``server/embedding_server`` or ``operator/embedding_operator`` has no such row, and, naming
the page line, when the page names a dotted ``embedding_server``/``embedding_operator`` name
anywhere (a row, prose, a diagram) that is no module of the tree. So a module added, moved or
split without the page, and a page that outlives a module, both fail here. The tree is read
from the file system, never imported: the check is fast and needs no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "architecture.md"
PAGE_NAME = "docs/architecture.md"
PACKAGES: Mapping[str, Path] = {
    "embedding_server": REPO / "server" / "embedding_server",
    "embedding_operator": REPO / "operator" / "embedding_operator",
}
"""Each program's import name and its directory."""

_NAME = re.compile(r"(?<![\w.])embedding_(?:server|operator)(?:\.[A-Za-z_]\w*)*(?![\w-])")
_CELL = re.compile(r"(?<!\\)\|")


def modules(packages: Mapping[str, Path] = PACKAGES) -> dict[str, Path]:
    """Every module of ``packages`` by dotted name (a package by its own), with its file."""
    found: dict[str, Path] = {}
    for package, root in packages.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in _CELL.split(line.strip().strip("|"))]


def mapped(text: str) -> dict[str, int]:
    """The modules the page's tables give a row, each with the row's line: every dotted name
    in a body row's first cell, where the row's second cell is not empty."""
    rows: dict[str, int] = {}
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.startswith("|"):
            continue
        cells = _cells(line)
        if len(cells) < 2 or not cells[1] or set(cells[1]) <= set("-: "):
            continue  # a header's separator, or a row that says nothing
        for name in re.findall(r"`([^`]+)`", cells[0]):
            if _NAME.fullmatch(name):
                rows.setdefault(name, number)
    return rows


def named(text: str) -> Iterable[tuple[int, str]]:
    """Every dotted name the page uses, anywhere, with its line."""
    for number, line in enumerate(text.splitlines(), start=1):
        for match in _NAME.finditer(line):
            yield number, match.group()


def problems(text: str, tree: Mapping[str, Path]) -> list[str]:
    """What the page ``text`` gets wrong about ``tree`` (dotted name -> file), one finding
    per line: a module without a row, then a name that is no module."""
    found: list[str] = []
    rows = mapped(text)
    for name, path in sorted(tree.items()):
        if name not in rows:
            where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            found.append(f"{PAGE_NAME} has no row for {name} ({where})")
    for number, name in named(text):
        if name not in tree:
            found.append(f"{PAGE_NAME}:{number} names {name}, which is no module of the tree")
    return found


def test_the_page_names_every_module_and_only_modules_that_exist() -> None:
    found = problems(PAGE.read_text(encoding="utf-8"), modules())
    assert not found, "\n".join(found)


def test_the_page_says_its_naming_convention() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert "tests/test_architecture_page.py" in text
    assert "dotted import name" in text


# -- the check itself, on a tree and a page of its own ------------------------------------------


def _tree(tmp_path: Path) -> dict[str, Path]:
    root = tmp_path / "embedding_server"
    for relative in ("__init__.py", "cli.py", "request/__init__.py", "request/jobs.py"):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text("")
    (root / "request" / "__pycache__").mkdir()
    (root / "request" / "__pycache__" / "jobs.py").write_text("")  # not a module
    return modules({"embedding_server": root})


PAGE_OF_TREE = """\
# A map

The planes meet in `embedding_server.request.jobs`; `embedding_server_backlog_seconds` and
`embedding-server` are no module names.

| Module | What it owns |
| --- | --- |
| `embedding_server` | the package |
| `embedding_server.cli` | the command line |
| `embedding_server.request`, `embedding_server.request.jobs` | the request plane, jobs |
"""


def test_a_page_naming_every_module_has_no_problem(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    assert sorted(tree) == [
        "embedding_server",
        "embedding_server.cli",
        "embedding_server.request",
        "embedding_server.request.jobs",
    ]
    assert problems(PAGE_OF_TREE, tree) == []


def test_a_module_the_page_does_not_map_is_named(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    (tmp_path / "embedding_server" / "request" / "tasks").mkdir()
    (tmp_path / "embedding_server" / "request" / "tasks" / "embed.py").write_text("")
    tree = modules({"embedding_server": tmp_path / "embedding_server"})
    # Named in prose only, it is still not on the map.
    page = PAGE_OF_TREE + "\nSee `embedding_server.request.tasks.embed`.\n"
    found = problems(page, tree)
    assert len(found) == 1, found
    assert "no row for embedding_server.request.tasks.embed" in found[0]
    assert "request/tasks/embed.py" in found[0]


def test_a_row_that_says_nothing_does_not_map_its_module(tmp_path: Path) -> None:
    page = PAGE_OF_TREE.replace("| the command line |", "|  |")
    assert problems(page, _tree(tmp_path)) == [
        f"{PAGE_NAME} has no row for embedding_server.cli "
        f"({tmp_path / 'embedding_server' / 'cli.py'})"
    ]


def test_a_name_that_is_no_module_is_named_with_its_line(tmp_path: Path) -> None:
    page = PAGE_OF_TREE + "| `embedding_server.device.service` | the engine's end of the wire |\n"
    found = problems(page, _tree(tmp_path))
    line = len(page.splitlines())
    assert found == [
        f"{PAGE_NAME}:{line} names embedding_server.device.service, which is no module of the tree"
    ]
