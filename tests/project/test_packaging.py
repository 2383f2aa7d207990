"""The seam between the router and its workbench, as installed: ``router/`` and
``policies/`` never import ``bench``, their third-party imports are the runtime
dependencies pyproject.toml declares (the workbench's are in the ``[bench]`` extra), and
the workbench's commands reach ``kvrouter`` through the ``kvrouter.commands`` entry points.
And the README's test command, ``scripts/test.sh``, installs the Debian packages the tests
need only when they are missing.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from importlib.metadata import entry_points, packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROUTER_PACKAGES = ("router", "policies")
BENCH_COMMANDS = {"bench", "demo", "sim"}


def imported_modules(package: str) -> Iterator[tuple[Path, str]]:
    """Every absolute import in the package's files, at module level or inside functions."""
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                yield from ((path, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield path, node.module


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_router_and_policies_never_import_the_workbench() -> None:
    found = [
        f"{path.relative_to(ROOT)}: {module}"
        for package in ROUTER_PACKAGES
        for path, module in imported_modules(package)
        if module.partition(".")[0] == "bench"
    ]
    assert found == []


def test_the_routers_imports_are_its_declared_runtime_dependencies() -> None:
    project = pyproject()["project"]
    assert isinstance(project, dict)
    declared = {
        normalized(m.group())
        for requirement in project["dependencies"]
        if (m := re.match(r"[A-Za-z0-9._-]+", requirement))
    }
    distributions = packages_distributions()
    ours = {"router", "policies"}
    undeclared = set()
    for package in ROUTER_PACKAGES:
        for path, module in imported_modules(package):
            top = module.partition(".")[0]
            if top in sys.stdlib_module_names or top in ours:
                continue
            names = {normalized(d) for d in distributions.get(top, [top])}
            if not names & declared:
                undeclared.add(f"{path.relative_to(ROOT)}: {module} ({', '.join(sorted(names))})")
    assert sorted(undeclared) == []


# Dependencies whose internals or parsing contract the router relies on: a major change
# must be tested before it is installed, so each has an upper bound.
RELIED_ON_INTERNALS = ("redis", "httptools")


def test_dependencies_whose_internals_the_router_uses_have_an_upper_bound() -> None:
    project = pyproject()["project"]
    assert isinstance(project, dict)
    declared = {
        normalized(re.split(r"[\[<>=;! ]", requirement, maxsplit=1)[0]): requirement
        for requirement in project["dependencies"]
    }
    unbounded = [name for name in RELIED_ON_INTERNALS if "<" not in declared[name]]
    assert not unbounded, unbounded


def test_the_workbench_registers_its_commands_through_entry_points() -> None:
    points = {p.name: p.value for p in entry_points(group="kvrouter.commands")}
    assert set(points) == BENCH_COMMANDS and all(v.startswith("bench.") for v in points.values())
    result = subprocess.run(
        [sys.executable, "-m", "router.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    listed = set(re.findall(r"^ {4}(\S+)", result.stdout, re.MULTILINE))
    assert {"serve", "top", "capacity", "admin"} | BENCH_COMMANDS <= listed
    assert "Not installed here" not in result.stdout


def test_the_router_runs_without_the_workbench() -> None:
    # As in the router's image: the entry points are there, the bench package is not.
    code = (
        "import sys; sys.modules['bench'] = None\n"
        "from router.cli import build_parser\n"
        "parser = build_parser()\n"
        "parser.parse_args(['serve', '--config', 'router.yaml'])\n"
        "parser.print_help()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    listed = set(re.findall(r"^ {4}(\S+)", result.stdout, re.MULTILINE))
    assert "serve" in listed and not listed & BENCH_COMMANDS
    assert "Not installed here: bench, demo, sim (needs bench" in " ".join(result.stdout.split())
    assert "Each command group lives" not in result.stdout  # the module's notes, not help


def test_a_workbench_command_without_the_workbench_says_how_to_get_it() -> None:
    code = "import sys; sys.modules['bench'] = None\nfrom router.cli import main\nmain(['demo'])\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "'demo' is part of the workbench, not installed here: pip install" in result.stderr


def stub(bin_dir: Path, name: str, body: str = "") -> None:
    path = bin_dir / name
    path.write_text(f'#!/bin/sh\necho "{name} $*" >> "$STUB_LOG"\n{body}\n')
    path.chmod(0o755)


APT = "env DEBIAN_FRONTEND=noninteractive apt-get"
PIP_PYTEST = [
    "python3 -m pip install -e .[test]",
    "install-vllm ",
    "install-aiperf ",
    "python3 -m pytest -q -x tests",
]


@pytest.mark.parametrize(
    ("uid", "present", "expected"),
    [
        # sudo runs env, which runs apt-get: both log
        (
            1000,
            (),
            [
                f"sudo {APT} update -qq",
                "apt-get update -qq",
                f"sudo {APT} install -y -qq --no-install-recommends redis-server prometheus",
                "apt-get install -y -qq --no-install-recommends redis-server prometheus",
                *PIP_PYTEST,
            ],
        ),
        (
            0,
            ("redis-server", "redis-cli", "prometheus"),  # promtool missing
            [
                "apt-get update -qq",
                "apt-get install -y -qq --no-install-recommends prometheus",
                *PIP_PYTEST,
            ],
        ),
        (0, ("redis-server", "redis-cli", "prometheus", "promtool"), PIP_PYTEST),
    ],
)
def test_the_test_script_installs_what_is_missing(
    tmp_path: Path, uid: int, present: tuple[str, ...], expected: list[str]
) -> None:
    # scripts/test.sh on a PATH of stubs: apt-get, sudo, id and python3 only log their
    # arguments; the binaries in `present` are installed, the others missing.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("env", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool) or tool)
    for name in ("apt-get", "python3", "install-vllm", "install-aiperf", *present):
        stub(bin_dir, name)
    stub(bin_dir, "id", f"echo {uid}")
    stub(bin_dir, "sudo", 'exec "$@"')
    log = tmp_path / "log"
    subprocess.run(
        [shutil.which("bash") or "bash", str(ROOT / "scripts" / "test.sh"), "-x", "tests"],
        env={
            "PATH": str(bin_dir),
            "STUB_LOG": str(log),
            "INSTALL_VLLM": "install-vllm",
            "INSTALL_AIPERF": "install-aiperf",
        },
        timeout=60,
        check=True,
    )
    logged = [line for line in log.read_text().splitlines() if not line.startswith("id ")]
    assert logged == expected
