"""Closed-loop HTTP load: ``connections`` keep-alive connections, each sending its next
request as soon as the last one's response has been read in full, for ``duration_s``.

Two generators give the same ``LoadResult``:

* ``run_wrk``: ``wrk`` (Debian's ``apt-get install wrk``), with a Lua script that makes
  each request's body distinct. It costs a few microseconds of CPU per request, so on a
  2-core machine nearly all of the other core is left to the router and the engines.
* ``run_python``: the same loop in asyncio, for tests and where wrk is missing. It costs
  tens of microseconds per request on the router's cores, so its figures are lower.

Every request is a short chat completion: a fixed system prompt and a user message
unique to the connection and the request (``RequestShape``).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import orjson

from bench.textgen import text_for

Generator = Literal["wrk", "python"]
PATH = "/v1/chat/completions"
SYSTEM_PROMPT_TOKENS = 150  # 600 bytes: two or three prefix blocks, shared by all
MAX_TOKENS = 16
WRK_TIMEOUT_S = 10
_MARK = "@ID@"
_RESULT_PREFIX = "WRK_RESULT "


@dataclass(frozen=True, slots=True)
class RequestShape:
    """The request body, but for the id spliced into its user message."""

    stream: bool
    model: str = "m"

    def halves(self) -> tuple[bytes, bytes]:
        body: dict[str, object] = {
            "model": self.model,
            "max_tokens": MAX_TOKENS,
            "stream": self.stream,
            "messages": [
                {"role": "system", "content": text_for("throughput-system", SYSTEM_PROMPT_TOKENS)},
                {"role": "user", "content": f"Question {_MARK}: what does that line say?"},
            ],
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        head, _, tail = orjson.dumps(body).partition(_MARK.encode())
        return head, tail

    def body(self, request_id: str) -> bytes:
        head, tail = self.halves()
        return head + request_id.encode() + tail


@dataclass(frozen=True, slots=True)
class LoadResult:
    requests: int  # responses read in full, whatever their status
    duration_s: float
    p50_s: float
    p99_s: float
    bad_status: int = 0  # responses with a status of 400 or more
    socket_errors: int = 0  # connect, read, write errors and timeouts

    @property
    def rate(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def errors(self) -> int:
        return self.bad_status + self.socket_errors


def wrk_script(shape: RequestShape) -> str:
    """A wrk Lua script: each thread numbers its requests, ``done`` prints one JSON line."""
    head, tail = (half.decode() for half in shape.halves())
    return f"""
local threads, counter = {{}}, 0
function setup(thread)
  thread:set("tid", counter)
  counter = counter + 1
end
local head = [==[{head}]==]
local tail = [==[{tail}]==]
local headers = {{["Content-Type"] = "application/json"}}
local n = 0
function request()
  n = n + 1
  return wrk.format("POST", "{PATH}", headers, head .. tid .. "-" .. n .. tail)
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{_RESULT_PREFIX}{{"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,' ..
    '"status":%d,"timeout":%d,"p50_us":%d,"p99_us":%d}}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def parse_wrk_output(stdout: str) -> LoadResult:
    for line in stdout.splitlines():
        if line.startswith(_RESULT_PREFIX):
            raw = orjson.loads(line[len(_RESULT_PREFIX) :])
            return LoadResult(
                requests=raw["requests"],
                duration_s=raw["duration_us"] / 1e6,
                p50_s=raw["p50_us"] / 1e6,
                p99_s=raw["p99_us"] / 1e6,
                bad_status=raw["status"],
                socket_errors=raw["connect"] + raw["read"] + raw["write"] + raw["timeout"],
            )
    raise RuntimeError(f"wrk printed no result line:\n{stdout}")


def wrk_available() -> bool:
    return shutil.which("wrk") is not None


async def run_wrk(
    url: str, shape: RequestShape, connections: int, duration_s: float, threads: int = 1
) -> LoadResult:
    with tempfile.TemporaryDirectory(prefix="kvrouter-wrk-") as tmp:
        script = Path(tmp) / "requests.lua"
        script.write_text(wrk_script(shape))
        process = await asyncio.create_subprocess_exec(
            "wrk",
            "-t",
            str(threads),
            "-c",
            str(connections),
            "-d",
            f"{duration_s:g}s",
            "--timeout",
            f"{WRK_TIMEOUT_S}s",
            "-s",
            str(script),
            url,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"wrk exited {process.returncode}: {stderr.decode()}")
    return parse_wrk_output(stdout.decode())


class _BadResponse(Exception):
    pass


async def _read_response(reader: asyncio.StreamReader) -> int:
    """Read one whole response (Content-Length or chunked); returns its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip().lower()
    if headers.get("transfer-encoding") == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                return status
    if "content-length" not in headers:
        raise _BadResponse("a response without a length on a keep-alive connection")
    await reader.readexactly(int(headers["content-length"]))
    return status


async def run_python(
    url: str, shape: RequestShape, connections: int, duration_s: float
) -> LoadResult:
    host, _, port = url.removeprefix("http://").rstrip("/").partition(":")
    latencies: list[float] = []
    bad_status = socket_errors = 0
    start = time.perf_counter()
    deadline = start + duration_s

    async def connection(index: int) -> None:
        nonlocal bad_status, socket_errors
        n = 0
        while time.perf_counter() < deadline:
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
            except OSError:
                socket_errors += 1
                await asyncio.sleep(0.01)
                continue
            try:
                while time.perf_counter() < deadline:
                    n += 1
                    body = shape.body(f"{index}-{n}")
                    sent = time.perf_counter()
                    head = (
                        f"POST {PATH} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                        "Content-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n"
                    )
                    writer.write(head.encode() + body)
                    status = await _read_response(reader)
                    latencies.append(time.perf_counter() - sent)
                    bad_status += status >= 400
            except (OSError, asyncio.IncompleteReadError, _BadResponse, ValueError):
                socket_errors += 1
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()

    await asyncio.gather(*(connection(i) for i in range(connections)))
    elapsed = time.perf_counter() - start
    ordered = sorted(latencies) or [0.0]
    return LoadResult(
        requests=len(latencies),
        duration_s=elapsed,
        p50_s=statistics.median(ordered),
        p99_s=ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        bad_status=bad_status,
        socket_errors=socket_errors,
    )


async def run_load(
    generator: Generator, url: str, shape: RequestShape, connections: int, duration_s: float
) -> LoadResult:
    if generator == "wrk":
        return await run_wrk(url, shape, connections, duration_s)
    return await run_python(url, shape, connections, duration_s)
