"""The soak benchmark's traffic: closed-loop clients running multi-turn sessions.

Each client runs one session after another. A session is a chat or a completion
conversation of 1 to ``MAX_TURNS`` turns (most short, a few long) over one of a few shared
system prompts, each turn carrying the whole history and the previous reply; each turn is
streamed or not at random, and some streamed turns are abandoned by their client after a
few chunks (the session ends there). A session also ends at a turn that fails.

Every request ends one way (``Record.ending``):

* ``ok``: the whole reply arrived (``[DONE]`` after the text, or the whole JSON body);
* ``disconnected``: the client went away mid-stream, as it meant to;
* ``failed_after_first_byte``: a 200 had arrived, then an error event, a stream that
  stopped before ``[DONE]``, a broken connection or the client's own timeout;
* ``failed_before_first_byte``: no 200: a status of the router's own (its error body),
  a connection error or a timeout before the headers. Whether another worker could
  have served it is for the report to decide, from the faults' timeline.

The router sends a response's status line only with the first chunk it relays, so "a
200 arrived" is "the first byte reached the client".
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import orjson

from bench.replay.sse import iter_sse
from bench.textgen import text_for
from router.wire.headers import SESSION_HEADER, WORKER_HEADER
from router.wire.streams import stream_error

Ending = Literal["ok", "disconnected", "failed_after_first_byte", "failed_before_first_byte"]
ENDINGS: tuple[Ending, ...] = (
    "ok",
    "disconnected",
    "failed_after_first_byte",
    "failed_before_first_byte",
)
MAX_TURNS = 16
SYSTEM_PROMPT_TOKENS = (400, 800, 1500, 2500)  # one shared prompt per size
USER_TOKENS = (40, 400)  # a turn's new text, uniform in this range
MAX_TOKENS = (16, 32, 64, 128)
CHAT_SHARE = 0.75
STREAM_SHARE = 0.7
DISCONNECT_SHARE = 0.1  # of streamed turns
# Generous against the router's own bounds (its first-byte and read timeouts, retries):
# a request that takes this long is one the router left hanging.
REQUEST_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = 10.0
MAX_DETAIL_CHARS = 200


@dataclass(frozen=True, slots=True)
class TrafficConfig:
    model: str
    clients: int = 8
    think_s: float = 0.5  # mean pause between a client's requests (exponential)
    seed: int = 7


@dataclass(slots=True)
class Record:
    """One request; times in seconds since the run started."""

    started: float
    shape: str  # "chat/stream", "chat/whole", "completion/stream", "completion/whole"
    session: str
    turn: int
    ended: float = 0.0
    ending: Ending = "failed_before_first_byte"
    status: int = 0  # 0: no response
    ttft_s: float | None = None  # to the first text
    worker: str | None = None
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "started": round(self.started, 3),
            "ended": round(self.ended, 3),
            "shape": self.shape,
            "session": self.session,
            "turn": self.turn,
            "ending": self.ending,
            "status": self.status,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
            "worker": self.worker,
            "detail": self.detail,
        }


@dataclass(slots=True)
class Session:
    """A conversation's state between turns."""

    key: str
    chat: bool
    turns: int
    system: str
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt: str = ""  # a completion session's whole text so far


def new_session(rng: random.Random, key: str) -> Session:
    # Mostly short sessions, a few long ones (mean ~3.5 turns).
    turns = min(MAX_TURNS, 1 + int(rng.expovariate(1 / 2.5)))
    size = rng.choice(SYSTEM_PROMPT_TOKENS)
    return Session(key, rng.random() < CHAT_SHARE, turns, text_for(f"soak-system-{size}", size))


def _body(session: Session, model: str, user: str, max_tokens: int, stream: bool) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if session.chat:
        if not session.messages:
            session.messages.append({"role": "system", "content": session.system})
        body["messages"] = [*session.messages, {"role": "user", "content": user}]
    else:
        body["prompt"] = (session.prompt or session.system) + user
    return orjson.dumps(body)


def _remember(session: Session, user: str, reply: str) -> None:
    if session.chat:
        session.messages += [
            {"role": "user", "content": user},
            {"role": "assistant", "content": reply},
        ]
    else:
        session.prompt = (session.prompt or session.system) + user + reply


def _text(chunk: dict[str, Any]) -> str:
    """The text of a chat chunk (``delta``), a chat reply (``message``) or a completion."""
    parts = []
    for choice in chunk.get("choices") or ():
        said = choice.get("delta") or choice.get("message") or {}
        parts.append(said.get("content") or choice.get("text") or "")
    return "".join(parts)


async def _read_stream(
    response: aiohttp.ClientResponse, record: Record, clock: Callable[[], float], hang_up_after: int
) -> str:
    """The reply's text; ``hang_up_after`` > 0: close the connection after that many
    chunks of text (a client that goes away mid-stream)."""
    parts: list[str] = []
    async for event in iter_sse(response.content):
        if event.data.strip() == "[DONE]":
            record.ending = "ok"
            return "".join(parts)
        try:
            chunk = orjson.loads(event.data)
        except orjson.JSONDecodeError:
            record.detail = f"undecodable event: {event.data[:MAX_DETAIL_CHARS]}"
            return ""
        error = stream_error(chunk)
        if error is not None:
            record.detail = error[:MAX_DETAIL_CHARS]
            return ""
        text = _text(chunk)
        if text:
            if record.ttft_s is None:
                record.ttft_s = clock() - record.started
            parts.append(text)
            if hang_up_after and len(parts) >= hang_up_after:
                response.close()
                record.ending = "disconnected"
                return ""
    record.detail = "the stream ended before [DONE]"
    return ""


async def _read_whole(response: aiohttp.ClientResponse, record: Record) -> str:
    body = orjson.loads(await response.read())
    record.ending = "ok"
    return _text(body)


async def send(
    http: aiohttp.ClientSession,
    url: str,
    session: Session,
    turn: int,
    rng: random.Random,
    model: str,
    clock: Callable[[], float],
) -> tuple[Record, str]:
    """One turn of ``session``: its record and the reply's text ("" unless it ended ok)."""
    stream = rng.random() < STREAM_SHARE
    hang_up_after = rng.randint(1, 3) if stream and rng.random() < DISCONNECT_SHARE else 0
    user = text_for(f"{session.key}-u{turn}", rng.randint(*USER_TOKENS))
    body = _body(session, model, user, rng.choice(MAX_TOKENS), stream)
    kind = "chat" if session.chat else "completion"
    record = Record(clock(), f"{kind}/{'stream' if stream else 'whole'}", session.key, turn)
    path = "/v1/chat/completions" if session.chat else "/v1/completions"
    headers = {SESSION_HEADER: session.key, "Content-Type": "application/json"}
    reply = ""
    try:
        async with http.post(url + path, data=body, headers=headers) as response:
            record.status = response.status
            record.worker = response.headers.get(WORKER_HEADER)
            if response.status != 200:
                head = await response.content.read(MAX_DETAIL_CHARS)
                record.detail = head.decode("utf-8", errors="replace")
            else:
                record.ending = "failed_after_first_byte"  # until it ends well
                reply = await (
                    _read_stream(response, record, clock, hang_up_after)
                    if stream
                    else _read_whole(response, record)
                )
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        # ValueError: an undecodable whole body, or a line longer than aiohttp's buffer.
        record.detail = f"{type(exc).__name__}: {exc}"[:MAX_DETAIL_CHARS]
    record.ended = clock()
    if record.ending == "ok":
        _remember(session, user, reply)
    return record, reply


async def client(
    http: aiohttp.ClientSession,
    url: str,
    config: TrafficConfig,
    index: int,
    clock: Callable[[], float],
    stop_at: float,
    records: list[Record],
) -> None:
    """Sessions back to back until ``stop_at`` (the request in flight then finishes)."""
    rng = random.Random(f"{config.seed}-client-{index}")
    sessions = 0
    while clock() < stop_at:
        session = new_session(rng, f"s{config.seed}-{index}-{sessions}")
        sessions += 1
        for turn in range(session.turns):
            if clock() >= stop_at:
                return
            record, _ = await send(http, url, session, turn, rng, config.model, clock)
            records.append(record)
            if record.ending != "ok":
                break  # a failed or abandoned conversation is not carried on
            await _pause(rng, config.think_s, clock, stop_at)
        await _pause(rng, config.think_s, clock, stop_at)


async def _pause(
    rng: random.Random, mean_s: float, clock: Callable[[], float], stop_at: float
) -> None:
    await asyncio.sleep(min(rng.expovariate(1 / mean_s), max(0.0, stop_at - clock())))


def open_http(clients: int) -> aiohttp.ClientSession:
    """The clients' pooled session: one connection per client at most."""
    connector = aiohttp.TCPConnector(limit=clients, limit_per_host=clients)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)
