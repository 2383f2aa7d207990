"""Arrival times and lengths from the Azure LLM inference trace 2023 (Splitwise, ISCA'24).

The CSVs (``AzureLLMInferenceTrace_{code,conv}.csv``) have the header
``TIMESTAMP,ContextTokens,GeneratedTokens`` with timestamps like
``2023-11-16 18:17:03.9799600``. They carry no prefix or session information, so they
serve two uses: a real arrival process to retime a generated trace (``with_arrivals``),
and single-turn sessions of real prompt and output lengths (``single_turn_sessions``),
whose prompts are unique text (no cache reuse to find).
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bench.workloads.sampling import shift_session
from bench.workloads.trace import TextBlock, TraceFormatError, Turn, group_sessions

KIND = "azure"

_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True, slots=True)
class AzureRow:
    offset_s: float  # seconds after the earliest row
    context_tokens: int
    generated_tokens: int


def _parse_time(text: str, where: str) -> datetime:
    try:
        # Python 3.11 accepts the file's 7 fractional digits (it keeps 6).
        return datetime.fromisoformat(text.strip())
    except ValueError as exc:
        raise TraceFormatError(f"{where}: bad TIMESTAMP {text!r}") from exc


def read_rows(path: Path) -> list[AzureRow]:
    """The rows of an Azure CSV in time order, timed from the earliest one."""
    raw: list[tuple[datetime, int, int]] = []
    with path.open(newline="", encoding="utf-8") as src:
        reader = csv.DictReader(src)
        missing = [c for c in _COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise TraceFormatError(f"{path}: missing columns {missing}; expected {_COLUMNS}")
        for lineno, record in enumerate(reader, 2):
            where = f"{path}:{lineno}"
            try:
                context = int(record["ContextTokens"])
                generated = int(record["GeneratedTokens"])
            except (TypeError, ValueError) as exc:
                raise TraceFormatError(f"{where}: {exc}") from exc
            raw.append((_parse_time(record["TIMESTAMP"], where), context, generated))
    raw.sort(key=lambda r: r[0])
    if not raw:
        return []
    start = raw[0][0]
    return [AzureRow((t - start).total_seconds(), c, g) for t, c, g in raw]


def arrival_offsets(path: Path) -> list[float]:
    """Seconds from the first request to each request, ascending."""
    return [row.offset_s for row in read_rows(path)]


def with_arrivals(turns: Sequence[Turn], arrivals: Sequence[float]) -> list[Turn]:
    """``turns`` with session i (in order of arrival) starting at ``arrivals[i]``.

    Later turns move with their session's first turn; gaps are unchanged. Needs at least
    one arrival per session; extra arrivals are unused.
    """
    sessions = group_sessions(turns)
    if len(arrivals) < len(sessions):
        raise ValueError(
            f"{len(sessions)} sessions but only {len(arrivals)} arrival times; "
            "generate fewer sessions"
        )
    retimed: list[Turn] = []
    for session, arrival in zip(sessions, arrivals, strict=False):
        retimed.extend(shift_session(session.turns, arrival))
    return retimed


def single_turn_sessions(rows: Sequence[AzureRow]) -> list[Turn]:
    """One single-turn session per row: a unique prompt of ContextTokens tokens."""
    turns: list[Turn] = []
    for index, row in enumerate(rows):
        session = f"{KIND}-{index}"
        user = (TextBlock(f"{session}/t0", max(1, row.context_tokens)),)
        turns.append(Turn(session, 0, row.offset_s, 0.0, user, max(1, row.generated_tokens)))
    return turns


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvrouter bench gen azure``'s flags."""
    parser.add_argument("--source", type=Path, required=True, help="an Azure LLM 2023 CSV")
    parser.add_argument("--sessions", type=int, help="only the first N requests")


def from_args(args: argparse.Namespace) -> list[Turn]:
    rows = read_rows(args.source)
    if args.sessions is not None:
        rows = rows[: args.sessions]
    return single_turn_sessions(rows)
