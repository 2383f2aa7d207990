"""The user documentation against the code it describes: the files it names exist, its
links resolve, and the README's test command is the one CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from router.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A repository path in backticks: `router/front.py`, `bench/sim/`, `deploy/compose.yaml`.
_PATH = re.compile(r"`((?:router|policies|bench|tests|deploy|helm|docs|scripts)/[\w./-]*)`")
_LINK = re.compile(r"\]\(([^)#\s]*\.md)?(?:#([\w-]+))?\)")
_COMMIT = re.compile(r"\b(?:at|commit) [0-9a-f]{7,40}\b")


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a file's headings (outside code blocks)."""
    anchors = set()
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif line.startswith("#") and not fenced:
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_every_path_the_documentation_names_exists() -> None:
    missing = [
        f"{doc.name}: {path}"
        for doc in DOCS
        for path in _PATH.findall(doc.read_text())
        if "*" not in path and not (ROOT / path).exists()
    ]
    assert not missing, missing


def test_every_link_between_documents_resolves() -> None:
    broken = []
    for doc in DOCS:
        for target, anchor in _LINK.findall(doc.read_text()):
            if not target and not anchor:
                continue  # a link to a page elsewhere
            path = (doc.parent / target).resolve() if target else doc
            if not path.exists():
                broken.append(f"{doc.name}: {target}")
            elif anchor and anchor not in _anchors(path.read_text()):
                broken.append(f"{doc.name}: {target}#{anchor}")
    assert not broken, broken


def test_user_documentation_cites_no_commits() -> None:
    cited = [f"{doc.name}: {m}" for doc in DOCS for m in _COMMIT.findall(doc.read_text())]
    assert not cited, cited


def test_the_readme_opens_with_the_command_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands[0].endswith("kvrouter demo"), commands
    assert commands[1] == "scripts/test.sh"
    assert "exec scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_documented_config_file_is_one_the_router_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    config = tmp_path / "router.yaml"
    config.write_text(text.split("```yaml\n", 1)[1].split("```", 1)[0])
    assert main(["check-config", str(config)]) == 0, capsys.readouterr().out
