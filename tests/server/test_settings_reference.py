"""The server-flags page is the settings model, rendered: regenerated, it must not change.

``docs/reference/server-flags.md`` is generated from ``embedding_server.settings`` by
``embedding_server.settings_reference``. A new or changed setting without a regenerated page
would leave users without the flag; these tests name the command that fixes it, and check
that every flag on the page is one ``embedding-server serve`` really accepts.
"""

from __future__ import annotations

import argparse

from embedding_server.cli import build_parser
from embedding_server.settings import ServerSettings
from embedding_server.settings_reference import (
    COMMAND,
    OUTPUT_PATH,
    env_name,
    flag_names,
    render_reference,
)

FIX = f"run `PYTHONPATH=server python -m {COMMAND.removeprefix('python -m ')}` and commit it"


def _serve_flags() -> set[str]:
    parser = build_parser()
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    return {flag for action in serve._actions for flag in action.option_strings}


def test_committed_page_matches_the_settings() -> None:
    committed = OUTPUT_PATH.read_text(encoding="utf-8") if OUTPUT_PATH.exists() else ""
    assert committed == render_reference(), (
        f"{OUTPUT_PATH.relative_to(OUTPUT_PATH.parents[2])} is out of date with "
        f"embedding_server/settings.py: {FIX}"
    )


def test_every_setting_is_on_the_page_as_the_cli_spells_it() -> None:
    page = render_reference()
    accepted = _serve_flags()
    for name, field in ServerSettings.model_fields.items():
        flags = flag_names(name, field)
        assert set(flags) <= accepted, f"the page documents {flags}, the CLI accepts neither"
        assert all(f"`{flag}`" in page for flag in flags), f"{flags} missing from the page"
        assert f"`{env_name(name)}`" in page, f"{env_name(name)} missing from the page"
        assert env_name(name) == f"EMBEDDING_SERVER_{name.upper()}"
    documented = {
        flag
        for name, field in ServerSettings.model_fields.items()
        for flag in flag_names(name, field)
    }
    assert accepted - {"-h", "--help"} <= documented, "serve accepts flags the page does not list"


def test_the_gateway_page_matches_its_settings_and_its_cli() -> None:
    from embedding_server.gateway.settings import GatewaySettings
    from embedding_server.settings_reference import (
        GATEWAY_OUTPUT_PATH,
        render_gateway_reference,
    )

    committed = GATEWAY_OUTPUT_PATH.read_text(encoding="utf-8")
    assert committed == render_gateway_reference(), f"gateway-flags.md is out of date: {FIX}"
    parser = build_parser()
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    accepted = {f for a in commands.choices["gateway"]._actions for f in a.option_strings}
    documented = {
        flag
        for name, field in GatewaySettings.model_fields.items()
        for flag in flag_names(name, field)
    }
    assert accepted - {"-h", "--help"} == documented
    for name in GatewaySettings.model_fields:
        variable = env_name(name, GatewaySettings)
        assert variable == f"EMBEDDING_GATEWAY_{name.upper()}" and f"`{variable}`" in committed
