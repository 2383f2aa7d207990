"""Shape statistics of a trace: what ``kvrouter bench gen`` prints and the tests check.

Token counts are stand-in tokens of the texts and replies, without chat-template tokens.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.workloads.trace import Session, TextBlock, Turn, group_sessions, text_tokens

# The turn index at which agent traces are compared with published ones.
CONTEXT_TURN = 30


@dataclass(frozen=True, slots=True)
class TraceStats:
    sessions: int
    multi_turn_sessions: int
    turns: int
    median_turns: float
    # Median of context_before(session, CONTEXT_TURN) over sessions with at least
    # CONTEXT_TURN turns; None when no session has that many.
    median_context_at_turn_30: float | None
    sessions_reaching_turn_30: int
    text_tokens: int  # system prompts (once per session) and user messages
    # The same, counting each distinct text block once: what is left to prefill when
    # every shared block (system prompts, burst prompts) is computed only once.
    distinct_text_tokens: int
    output_tokens: int
    prompt_tokens: int  # summed over turns: what the replay prefills without any caching
    span_s: float  # last session's arrival


def context_before(session: Session, turn: int) -> int:
    """System tokens plus user and output tokens of turns ``0 .. turn-1``.

    The output of turn k is part of the prompt of turn k+1, so this is the prompt of
    ``turn`` without its own user message.
    """
    total = 0
    for t in session.turns[:turn]:
        if t.system is not None:
            total += text_tokens(t.system)
        total += text_tokens(t.user) + t.output_tokens
    return total


def _prompt_tokens(session: Session) -> int:
    total = 0
    context = 0
    for t in session.turns:
        if t.system is not None:
            context += text_tokens(t.system)
        context += text_tokens(t.user)
        total += context
        context += t.output_tokens
    return total


def _distinct_tokens(turns: Sequence[Turn]) -> int:
    blocks: set[TextBlock] = set()
    literals: set[str] = set()
    for t in turns:
        for spec in (t.user, t.system):
            if isinstance(spec, str):
                literals.add(spec)
            elif spec is not None:
                blocks.update(spec)
    return sum(b.tokens for b in blocks) + sum(text_tokens(text) for text in literals)


def summarize(turns: Sequence[Turn]) -> TraceStats:
    sessions = group_sessions(turns)
    counts = [len(s.turns) for s in sessions]
    long_enough = [s for s in sessions if len(s.turns) >= CONTEXT_TURN]
    contexts = [context_before(s, CONTEXT_TURN) for s in long_enough]
    text = sum(
        text_tokens(t.user) + (text_tokens(t.system) if t.system is not None else 0) for t in turns
    )
    return TraceStats(
        sessions=len(sessions),
        multi_turn_sessions=sum(1 for c in counts if c > 1),
        turns=len(turns),
        median_turns=statistics.median(counts) if counts else 0.0,
        median_context_at_turn_30=statistics.median(contexts) if contexts else None,
        sessions_reaching_turn_30=len(long_enough),
        text_tokens=text,
        distinct_text_tokens=_distinct_tokens(turns),
        output_tokens=sum(t.output_tokens for t in turns),
        prompt_tokens=sum(_prompt_tokens(s) for s in sessions),
        span_s=max((s.arrival for s in sessions), default=0.0),
    )


def describe(stats: TraceStats) -> str:
    """One paragraph for a person reading the terminal."""
    if stats.median_context_at_turn_30 is None:
        context = f"no session reaches turn {CONTEXT_TURN}"
    else:
        context = (
            f"median context at turn {CONTEXT_TURN} {stats.median_context_at_turn_30:,.0f} "
            f"tokens over the {stats.sessions_reaching_turn_30} sessions that get there"
        )
    return (
        f"{stats.sessions} sessions ({stats.multi_turn_sessions} multi-turn) arriving over "
        f"{stats.span_s:,.1f} s, {stats.turns} turns, median {stats.median_turns:g} turns "
        f"per session; {context}; {stats.text_tokens:,} input text tokens "
        f"({stats.distinct_text_tokens:,} distinct), "
        f"{stats.output_tokens:,} output tokens, {stats.prompt_tokens:,} prompt tokens "
        "summed over turns (prefill work with no cache)."
    )
