"""``kvrouter admin`` against a real router over simulated engines.

The router runs on the test's loop and the command's client is synchronous, so each
command runs in a worker thread; the router's state is then read through its own API.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from typing import Any

import aiohttp
import orjson
import pytest

from router.cli.admin import register
from tests.conftest import EngineFactory, RunningRouter, router_config, serve_router
from tests.fleet.test_admin import TOKEN, admin
from tests.router_client import engines


def kvrouter_admin(*argv: str) -> int:
    """``kvrouter admin ARGV``, dispatched as ``router.cli`` does (``args.func``)."""
    parser = argparse.ArgumentParser(prog="kvrouter")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["admin", *argv])
    code: int = args.func(args)
    return code


async def cli(router: RunningRouter, *argv: str, token: str = TOKEN) -> int:
    return await asyncio.to_thread(kvrouter_admin, "--url", router.url, "--token", token, *argv)


async def workers(http: aiohttp.ClientSession, router: RunningRouter) -> dict[str, Any]:
    status, body = await admin(http, router, "GET", "/admin/workers")
    assert status == 200
    return {w["name"]: w for w in body["workers"]}


async def test_list_add_drain_undrain_remove(
    engine_factory: EngineFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet[:1], admin_token=TOKEN)) as router,
        aiohttp.ClientSession() as http,
    ):
        assert await cli(router, "list") == 0
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if "w0" in line)
        assert fleet[0].url in row and "yes" in row and "/ 50,000" in row, out

        extra = fleet[1].url
        assert await cli(router, "add", extra, "--name", "extra", "--kv-tokens", "20000") == 0
        assert "extra" in capsys.readouterr().out
        assert (await workers(http, router))["extra"]["capacity_tokens"] == 20_000

        assert await cli(router, "drain", "extra") == 0
        assert capsys.readouterr().out.startswith(f"extra {extra}: draining")
        assert (await workers(http, router))["extra"]["draining"] is True
        assert await cli(router, "list") == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if "extra" in line)
        assert "DRAINING" in row

        assert await cli(router, "undrain", "extra") == 0
        assert "in rotation" in capsys.readouterr().out
        assert (await workers(http, router))["extra"]["draining"] is False

        # --json after the subcommand: the API's own body.
        assert await cli(router, "list", "--json") == 0
        listed = orjson.loads(capsys.readouterr().out)
        assert [w["name"] for w in listed["workers"]] == ["w0", "extra"]

        assert await cli(router, "remove", "extra") == 0
        assert capsys.readouterr().out.strip() == "removed extra"
        assert set(await workers(http, router)) == {"w0"}

        # Unnamed, a worker is called by its host:port, which goes into the path quoted.
        assert await cli(router, "add", extra) == 0
        hostport = extra.split("://", 1)[1].rstrip("/")
        assert set(await workers(http, router)) == {"w0", hostport}
        assert await cli(router, "remove", hostport) == 0
        assert set(await workers(http, router)) == {"w0"}

        assert await cli(router, "remove", "extra") == 1
        assert "no worker named 'extra'" in capsys.readouterr().err


async def test_policy_show_set_and_migrate(
    engine_factory: EngineFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet, admin_token=TOKEN, policy="round_robin")) as router,
        aiohttp.ClientSession() as http,
    ):
        assert await cli(router, "policy") == 0
        assert capsys.readouterr().out.startswith("policy round_robin (version ")

        assert await cli(router, "policy", "set", "ttft", "--knob", "cache_weight=2") == 0
        out = capsys.readouterr().out
        assert out.startswith("policy ttft") and "cache_weight = 2" in out, out
        status, policy = await admin(http, router, "GET", "/admin/policy")
        assert status == 200 and policy["policy"] == "ttft"
        assert policy["knobs"]["cache_weight"] == 2

        # Without a name the policy stays; knobs are given over its defaults.
        assert await cli(router, "policy", "set", "--knob", "tie_tolerance=0.5", "--json") == 0
        shown = orjson.loads(capsys.readouterr().out)
        assert shown["policy"] == "ttft" and shown["knobs"]["tie_tolerance"] == 0.5
        assert shown["knobs"]["cache_weight"] == 1.0

        assert await cli(router, "policy", "set", "nonesuch") == 1
        err = capsys.readouterr().err
        assert "400" in err and "nonesuch" in err and "round_robin" in err, err

        assert await cli(router, "migrate", "w0", "--to", "w1") == 0
        assert capsys.readouterr().out.strip() == "moved 0 tokens from w0 to w1"
        assert await cli(router, "migrate", "w0", "--to", "w0") == 1
        assert "'to' must be another worker" in capsys.readouterr().err


async def test_a_wrong_token_exits_1_with_the_routers_message(
    engine_factory: EngineFactory,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, admin_token=TOKEN)) as router,
    ):
        assert await cli(router, "list", token="wrong") == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.strip().endswith("401: missing or wrong admin bearer token")
        assert "Traceback" not in captured.err

        # The url and token from the environment.
        monkeypatch.setenv("KVROUTER_URL", router.url)
        monkeypatch.setenv("KVROUTER_ADMIN_TOKEN", TOKEN)
        assert await asyncio.to_thread(kvrouter_admin, "list") == 0
        assert "w0" in capsys.readouterr().out


def test_an_unreachable_router_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    assert kvrouter_admin("--url", url, "--token", TOKEN, "--timeout", "2", "list") == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot reach the router at {url}")
    assert captured.out == ""
