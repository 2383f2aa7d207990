"""ruff (lint and format) and mypy run as part of the test suite, so the README's one test
command checks all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_ruff_is_clean() -> None:
    result = run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_is_clean() -> None:
    result = run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean() -> None:
    result = run("ruff", "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_router_error_is_defined_in_router_errors() -> None:
    """One exception tree, in one module: no class elsewhere in router/ derives from
    one of its errors (the request errors, or the configuration's)."""
    import ast

    from router import errors

    names = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.RouterError | errors.ConfigError)
    }
    stray = []
    for path in (ROOT / "router").rglob("*.py"):
        if path.name == "errors.py" and path.parent.name == "router":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                if bases & names:
                    stray.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert stray == []


def test_the_config_schema_knows_no_policies() -> None:
    """router/config.py is the schema; checking the policy is the loader's."""
    import ast

    tree = ast.parse((ROOT / "router" / "config.py").read_text())
    imported = {
        node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    } | {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert not {m for m in imported if m.split(".")[0] == "policies"}
