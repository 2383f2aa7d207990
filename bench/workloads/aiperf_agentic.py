"""Load the ``dataset.jsonl`` of aiperf 0.13's ``aiperf synthesize agentic-code`` as turns.

The synthesizer (``aiperf/dataset/agentic_code_gen/``: ``session_synthesizer.py`` draws
the sessions, ``prefix_model.py`` the hash ids, ``writer.py`` the rows) writes one row
per turn, the turns of a session on consecutive lines::

    turn 0:  {"session_id": "sess-…", "input_length": n, "output_length": n,
              "hash_ids": [...], "timestamp": 0.0, "group_id": g[, "is_restart": true]}
    later:   {"session_id": "sess-…", "input_length": n, "output_length": n,
              "hash_ids": [...], "delay": ms}

``input_length`` is the tokens *new* in that turn: the whole first prompt on turn 0, the
new user message (a tool result or the person's next message) afterwards, the previous
reply not counted. ``hash_ids`` holds exactly ``ceil(input_length / block_size)`` ids of
``block_size``-token blocks (512 unless the synthesizer's config says otherwise), the
last block partial. Turn 0's ids are the cache layers: L1, the tools and system prompt
every session shares (ids from 0); L1.5, a prefix shared by the sessions of one group
(``group_id``, drawn Zipf-distributed; 200 ids reserved a group); L2, the session's
own initial files. A later turn's ids are new in the file, numbered on from the
session's turn 0 (but see restarts below). With no ``--config`` the layers are 32,000 +
20,000 tokens over 50 groups; its bundled ``default.json`` has 32,000 + 0. ``delay`` is
the milliseconds the client waits after the previous reply before sending the turn,
drawn from a mixture of fast tool-call follow-ups (70%) and slow human replies; the row
does not say which. A restart
continuation (``is_restart``) is a session whose turn 0 carries the accumulated
context of an earlier session of the same group: its ids start with that session's
turn-0 ids and number the rest on from them, so they repeat some of that session's
later ids (whose rows counted new tokens only, without replies).

Text. Each id becomes ``TextBlock(f"aiperf-{id}", block_size)``, the last cut so the
row's blocks total ``input_length``; equal ids give equal text wherever they appear (as
aiperf's own replay of the file does with its corpus), so the layers are shared
prefixes as the synthesizer meant them. The replay inserts the regenerated reply before
each new message, as aiperf's does.

Timing. Every turn 0 has timestamp 0 (the synthesizer leaves the arrival process to
the benchmark's concurrency), so the reader ignores it and starts the sessions, in
file order, as a Poisson process of ``rate`` sessions a second (seeded; the first at
0). A later turn's ``gap`` is its ``delay`` in seconds and its ``arrival`` the previous
arrival plus that gap (a lower bound, as for the generated kinds). ``ended_by`` is left
unset: the row does not record whether the delay was a tool call or a person.

``max_context_tokens`` ends a session before the first turn whose replayed prompt plus
reply would pass it (a session whose turn 0 does is left out): the synthesizer's default
context reaches 200,000 tokens, past what many engines accept.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from bench.workloads.flags import add_max_context_argument
from bench.workloads.sampling import poisson_arrivals, within_context
from bench.workloads.trace import TextBlock, TraceFormatError, Turn

KIND = "aiperf-agentic"

DEFAULT_BLOCK_TOKENS = 512
DEFAULT_RATE = 0.05  # sessions/s, the agent kind's default: one every 20 s on average


@dataclass(frozen=True, slots=True)
class AgenticRow:
    session_id: str
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    delay_ms: float | None  # None on a session's first row


@dataclass(frozen=True, slots=True)
class AiperfAgenticParams:
    """How the rows become timed turns; see the module docstring."""

    rate: float = DEFAULT_RATE
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    max_sessions: int | None = None  # only the first sessions (in file order); None: all
    max_context_tokens: int = 0  # end a session before a turn would pass it; 0: no limit

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0 sessions/s, got {self.rate}")
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        if self.max_sessions is not None and self.max_sessions < 0:
            raise ValueError("max_sessions must be >= 0")
        if self.max_context_tokens < 0:
            raise ValueError("max_context_tokens must be >= 0")


def _row_from_json(obj: object, block_tokens: int, where: str) -> AgenticRow:
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    try:
        delay = obj.get("delay")
        row = AgenticRow(
            session_id=str(obj["session_id"]),
            input_length=int(obj["input_length"]),
            output_length=int(obj["output_length"]),
            hash_ids=tuple(int(h) for h in obj["hash_ids"]),
            delay_ms=None if delay is None else float(delay),
        )
    except KeyError as exc:
        raise TraceFormatError(f"{where}: missing field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(f"{where}: {exc}") from exc
    if row.input_length < 1 or len(row.hash_ids) != -(-row.input_length // block_tokens):
        raise TraceFormatError(
            f"{where}: {len(row.hash_ids)} hash_ids do not cover input_length "
            f"{row.input_length} in {block_tokens}-token blocks (see --block-tokens)"
        )
    if row.delay_ms is not None and row.delay_ms < 0:
        raise TraceFormatError(f"{where}: negative delay {row.delay_ms}")
    return row


def read_sessions(path: Path, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[list[AgenticRow]]:
    """The rows of each session, sessions in order of their first row."""
    sessions: dict[str, list[AgenticRow]] = {}
    with path.open("rb") as src:
        for lineno, line in enumerate(src, 1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise TraceFormatError(f"{path}:{lineno}: {exc}") from exc
            row = _row_from_json(obj, block_tokens, f"{path}:{lineno}")
            sessions.setdefault(row.session_id, []).append(row)
    return list(sessions.values())


def row_blocks(row: AgenticRow, block_tokens: int) -> tuple[TextBlock, ...]:
    """The row's new tokens as ``aiperf-<id>`` blocks totalling ``input_length``."""
    last = row.input_length - block_tokens * (len(row.hash_ids) - 1)
    sizes = [block_tokens] * (len(row.hash_ids) - 1) + [last]
    return tuple(TextBlock(f"aiperf-{h}", n) for h, n in zip(row.hash_ids, sizes, strict=True))


def session_turns(rows: Sequence[AgenticRow], arrival: float, block_tokens: int) -> list[Turn]:
    session = rows[0].session_id
    turns: list[Turn] = []
    now = arrival
    for k, row in enumerate(rows):
        gap = (row.delay_ms or 0.0) / 1000 if k else 0.0
        now += gap
        user = row_blocks(row, block_tokens)
        turns.append(Turn(session, k, now, gap, user, max(1, row.output_length)))
    return turns


def load(path: Path, params: AiperfAgenticParams, seed: int = 0) -> list[Turn]:
    """The turns of the synthesized dataset at ``path``, sessions in file order."""
    sessions = read_sessions(path, params.block_tokens)
    if params.max_sessions is not None:
        sessions = sessions[: params.max_sessions]
    arrivals = poisson_arrivals(seed, KIND, params.rate, len(sessions))
    turns: list[Turn] = []
    for rows, arrival in zip(sessions, arrivals, strict=True):
        session = session_turns(rows, arrival, params.block_tokens)
        turns.extend(within_context(session, params.max_context_tokens))
    return turns


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvrouter bench gen aiperf-agentic``'s flags."""
    parser.add_argument(
        "--source",
        type=Path,
        required=True,
        help="the dataset.jsonl that 'aiperf synthesize agentic-code' wrote",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=DEFAULT_RATE,
        help="session starts per second, Poisson (the file times every session at 0)",
    )
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=DEFAULT_BLOCK_TOKENS,
        help="tokens per hash id: the synthesizer config's block_size",
    )
    parser.add_argument("--max-sessions", type=int, help="only the first sessions")
    add_max_context_argument(parser)


def params_from(args: argparse.Namespace) -> AiperfAgenticParams:
    return AiperfAgenticParams(
        rate=args.rate,
        block_tokens=args.block_tokens,
        max_sessions=args.max_sessions,
        max_context_tokens=args.max_context_tokens,
    )


def from_args(args: argparse.Namespace) -> list[Turn]:
    return load(args.source, params_from(args), args.seed)
