"""The EmbeddingService and EmbeddingJob reference pages, generated from the CRD schemas.

``crds/embeddingservices.yaml`` is the API's single source of truth: the API server enforces
it, ``kubectl explain`` prints its descriptions, and the operator's spec model is checked
against it. Writing the reference by hand would give the API a second, drifting copy, so the
page is rendered from the schema instead: every field path with its type, default,
validation and description, and every CEL rule with the message ``kubectl apply`` prints.

:func:`render_reference` is a pure function of the parsed CRD. Running the module rewrites
``docs/reference/embeddingservice.md`` and ``docs/reference/embeddingjob.md`` from
``crds/embeddingjobs.yaml`` (``--check`` only compares), and
``tests/operator/test_crd_reference.py`` (``test_job_crd.py``) fails when a committed page
drifts::

    python -m embedding_operator.crd_reference
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = REPO_ROOT / "crds" / "embeddingservices.yaml"
OUTPUT_PATH = REPO_ROOT / "docs" / "reference" / "embeddingservice.md"
JOB_CRD_PATH = REPO_ROOT / "crds" / "embeddingjobs.yaml"
JOB_OUTPUT_PATH = REPO_ROOT / "docs" / "reference" / "embeddingjob.md"
PAGES = ((CRD_PATH, OUTPUT_PATH), (JOB_CRD_PATH, JOB_OUTPUT_PATH))
"""Each CRD and the page generated from it."""
COMMAND = "python -m embedding_operator.crd_reference"

Schema = Mapping[str, Any]

# Characters that Python-Markdown and GitHub both unescape after a backslash, and that could
# otherwise start emphasis, a link, a code span or a table cell.
_MARKDOWN_SPECIAL = set("\\`*_[]|")
# Inside <code>, every character either renderer would read as markup is escaped too.
_CODE_SPECIAL = _MARKDOWN_SPECIAL | set("(){}#+-.!")
_ENTITIES = {"<": "&lt;", ">": "&gt;", "&": "&amp;"}


def _text(value: str) -> str:
    """Prose for a Markdown table cell or list item, shown exactly as written."""
    return "".join(
        _ENTITIES.get(char, "\\" + char if char in _MARKDOWN_SPECIAL else char) for char in value
    )


def _code(value: str) -> str:
    """``value`` as inline code that survives a table cell in both renderers."""
    if "`" not in value and "|" not in value:
        return f"`{value}`"
    escaped = "".join(
        _ENTITIES.get(char, "\\" + char if char in _CODE_SPECIAL else char) for char in value
    )
    return f"<code>{escaped}</code>"


def _literal(value: Any) -> str:
    """A default or enum value as YAML users would write it."""
    if isinstance(value, str):
        return _code(value)
    return _code(json.dumps(value, separators=(", ", ": ")))


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc (and GitHub) give a heading, for in-page links."""
    value = unicodedata.normalize("NFKD", heading)
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def _prose(description: str | None) -> str:
    """A schema description as one line: folded YAML may still carry stray breaks."""
    return " ".join((description or "").split())


@dataclass(frozen=True)
class _Section:
    """An object in the schema: its own heading, rules and a table of its fields."""

    path: str
    node: Schema


def _is_object_with_fields(node: Schema) -> bool:
    return bool(node.get("properties"))


def _child_object(prop: Schema) -> Schema | None:
    """The object a property leads to (itself, or an array's items), if it has fields."""
    if _is_object_with_fields(prop):
        return prop
    items = prop.get("items")
    if isinstance(items, Mapping) and _is_object_with_fields(items):
        return items
    return None


def _child_path(path: str, name: str, prop: Schema) -> str:
    child = f"{path}.{name}" if path else name
    return f"{child}[]" if prop.get("type") == "array" else child


def _sections(node: Schema, path: str) -> Iterator[_Section]:
    """Every object with fields under ``node``, depth first in schema order."""
    yield _Section(path, node)
    for name, prop in (node.get("properties") or {}).items():
        child = _child_object(prop)
        if child is not None:
            yield from _sections(child, _child_path(path, name, prop))


def _scalar_type(node: Schema) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "integer or string"
    kind = str(node.get("type", "any"))
    if kind == "object":
        additional = node.get("additionalProperties")
        if isinstance(additional, Mapping):
            return f"map of string to {_scalar_type(additional)}"
        if node.get("x-kubernetes-preserve-unknown-fields"):
            return "object (any fields)"
    if "format" in node:
        return f"{kind} ({node['format']})"
    return kind


def _type(prop: Schema) -> str:
    if prop.get("type") == "array":
        items = prop.get("items") or {}
        return f"array of {_scalar_type(items)}"
    return _scalar_type(prop)


def _range(low: object, high: object, what: str) -> list[str]:
    if low is not None and high is not None:
        return [f"{what}{low} to {high}"]
    if low is not None:
        return [f"{what}at least {low}"]
    if high is not None:
        return [f"{what}at most {high}"]
    return []


def _bounds(node: Schema) -> list[str]:
    """Enum, range, length, pattern and size limits of one schema node."""
    found: list[str] = []
    if "enum" in node:
        found.append("one of " + ", ".join(_literal(v) for v in node["enum"]))
    found += _range(node.get("minimum"), node.get("maximum"), "")
    found += _range(node.get("minLength"), node.get("maxLength"), "length ")
    if "pattern" in node:
        found.append("pattern " + _code(str(node["pattern"])))
    if "maxItems" in node:
        found.append(f"at most {node['maxItems']} items")
    list_type = node.get("x-kubernetes-list-type")
    if list_type == "set":
        found.append("no duplicates")
    elif list_type == "map":
        keys = ", ".join(_code(str(k)) for k in node.get("x-kubernetes-list-map-keys", []))
        found.append(f"one item per {keys}")
    return found


def _validation(name: str, prop: Schema, required: Sequence[str]) -> str:
    found = ["required"] if name in required else []
    found += _bounds(prop)
    items = prop.get("items")
    if isinstance(items, Mapping) and not _is_object_with_fields(items):
        found += [f"each item: {bound}" for bound in _bounds(items)]
    additional = prop.get("additionalProperties")
    if isinstance(additional, Mapping):
        found += [f"each value: {bound}" for bound in _bounds(additional)]
    return "; ".join(found)


def _field_row(path: str, name: str, prop: Schema, required: Sequence[str]) -> str:
    child_path = _child_path(path, name, prop)
    field = f"{path}.{name}" if path else name
    default = _literal(prop["default"]) if "default" in prop else ""
    description = _text(_prose(prop.get("description")))
    if _child_object(prop) is not None:
        description += f" Fields: [{_code(child_path)}](#{_slug(child_path)})."
    cells = [_code(field), _type(prop), default, _validation(name, prop, required), description]
    return "| " + " | ".join(cell.strip() for cell in cells) + " |"


def _rules(path: str, node: Schema) -> list[str]:
    """The CEL rules on ``node`` as list items: the message first, as users meet it."""
    lines: list[str] = []
    for rule in node.get("x-kubernetes-validations") or []:
        field = path + str(rule.get("fieldPath", "")) if rule.get("fieldPath") else path
        details = []
        if field:
            details.append(f"field {_code(field)}")
        if rule.get("reason"):
            details.append(f"reason {_code(str(rule['reason']))}")
        suffix = f" ({', '.join(details)})" if details else ""
        lines.append(f"- {_text(_prose(rule.get('message')))}{suffix}  ")
        lines.append(f"  rule: `{rule['rule']}`")
    return lines


def _section(section: _Section) -> list[str]:
    node = section.node
    required = list(node.get("required") or [])
    level = "##" if "." not in section.path else "###"
    lines = [f"{level} {_code(section.path)}", ""]
    description = _prose(node.get("description"))
    if description:
        lines += [_text(description), ""]
    rules = _rules(section.path, node)
    # Rules on a list of scalars (media.allowedDomains[]) have no section of their own.
    for name, prop in (node.get("properties") or {}).items():
        items = prop.get("items")
        if isinstance(items, Mapping) and not _is_object_with_fields(items):
            rules += _rules(f"{section.path}.{name}[]", items)
    if rules:
        lines += ["Rules the API server checks:", "", *rules, ""]
    lines += [
        "| Field | Type | Default | Validation | Description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, prop in (node.get("properties") or {}).items():
        lines.append(_field_row(section.path, name, prop, required))
    return [*lines, ""]


def _printer_columns(version: Schema, plural: str) -> list[str]:
    lines = [
        "## Printer columns",
        "",
        f"What `kubectl get {plural}` shows; columns marked *wide* appear with `-o wide`.",
        "",
        "| Column | Type | JSON path | Shown | Description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for column in version.get("additionalPrinterColumns") or []:
        shown = "wide" if column.get("priority", 0) > 0 else "always"
        cells = [
            _text(str(column["name"])),
            str(column["type"]),
            _code(str(column["jsonPath"])),
            shown,
            _text(_prose(column.get("description"))),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _subresources(version: Schema) -> str:
    subresources = version.get("subresources") or {}
    parts = []
    if "status" in subresources:
        parts.append("`status` (written only by the operator)")
    scale = subresources.get("scale")
    if isinstance(scale, Mapping):
        parts.append(
            "`scale` (`kubectl scale`, HPA and KEDA targets: replicas "
            f"{_code(str(scale['specReplicasPath']))}, observed "
            f"{_code(str(scale['statusReplicasPath']))}, selector "
            f"{_code(str(scale['labelSelectorPath']))})"
        )
    return ", ".join(parts)


def render_reference(crd: Mapping[str, Any], source: str = "crds/embeddingservices.yaml") -> str:
    """The reference page for ``crd`` (a parsed CustomResourceDefinition) as Markdown."""
    spec = crd["spec"]
    names = spec["names"]
    (version,) = spec["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    api_version = f"{spec['group']}/{version['name']}"
    sections = [s for s in _sections(schema, "") if s.path]
    slugs = [_slug(s.path) for s in sections]
    if len(set(slugs)) != len(slugs):
        raise ValueError(f"two sections of the reference would share an anchor: {slugs}")

    lines = [
        f"<!-- Generated from {source} by `{COMMAND}`. Do not edit: edit the CRD and rerun. -->",
        "",
        f"# {names['kind']} reference",
        "",
        f"This page is generated from the CRD (`{source}`), which is what the API server "
        "enforces and what `kubectl explain` prints, so it lists exactly what "
        f"`kubectl apply` accepts. To regenerate it, run `{COMMAND}`.",
        "",
        "| | |",
        "| --- | --- |",
        f"| API version | `{api_version}` |",
        f"| Kind | `{names['kind']}` (list: `{names['listKind']}`) |",
        f"| Scope | {spec['scope']} |",
        f"| Plural / singular | `{names['plural']}` / `{names['singular']}` |",
        "| Short names | " + ", ".join(f"`{n}`" for n in names.get("shortNames", [])) + " |",
        "| Categories | " + ", ".join(f"`{c}`" for c in names.get("categories", [])) + " |",
        f"| Subresources | {_subresources(version)} |",
        "",
        _text(_prose(schema.get("description"))),
        "",
    ]
    object_rules = _rules("", schema)
    if object_rules:
        lines += ["Rules the API server checks on the whole object:", "", *object_rules, ""]
    lines += _printer_columns(version, names["plural"])
    for section in sections:
        lines += _section(section)
    return "\n".join(lines).rstrip("\n") + "\n"


def load_crd(path: Path = CRD_PATH) -> dict[str, Any]:
    """The CRD manifest at ``path``, parsed."""
    return dict(yaml.safe_load(path.read_text(encoding="utf-8")))


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or with ``--check`` compare) the reference pages; return the exit status."""
    parser = argparse.ArgumentParser(
        prog=COMMAND, description="Generate the CRD reference pages from the CRDs."
    )
    parser.add_argument(
        "--crd", type=Path, default=None, help="CRD manifest to read (default: every CRD)."
    )
    parser.add_argument("--output", type=Path, default=None, help="Page to write (with --crd).")
    parser.add_argument(
        "--check", action="store_true", help="Exit 1 if a page differs; write nothing."
    )
    args = parser.parse_args(argv)
    if args.crd is not None:
        pages: Sequence[tuple[Path, Path]] = ((args.crd, args.output or OUTPUT_PATH),)
    else:
        pages = PAGES
    status = 0
    for crd_path, output in pages:
        try:
            source = str(crd_path.resolve().relative_to(REPO_ROOT))
        except ValueError:
            source = str(crd_path)
        page = render_reference(load_crd(crd_path), source)
        if args.check:
            current = output.read_text(encoding="utf-8") if output.exists() else ""
            if current != page:
                sys.stderr.write(f"{output} is out of date: run {COMMAND}\n")
                status = 1
            continue
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(page, encoding="utf-8")
    return status


if __name__ == "__main__":
    sys.exit(main())
