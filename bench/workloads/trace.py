"""The replayable trace format: one JSON object per line, one line per turn.

Fields of a line::

    session        str    session id; turns of a session are replayed in order
    turn           int    0, 1, 2, ... within the session
    arrival        float  seconds from trace start at which the source issued this turn
                          (the replay uses it for turn 0 of each session: sessions arrive
                          open-loop)
    gap            float  seconds between the end of the previous turn's response and this
                          turn (tool or think time; the replay waits it: turns within a
                          session are closed-loop). 0 for turn 0.
    user           text   the new user message of this turn
    output_tokens  int    the expected length of the reply (sent as max_tokens)
    system         text   optional, turn 0 only: the system prompt
    api            str    optional, turn 0 only: the API the session's client speaks,
                          "chat", "responses" or "messages" (``bench.workloads.api_bodies``);
                          without it the replay's ``--api`` carries the session
    parent         str    optional, turn 0 only: the id of the session that spawned this
                          one (a coding agent's subagent), whose prefix its turn 0 usually
                          starts with. Informational: the replay starts the session at its
                          own arrival and does not wait on or for the parent.
    ended_by       str    optional: how the source's reply to this turn ended, "tool" (a
                          tool call: the next turn is its result, sent without a person)
                          or "user" (the reply waited for a person). Absent when the source
                          does not say. The replay waits ``gap`` either way; over chat, a
                          session with "tool" turns offers tools on every turn, asks for
                          the call on those turns and sends the next turn as its result.

A *text* is either a literal string, or ``{"id": KEY, "tokens": N}`` (N stand-in tokens
of deterministic filler drawn from KEY, see ``bench.textgen``), or a list of those,
concatenated. Blocks with the same id are the same text, which is how shared system
prompts and the Mooncake trace's shared prefix blocks become shared prefixes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import orjson

from bench.textgen import text_for
from bench.workloads.api_bodies import APIS, Api


@dataclass(frozen=True, slots=True)
class TextBlock:
    key: str
    tokens: int


TextSpec = str | tuple[TextBlock, ...]
EndedBy = Literal["tool", "user"]
ENDINGS: Final[tuple[EndedBy, ...]] = ("tool", "user")


@dataclass(frozen=True, slots=True)
class Turn:
    session: str
    turn: int
    arrival: float
    gap: float
    user: TextSpec
    output_tokens: int
    system: TextSpec | None = None
    api: Api | None = None
    parent: str | None = None
    ended_by: EndedBy | None = None


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    turns: tuple[Turn, ...]

    @property
    def arrival(self) -> float:
        return self.turns[0].arrival


class TraceFormatError(ValueError):
    """A trace line that does not follow the format above."""


def render_text(spec: TextSpec) -> str:
    if isinstance(spec, str):
        return spec
    return "".join(text_for(block.key, block.tokens) for block in spec)


def text_tokens(spec: TextSpec) -> int:
    """Stand-in token count of a text (literal strings: 4 UTF-8 bytes a token)."""
    if isinstance(spec, str):
        return -(-len(spec.encode("utf-8")) // 4)
    return sum(block.tokens for block in spec)


def _text_to_json(spec: TextSpec) -> Any:
    if isinstance(spec, str):
        return spec
    blocks = [{"id": b.key, "tokens": b.tokens} for b in spec]
    return blocks[0] if len(blocks) == 1 else blocks


def _text_from_json(value: Any, where: str) -> TextSpec:
    if isinstance(value, str):
        return value
    items = [value] if isinstance(value, dict) else value
    if not isinstance(items, list) or not items:
        raise TraceFormatError(f"{where}: expected a string, an {{id, tokens}} object or a list")
    blocks: list[TextBlock] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str | int):
            raise TraceFormatError(f"{where}: each block needs an 'id'")
        tokens = item.get("tokens")
        if not isinstance(tokens, int) or tokens < 0:
            raise TraceFormatError(f"{where}: 'tokens' must be a non-negative integer")
        blocks.append(TextBlock(str(item["id"]), tokens))
    return tuple(blocks)


def turn_to_json(turn: Turn) -> dict[str, Any]:
    line: dict[str, Any] = {
        "session": turn.session,
        "turn": turn.turn,
        "arrival": round(turn.arrival, 6),
        "gap": round(turn.gap, 6),
        "user": _text_to_json(turn.user),
        "output_tokens": turn.output_tokens,
    }
    if turn.system is not None:
        line["system"] = _text_to_json(turn.system)
    if turn.api is not None:
        line["api"] = turn.api
    if turn.parent is not None:
        line["parent"] = turn.parent
    if turn.ended_by is not None:
        line["ended_by"] = turn.ended_by
    return line


def _api_from_json(value: Any, where: str) -> Api | None:
    if value is None:
        return None
    for api in APIS:
        if value == api:
            return api
    raise TraceFormatError(f"{where}: unknown api {value!r}; known: {', '.join(APIS)}")


def _ended_by_from_json(value: Any, where: str) -> EndedBy | None:
    if value is None:
        return None
    for ending in ENDINGS:
        if value == ending:
            return ending
    raise TraceFormatError(f"{where}: unknown ended_by {value!r}; known: {', '.join(ENDINGS)}")


def _parent_from_json(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise TraceFormatError(f"{where}: parent must be a non-empty session id")
    return value


def turn_from_json(obj: Any, where: str = "trace") -> Turn:
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    try:
        session = str(obj["session"])
        turn = int(obj["turn"])
        arrival = float(obj.get("arrival", 0.0))
        gap = float(obj.get("gap", 0.0))
        output_tokens = int(obj["output_tokens"])
        user = _text_from_json(obj["user"], f"{where}.user")
    except KeyError as exc:
        raise TraceFormatError(f"{where}: missing field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        if isinstance(exc, TraceFormatError):
            raise
        raise TraceFormatError(f"{where}: {exc}") from exc
    system = _text_from_json(obj["system"], f"{where}.system") if obj.get("system") else None
    api = _api_from_json(obj.get("api"), f"{where}.api")
    parent = _parent_from_json(obj.get("parent"), f"{where}.parent")
    ended_by = _ended_by_from_json(obj.get("ended_by"), f"{where}.ended_by")
    return Turn(session, turn, arrival, gap, user, output_tokens, system, api, parent, ended_by)


def write_trace(turns: Iterable[Turn], path: Path) -> int:
    count = 0
    with path.open("wb") as out:
        for turn in turns:
            out.write(orjson.dumps(turn_to_json(turn)) + b"\n")
            count += 1
    return count


def iter_trace(path: Path) -> Iterator[Turn]:
    with path.open("rb") as src:
        for lineno, line in enumerate(src, 1):
            if line.strip():
                try:
                    obj = orjson.loads(line)
                except orjson.JSONDecodeError as exc:
                    raise TraceFormatError(f"{path}:{lineno}: {exc}") from exc
                yield turn_from_json(obj, f"{path}:{lineno}")


def read_trace(path: Path) -> list[Turn]:
    return list(iter_trace(path))


def group_sessions(turns: Sequence[Turn]) -> list[Session]:
    """Sessions ordered by arrival, each with its turns in order."""
    by_id: dict[str, list[Turn]] = {}
    for turn in turns:
        by_id.setdefault(turn.session, []).append(turn)
    sessions = [Session(sid, tuple(sorted(ts, key=lambda t: t.turn))) for sid, ts in by_id.items()]
    sessions.sort(key=lambda s: (s.arrival, s.id))
    return sessions
