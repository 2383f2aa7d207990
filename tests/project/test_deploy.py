"""What can be proven of the container setup without a Docker engine: the compose file's
structure, that every command it runs exists in the image, and the Dockerfile's rules."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return data


def test_compose_has_the_whole_picture() -> None:
    services = compose()["services"]
    assert {"redis", "router-1", "router-2", "prometheus", "grafana"} <= set(services)
    assert sorted(s for s in services if s.startswith("engine-")) == [
        f"engine-{i}" for i in range(4)
    ]
    for name in ("router-1", "router-2"):
        depends = services[name]["depends_on"]
        assert "redis" in depends and all(
            depends[f"engine-{i}"]["condition"] == "service_healthy" for i in range(4)
        )


def test_every_kvrouter_command_exists_in_its_image() -> None:
    # The router's image holds the router alone; the simulated engines run the workbench's.
    parsers = {
        ("kvrouter:local", "router"): build_parser(installed=False),
        ("kvrouter-bench:local", "workbench"): build_parser(),
    }
    services = compose()["services"]
    ours = {
        name: (s["image"], s["build"]["target"])
        for name, s in services.items()
        if s.get("image", "").startswith("kvrouter")
    }
    assert (
        sorted(ours.values())
        == [("kvrouter-bench:local", "workbench")] * 4 + [("kvrouter:local", "router")] * 2
    )
    for name, image in ours.items():
        args = parsers[image].parse_args(services[name]["command"])  # exits if unknown
        assert callable(args.func), name


def test_mounted_files_exist_and_are_valid(capsys: pytest.CaptureFixture[str]) -> None:
    services = compose()["services"]
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (DEPLOY / source).exists(), source
    assert main(["check-config", str(DEPLOY / "router.yaml")]) == 0
    assert "ok (4 workers, policy ttft)" in capsys.readouterr().out
    result = subprocess.run(
        ["promtool", "check", "config", str(DEPLOY / "prometheus" / "compose.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dockerfile_is_slim_pinned_and_non_root() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    froms = re.findall(r"^FROM (\S+) AS (\S+)$", text, re.MULTILINE)
    names = {name for _, name in froms}
    bases = [base for base, _ in froms if base not in names]  # not built on an earlier stage
    assert bases and all(re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", b) for b in bases)
    assert "HEALTHCHECK" in text and 'ENTRYPOINT ["kvrouter"]' in text
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), path
    stages = dict(re.findall(r"^FROM \S+ AS (\S+)\n(.*?)(?=^FROM |\Z)", text, re.M | re.S))
    assert list(stages)[-1] == "router"  # the default target
    assert all(re.search(r"^USER 10001$", stages[s], re.M) for s in ("router", "workbench"))
    assert set(re.findall(r"--from=(\S+)", stages["router"])) == {"build"}
    # The router's image: the router's runtime dependencies, no extras, no workbench.
    assert "bench" not in stages["build"]
    assert re.search(r"^RUN pip install .* \.$", stages["build"], re.M)
    assert {"build-workbench", "workbench"} <= set(stages)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "tests" in ignored and ".git" in ignored
