"""How e2e.harness.binaries shares its Go caches between builds (no Go build runs here).

Every component builds in one Go build cache, KEDA too, and `make test` runs two builders at
once (KEDA in a process of its own). The cache is emptied once the binaries are built, so
emptying it must never happen under a build in flight: each build holds the cache shared,
and whoever empties it must hold it alone, or leave it to the build still running.
`make test` also starts the builders before the virtualenv exists, with the system Python.
"""

from __future__ import annotations

import fcntl
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from e2e.harness import binaries

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def go_calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple[str, ...]]:
    """Our cache root under tmp_path, with its build cache there, and a `go` that records
    what it was asked and whether a build held the caches then."""
    monkeypatch.setenv("EMBEDDING_OPERATOR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GOCACHE", raising=False)
    monkeypatch.delenv("GOMODCACHE", raising=False)
    (tmp_path / "cache" / "go" / "build").mkdir(parents=True)
    (tmp_path / "cache" / "go" / "mod").mkdir(parents=True)
    calls: list[tuple[str, ...]] = []

    def go(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
        calls.append((*args, _caches_held()))
        return subprocess.CompletedProcess(["go", *args], 1 if args[0] == "build" else 0, "", "")

    monkeypatch.setattr(binaries, "_go", go)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    return calls


def _caches_held() -> str:
    """How the Go caches are held now: "alone" (someone empties them), "by a build" or "free"."""
    path = binaries._build_lock()
    with path.open("a") as handle:
        for flags, held in ((fcntl.LOCK_SH, "alone"), (fcntl.LOCK_EX, "by a build")):
            try:
                fcntl.flock(handle, flags | fcntl.LOCK_NB)
            except BlockingIOError:
                return held
            fcntl.flock(handle, fcntl.LOCK_UN)
    return "free"


def test_the_build_cache_is_not_emptied_while_a_build_uses_it(
    go_calls: list[tuple[str, ...]],
) -> None:
    with binaries.building():
        binaries.trim_build_cache()
        binaries.drop_go_caches()
    assert go_calls == []

    binaries.trim_build_cache()
    binaries.drop_go_caches()
    assert go_calls == [
        ("clean", "-cache", "alone"),
        ("clean", "-cache", "-modcache", "alone"),
    ]


def test_builds_may_share_the_cache(go_calls: list[tuple[str, ...]]) -> None:
    with binaries.building(), binaries.building():
        binaries.trim_build_cache()
    assert go_calls == []


def test_a_build_holds_the_caches_for_the_whole_go_build(
    go_calls: list[tuple[str, ...]], tmp_path: Path
) -> None:
    keda = next(c for c in binaries.COMPONENTS if c.name == "keda")
    out_dir = tmp_path / "cache" / "keda-v0"
    with pytest.raises(binaries.BuildError, match="go build of keda"):
        binaries._build(keda, "v0", out_dir, "digest")
    assert next(call for call in go_calls if call[0] == "build")[-1] == "by a build"
    binaries.trim_build_cache()  # the failed build let go of the caches
    assert go_calls[-1] == ("clean", "-cache", "alone")


def test_a_build_is_published_only_once_it_lets_go_of_the_caches(
    go_calls: list[tuple[str, ...]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Whoever finds a binary cached may empty the caches at once (`make binaries`, before
    the e2e tier): the build that made it must not hold them any more by then."""
    held: dict[str, str] = {}
    publish = binaries._publish

    def build_into(*args: Any) -> tuple[Path, float]:
        held["building"] = _caches_held()
        staging = tmp_path / "staging"
        staging.mkdir()
        return staging, 1.0

    def published(staging: Path, out_dir: Path) -> None:
        held["publishing"] = _caches_held()
        publish(staging, out_dir)

    monkeypatch.setattr(binaries, "_build_into", build_into)
    monkeypatch.setattr(binaries, "_publish", published)
    out_dir = tmp_path / "cache" / "helm-v0"
    binaries._build(binaries.COMPONENTS[0], "v0", out_dir, "digest")
    assert held == {"building": "by a build", "publishing": "free"}
    assert out_dir.is_dir()


def test_emptying_the_caches_waits_for_another_emptying(
    go_calls: list[tuple[str, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """So `make binaries` returns with the cache empty even while a background builder is
    still emptying it."""
    during: list[bool] = []
    go = binaries._go

    def clean(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
        with binaries._empty_lock().open("a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                during.append(True)
            else:
                fcntl.flock(handle, fcntl.LOCK_UN)
                during.append(False)
        return go(args, cwd, timeout)

    monkeypatch.setattr(binaries, "_go", clean)
    binaries.trim_build_cache()
    binaries.drop_go_caches()
    assert during == [True, True]


def test_ensure_binaries_empties_the_cache_even_when_others_built_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trims: list[bool] = []
    monkeypatch.setattr(binaries, "_ensure", lambda component, versions: (Path("/x"), False))
    monkeypatch.setattr(binaries, "trim_build_cache", lambda: trims.append(True))
    binaries.ensure_binaries()
    assert trims == [True]


def test_no_component_keeps_a_build_cache_of_its_own() -> None:
    """KEDA compiled the standard library (and the modules it pins at the others' versions)
    a second time in a cache of its own."""
    assert all(not hasattr(component, "own_build_cache") for component in binaries.COMPONENTS)
    assert not hasattr(binaries, "_own_build_cache")


@pytest.mark.parametrize("argv", [["keda"], ["--except", "keda"]])
@pytest.mark.parametrize("built", [True, False])
def test_a_builder_of_some_components_empties_the_cache_when_it_built(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], built: bool
) -> None:
    """`make test`'s two builders each try: whichever finishes last empties the cache."""
    ensured: list[str] = []
    trims: list[bool] = []

    def ensure(component: binaries.Component, versions: Any) -> tuple[Path, bool]:
        ensured.append(component.name)
        return Path("/nowhere"), built

    monkeypatch.setattr(binaries, "_ensure", ensure)
    monkeypatch.setattr(binaries, "trim_build_cache", lambda: trims.append(True))
    assert binaries.main(argv) == 0
    names = [c.name for c in binaries.COMPONENTS]
    assert ensured == (["keda"] if argv == ["keda"] else [n for n in names if n != "keda"])
    assert trims == ([True] if built else [])


def test_the_builder_needs_only_the_standard_library() -> None:
    """`make test` starts the Go builds with the system Python while the venv installs."""
    script = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import e2e.harness.binaries\n"
        "extra = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(sorted(extra - set(sys.stdlib_module_names) - {'e2e'}))\n"
    )
    # -S: no site-packages, as a system Python without the project's dependencies.
    result = subprocess.run(
        [sys.executable, "-S", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.strip() == "[]"


def test_make_test_builds_what_the_unit_tier_runs_first() -> None:
    """`make test` runs the unit tier while the Go builds go on, once the binaries the unit
    tests look up are built: those must be the ones it waits for, and built first, or a
    chart test skips (no helm) or waits for the whole set."""
    makefile = (ROOT / "Makefile").read_text()
    match = re.search(r"^UNIT_TIER_BINARIES := (.+)$", makefile, re.MULTILINE)
    assert match is not None
    waited_for = match.group(1).split()
    looked_up = set()
    for path in (ROOT / "tests").rglob("*.py"):
        looked_up |= set(re.findall(r'c\.name == "([a-z-]+)"', path.read_text()))
    looked_up.discard("keda")  # this file's own lookups
    assert looked_up <= set(waited_for), looked_up
    names = [c.name for c in binaries.COMPONENTS]
    assert names[: len(waited_for)] == waited_for
    assert "$(PYTHON) -m e2e.harness.binaries $(UNIT_TIER_BINARIES)" in makefile
