"""Load a Mooncake FAST'25 trace (``conversation_trace.jsonl`` and friends) as turns.

A Mooncake row is ``{"timestamp": ms, "input_length": n, "output_length": n,
"hash_ids": [...]}``: no text and no session ids. ``hash_ids`` are chained ids of
512-token prompt blocks (equal id at position i means equal first (i+1)*512 tokens), so
a block's id names its whole prefix, and ``len(hash_ids) == ceil(input_length / 512)``.

Text. Each hash id becomes the block ``TextBlock(f"mc-{id}", 512)``, the last one cut so
the row's total is ``input_length``; equal ids give equal text and so shared prefixes.

Sessions (the rule). Row H *extends* an earlier row P when H starts with all of P's
blocks, or with all but P's last block (a partial last block changes its id once the
conversation appends to it). Among the earlier rows H extends by at least
``min_shared_blocks`` blocks, take the one with the longest shared prefix, the most
recent on ties. H is the next turn of P's session when P is still that session's last
turn and H's prompt is longer than P's; otherwise H starts a session of its own. So a
re-sent prompt (regeneration: same blocks, no growth) or a branch from an older turn
becomes a new session whose turn-0 blocks still share the prefix with the original's
turn 0. ``min_shared_blocks`` defaults to 2 because every row of the conversation trace
starts with the same block 0, so one shared block says nothing about the session.
Ambiguity remains: two sessions behind one long common prompt are told apart only by
the blocks after it.

A next turn's user text. At replay the previous reply is generated and inserted before
the new user message, so the new message gets the tokens the trace added beyond the
previous prompt minus the previous output (when ``output_in_prompt``; the conversation
trace's prompts grow by the previous output plus a median of ~26 tokens), at least
``min_user_tokens``. Lengths are counted from the replayed prompt, so after a message
had to be lengthened to that minimum (the trace grew by less than the reply) the next
ones make up for it; in the conversation trace 450 of 3,832 next turns still replay
longer than the trace, by a median of 15 tokens. Without ``output_in_prompt`` (the
synthetic trace's prompts do not hold the replies) the new message is the whole growth,
and replayed prompts are longer than the trace's. The message is fresh text keyed by
session and turn: in the trace those blocks mix the reply, which the replay regenerates,
with the new message, so their ids cannot be kept. Prefix sharing between sessions
therefore comes from turn-0 blocks only.

Timing. ``arrival`` is the row's timestamp in seconds; a next turn's ``gap`` is the time
since the previous turn's timestamp (at least 0). That gap includes the previous
response time, which the replay adds again, so replayed sessions run somewhat slower
than the original.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import orjson

from bench.workloads.trace import TextBlock, TextSpec, TraceFormatError, Turn

KIND = "mooncake"

BLOCK_TOKENS = 512
DEFAULT_MIN_SHARED_BLOCKS = 2
DEFAULT_MIN_USER_TOKENS = 4


@dataclass(frozen=True, slots=True)
class MooncakeRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class MooncakeParams:
    """How rows become sessions and turns; see the module docstring for the rules."""

    min_shared_blocks: int = DEFAULT_MIN_SHARED_BLOCKS
    min_user_tokens: int = DEFAULT_MIN_USER_TOKENS
    output_in_prompt: bool = True
    max_rows: int | None = None  # only the first rows (by timestamp); None: all

    def __post_init__(self) -> None:
        if self.min_shared_blocks < 1:
            raise ValueError("min_shared_blocks must be >= 1")
        if self.min_user_tokens < 1:
            raise ValueError("min_user_tokens must be >= 1")
        if self.max_rows is not None and self.max_rows < 0:
            raise ValueError("max_rows must be >= 0")


@dataclass(frozen=True, slots=True)
class Linking:
    """Rows grouped into sessions (row indices, in order), and how often a match was
    refused because it was a re-sent prompt or a branch from an older turn."""

    sessions: tuple[tuple[int, ...], ...]
    forks: int

    @property
    def multi_turn(self) -> int:
        return sum(1 for rows in self.sessions if len(rows) > 1)


def _row_from_json(obj: object, where: str) -> MooncakeRow:
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    try:
        row = MooncakeRow(
            timestamp_ms=float(obj["timestamp"]),
            input_length=int(obj["input_length"]),
            output_length=int(obj["output_length"]),
            hash_ids=tuple(int(h) for h in obj["hash_ids"]),
        )
    except KeyError as exc:
        raise TraceFormatError(f"{where}: missing field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(f"{where}: {exc}") from exc
    blocks = len(row.hash_ids)
    if row.input_length < 1 or blocks != -(-row.input_length // BLOCK_TOKENS):
        raise TraceFormatError(
            f"{where}: {blocks} hash_ids do not cover input_length {row.input_length} "
            f"in {BLOCK_TOKENS}-token blocks"
        )
    return row


def read_rows(path: Path) -> list[MooncakeRow]:
    """The rows of a Mooncake trace file, stably sorted by timestamp."""
    rows: list[MooncakeRow] = []
    with path.open("rb") as src:
        for lineno, line in enumerate(src, 1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise TraceFormatError(f"{path}:{lineno}: {exc}") from exc
            rows.append(_row_from_json(obj, f"{path}:{lineno}"))
    rows.sort(key=lambda r: r.timestamp_ms)
    return rows


def _best_parent(
    ids: tuple[int, ...],
    whole: dict[tuple[int, int], int],
    all_but_last: dict[tuple[int, int], int],
    min_shared: int,
) -> int | None:
    # Chained ids: (k, ids[k-1]) names the prefix ids[:k], so a dict lookup per length
    # replaces comparing tuples.
    for k in range(len(ids), min_shared - 1, -1):
        key = (k, ids[k - 1])
        found = [index for index in (whole.get(key), all_but_last.get(key)) if index is not None]
        if found:
            return max(found)
    return None


def link_sessions(rows: Sequence[MooncakeRow], params: MooncakeParams) -> Linking:
    """Group rows (in timestamp order) into sessions by the rule in the module docstring."""
    whole: dict[tuple[int, int], int] = {}  # (len(P), P[-1]) -> latest such row P
    all_but_last: dict[tuple[int, int], int] = {}  # (len(P)-1, P[-2]) -> latest P
    session_of: list[int] = []
    sessions: list[list[int]] = []
    forks = 0
    for index, row in enumerate(rows):
        ids = row.hash_ids
        parent = _best_parent(ids, whole, all_but_last, params.min_shared_blocks)
        if parent is not None and (
            sessions[session_of[parent]][-1] == parent
            and row.input_length > rows[parent].input_length
        ):
            session = session_of[parent]
            sessions[session].append(index)
        else:
            forks += parent is not None
            session = len(sessions)
            sessions.append([index])
        session_of.append(session)
        whole[(len(ids), ids[-1])] = index
        if len(ids) >= 2:
            all_but_last[(len(ids) - 1, ids[-2])] = index
    return Linking(tuple(tuple(s) for s in sessions), forks)


def prompt_blocks(row: MooncakeRow) -> TextSpec:
    """The row's whole prompt as ``mc-<id>`` blocks totalling ``input_length`` tokens."""
    last = row.input_length - BLOCK_TOKENS * (len(row.hash_ids) - 1)
    sizes = [BLOCK_TOKENS] * (len(row.hash_ids) - 1) + [last]
    return tuple(TextBlock(f"mc-{h}", n) for h, n in zip(row.hash_ids, sizes, strict=True))


def _session_turns(
    rows: Sequence[MooncakeRow], indices: Sequence[int], params: MooncakeParams
) -> list[Turn]:
    session = f"{KIND}-{indices[0]}"
    first = rows[indices[0]]
    turns = [
        Turn(
            session,
            0,
            first.timestamp_ms / 1000,
            0.0,
            prompt_blocks(first),
            max(1, first.output_length),
        )
    ]
    replayed = first.input_length  # the replay's prompt length at the previous turn
    for k, (before, index) in enumerate(pairwise(indices), 1):
        prev, row = rows[before], rows[index]
        if params.output_in_prompt:
            # Aim at the trace's length from the replay's own prompt, so one clipped
            # message does not leave every later prompt of the session too long.
            added = row.input_length - replayed - turns[-1].output_tokens
        else:
            added = row.input_length - prev.input_length
        user_tokens = max(params.min_user_tokens, added)
        replayed += turns[-1].output_tokens + user_tokens
        gap = max(0.0, (row.timestamp_ms - prev.timestamp_ms) / 1000)
        turns.append(
            Turn(
                session,
                k,
                row.timestamp_ms / 1000,
                gap,
                (TextBlock(f"{session}/t{k}", user_tokens),),
                max(1, row.output_length),
            )
        )
    return turns


def to_turns(rows: Sequence[MooncakeRow], linking: Linking, params: MooncakeParams) -> list[Turn]:
    turns: list[Turn] = []
    for indices in linking.sessions:
        turns.extend(_session_turns(rows, indices, params))
    return turns


def load(path: Path, params: MooncakeParams | None = None) -> list[Turn]:
    """The turns of the Mooncake trace at ``path``, sessions in order of their first row."""
    params = params or MooncakeParams()
    rows = read_rows(path)
    if params.max_rows is not None:
        rows = rows[: params.max_rows]
    return to_turns(rows, link_sessions(rows, params), params)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvrouter bench gen mooncake``'s flags."""
    parser.add_argument("--source", type=Path, required=True, help="a Mooncake .jsonl trace")
    parser.add_argument("--max-rows", type=int, help="only the first rows (by timestamp)")
    parser.add_argument("--min-shared-blocks", type=int, default=DEFAULT_MIN_SHARED_BLOCKS)
    parser.add_argument("--min-user-tokens", type=int, default=DEFAULT_MIN_USER_TOKENS)
    parser.add_argument(
        "--output-in-prompt",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the next prompt contains the previous reply (true of conversation_trace)",
    )


def params_from(args: argparse.Namespace) -> MooncakeParams:
    return MooncakeParams(
        min_shared_blocks=args.min_shared_blocks,
        min_user_tokens=args.min_user_tokens,
        output_in_prompt=args.output_in_prompt,
        max_rows=args.max_rows,
    )


def from_args(args: argparse.Namespace) -> list[Turn]:
    return load(args.source, params_from(args))
