"""The EmbeddingService reference page is the CRD, rendered: regenerated, it must not change.

``docs/reference/embeddingservice.md`` is generated from ``crds/embeddingservices.yaml`` by
``embedding_operator.crd_reference``. A CRD edit without a regenerated page would leave users
reading an API the server no longer has; these tests name the command that fixes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from embedding_operator.crd_reference import COMMAND, OUTPUT_PATH, render_reference

FIX = f"run `PYTHONPATH=operator python -m {COMMAND.removeprefix('python -m ')}` and commit it"


def _fields(node: dict[str, Any], path: str) -> Iterator[str]:
    """Every field path under ``node``, as the page spells it (``spec.server.env[].name``)."""
    for name, prop in (node.get("properties") or {}).items():
        field = f"{path}.{name}" if path else name
        yield field
        items = prop.get("items")
        if isinstance(items, dict) and items.get("properties"):
            yield from _fields(items, f"{field}[]")
        else:
            yield from _fields(prop, field)


def _rules(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from node.get("x-kubernetes-validations") or []
    for prop in (node.get("properties") or {}).values():
        yield from _rules(prop)
        if isinstance(prop.get("items"), dict):
            yield from _rules(prop["items"])


def test_committed_page_matches_the_crd(crd: dict[str, Any]) -> None:
    committed = OUTPUT_PATH.read_text(encoding="utf-8") if OUTPUT_PATH.exists() else ""
    assert committed == render_reference(crd), (
        f"{OUTPUT_PATH.relative_to(OUTPUT_PATH.parents[2])} is out of date with "
        f"crds/embeddingservices.yaml: {FIX}"
    )


def test_every_field_and_rule_is_on_the_page(crd: dict[str, Any], schema: dict[str, Any]) -> None:
    page = render_reference(crd)
    user_fields = [path for path in _fields(schema, "") if path.startswith(("spec.", "status."))]
    assert len(user_fields) > 100
    missing = [path for path in user_fields if f"| `{path}` |" not in page]
    assert not missing, f"fields without a row on the reference page: {missing}"
    rules = list(_rules(schema))
    assert len(rules) >= 10
    for rule in rules:
        assert f"`{rule['rule']}`" in page, f"CEL rule missing from the page: {rule['rule']}"
        # Markdown escapes aside, the page quotes the message kubectl apply prints.
        assert " ".join(rule["message"].split()) in page.replace("\\", ""), rule["message"]
