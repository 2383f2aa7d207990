"""The command line as a user meets it: every option of the user-facing commands says what
it does and its default; a port that is taken is one line naming the flags to change."""

from __future__ import annotations

import argparse
import socket

import pytest

from router.cli import build_parser, main

USER_COMMANDS = (
    ("serve",),
    ("check-config",),
    ("top",),
    ("capacity",),
    ("admin",),
    ("admin", "list"),
    ("admin", "add"),
    ("admin", "migrate"),
    ("admin", "policy"),
    ("demo",),
    ("sim", "fleet"),
    ("sim", "engine"),
)


def _subparser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


@pytest.mark.parametrize("path", USER_COMMANDS, ids=" ".join)
def test_every_option_has_help_and_shows_its_default(path: tuple[str, ...]) -> None:
    parser = _subparser(path)
    text = parser.format_help()
    undocumented, no_default = [], []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if action.help == argparse.SUPPRESS or action.default == argparse.SUPPRESS:
            continue  # hidden, or a parent command's option repeated
        name = action.option_strings[-1] if action.option_strings else action.dest
        if not action.help:
            undocumented.append(name)
        shows_default = "default" in (action.help or "") or isinstance(
            parser._get_formatter(), argparse.ArgumentDefaultsHelpFormatter
        )
        has_default = action.default not in (None, False) and action.option_strings
        if has_default and not shows_default:
            no_default.append(name)
    assert not undocumented, f"options without help: {undocumented}\n{text}"
    assert not no_default, f"defaults not shown: {no_default}\n{text}"


def test_a_demo_port_that_is_taken_is_one_line_naming_the_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["demo", "--engines", "2", "--base-port", str(port)])
    out = capsys.readouterr().out.strip()
    assert code == 2
    assert out.startswith(f"error: port {port} is taken") and "\n" not in out, out
    assert "--base-port" in out and "--router-port" in out
