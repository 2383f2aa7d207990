"""SemiAnalysis InferenceX AgentX traces (Claude Code, Weka layout) as sessions and turns.

The file format is in ``bench.workloads.agentx_format``. A trace becomes several
sessions: the main agent's, and one per subagent. Within each (the main agent's own
requests, or one subagent's), requests are linked into *context chains*, and every
chain is a session.

Chains (the rule). A request *extends* an earlier one when its prompt is longer and
its ``hash_ids`` start with all the earlier one's ids, or all but the last (a partial
last block changes its id as the conversation appends to it). Requests are taken in
order of ``t``; each extends the chain, among those whose latest request it extends,
with the longest shared prefix (the most recently active on ties), or starts a chain of
its own. So a request after a context compaction, a prefix-disjoint call such as a
title generation, or a worker thread the capture flattened into the list, becomes a
session of its own whose turn 0 still shares whatever prefix the trace says it shares.
A request without ``hash_ids`` has no evidence and rides the first chain, as in aiperf.
Requests with ``in`` 0 are skipped. aiperf (``weka_agent_chains.py``) detects chains
by the same longest-common-prefix evidence but goes further: it splices compaction
continuations back onto their chain and makes flattened workers children joined by
their parent; a replay that appends to a growing conversation can do neither.

Sessions. The main agent's first chain is ``agentx-<trace id>``; a subagent's first
chain is ``agentx-<trace id>/<agent_id>`` (``#2``, ``#3``, ... on a repeated agent_id);
further chains add ``~1``, ``~2``, .... A subagent's sessions have ``parent`` set to the
main session (when the main agent made requests). As aiperf's own replay keeps a
subagent's requests on the trace's timeline, so do the arrivals here; the replay does
not make the parent wait for its subagents (aiperf joins them), but the parent's next
request is timed after them in the trace already.

Text. Turn 0 is the chain's first prompt: each of the ``min(len(hash_ids), in //
block_size)`` full blocks becomes ``TextBlock(f"agentx-<trace id>-{id}", block_size)``
(``agentx-{id}`` with ``hash_id_scope: "global"``), and the rest of ``in`` fresh text;
equal ids within a trace give equal text, which is how a subagent's or a new chain's
turn 0 starts from the prefix it shares with the parent. When the (sub)agent declares
``tool_tokens + system_tokens``, the first ``ceil((tool + system) / block_size)`` blocks
are the system prompt, as aiperf sends them. A later turn's user message is fresh text
of the tokens the trace added beyond the previous prompt and its reply (which the replay
regenerates and inserts), at least ``min_user_tokens``, made up later as in
``bench.workloads.mooncake``. Only turn-0 blocks are shared across sessions.

Timing. Traces start as a Poisson process of ``rate`` traces a second, in file order
(seeded; the first at 0): the corpora time each trace from its own start. A turn's
``arrival`` is its trace's start plus its ``t``. A later turn's ``gap`` is the idle time
between the previous request's end and its start, ``t - (t_prev + api_time_prev)``, at
least 0 (aiperf's end-to-start delay; without ``api_time`` the start-to-start gap), at
most ``max_gap`` when given (the traces keep people's pauses, minutes or more).

``max_context_tokens`` ends a session before the first turn whose replayed prompt plus
reply would pass it (a session whose turn 0 does is left out; Claude Code contexts pass
128K), as aiperf's ``--max-context-length`` leaves out whole traces.

``ended_by``. ``"tool"`` when the request's ``stop`` is ``tool_use``, ``"user"`` when it is
``end_turn``; with no ``stop``, the chain's next request decides: ``"tool"`` when its
``input_types`` include ``tool_result``, ``"user"`` when it names other input; else unset.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from bench.workloads.agentx_format import AgentxRequest, AgentxTrace, read_traces
from bench.workloads.flags import add_max_context_argument
from bench.workloads.sampling import poisson_arrivals, within_context
from bench.workloads.trace import EndedBy, TextBlock, Turn

KIND = "agentx"

DEFAULT_RATE = 0.05  # traces/s, the agent kind's default: one every 20 s on average
DEFAULT_MIN_USER_TOKENS = 4


@dataclass(frozen=True, slots=True)
class AgentxParams:
    """How traces become sessions and turns; see the module docstring for the rules."""

    rate: float = DEFAULT_RATE
    min_user_tokens: int = DEFAULT_MIN_USER_TOKENS
    max_gap: float | None = None  # seconds; None: the trace's gaps
    max_traces: int | None = None  # only the first traces (in file order); None: all
    max_context_tokens: int = 0  # end a session before a turn would pass it; 0: no limit

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0 traces/s, got {self.rate}")
        if self.min_user_tokens < 1:
            raise ValueError("min_user_tokens must be >= 1")
        if self.max_gap is not None and self.max_gap < 0:
            raise ValueError("max_gap must be >= 0")
        if self.max_traces is not None and self.max_traces < 0:
            raise ValueError("max_traces must be >= 0")
        if self.max_context_tokens < 0:
            raise ValueError("max_context_tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class Stream:
    """The requests one agent made, and how its sessions are named and prefixed."""

    session: str
    requests: tuple[AgentxRequest, ...]
    prefix_tokens: int
    parent: str | None


def _shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    if len(a) <= len(b) and tuple(b[: len(a)]) == tuple(a):
        return len(a)  # the usual case: the whole earlier prompt, compared in one go
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _extends(earlier: AgentxRequest, later: AgentxRequest) -> int | None:
    """The shared prefix in blocks when ``later`` extends ``earlier``, else None."""
    shared = _shared_prefix(earlier.hash_ids, later.hash_ids)
    grows = later.input_tokens > earlier.input_tokens
    return shared if grows and shared >= max(1, len(earlier.hash_ids) - 1) else None


@dataclass(slots=True)
class _Chain:
    indices: list[int]
    last_hashed: int | None  # the latest request with hash_ids: the one to extend


def _chain_for(
    request: AgentxRequest, chains: list[_Chain], requests: Sequence[AgentxRequest]
) -> _Chain | None:
    if not request.hash_ids:
        return chains[0] if chains else None  # no evidence: the first chain, as in aiperf
    best: tuple[int, float] | None = None
    chosen: _Chain | None = None
    for chain in chains:
        if chain.last_hashed is None:
            continue
        shared = _extends(requests[chain.last_hashed], request)
        if shared is None:
            continue
        rank = (shared, requests[chain.indices[-1]].t)
        if best is None or rank >= best:
            best, chosen = rank, chain
    if chosen is None and chains and chains[0].last_hashed is None:
        return chains[0]  # nothing yet says the first chain's context is another one
    return chosen


def link_chains(requests: Sequence[AgentxRequest]) -> list[list[int]]:
    """Indices of ``requests`` grouped into chains by the rule in the module docstring,
    each chain in time order, chains in order of their first request."""
    chains: list[_Chain] = []
    for index in sorted(range(len(requests)), key=lambda i: (requests[i].t, i)):
        request = requests[index]
        if request.input_tokens == 0:
            continue
        chain = _chain_for(request, chains, requests)
        if chain is None:
            chain = _Chain([], None)
            chains.append(chain)
        chain.indices.append(index)
        if request.hash_ids:
            chain.last_hashed = index
    return [chain.indices for chain in chains]


def _ended_by(request: AgentxRequest, following: AgentxRequest | None) -> EndedBy | None:
    if request.stop == "tool_use":
        return "tool"
    if request.stop == "end_turn":
        return "user"
    if request.stop or following is None or not following.input_types:
        return None
    return "tool" if "tool_result" in following.input_types else "user"


def _first_prompt(
    request: AgentxRequest, session: str, key: str, block_size: int, prefix_tokens: int
) -> tuple[tuple[TextBlock, ...] | None, tuple[TextBlock, ...]]:
    """Turn 0's (system, user) blocks; see "Text" in the module docstring."""
    covered = min(len(request.hash_ids), request.input_tokens // block_size)
    blocks = [TextBlock(f"{key}-{h}", block_size) for h in request.hash_ids[:covered]]
    tail = request.input_tokens - covered * block_size
    if tail:
        blocks.append(TextBlock(f"{session}/t0", tail))
    system_blocks = math.ceil(prefix_tokens / block_size)
    if 0 < system_blocks <= covered and system_blocks < len(blocks):
        return tuple(blocks[:system_blocks]), tuple(blocks[system_blocks:])
    return None, tuple(blocks)


def chain_turns(
    stream: Stream,
    session: str,
    chain: Sequence[AgentxRequest],
    trace: AgentxTrace,
    start: float,
    params: AgentxParams,
) -> list[Turn]:
    key = f"{KIND}-{trace.id}" if trace.scope == "local" else KIND
    first = chain[0]
    system, user = _first_prompt(first, session, key, trace.block_size, stream.prefix_tokens)
    following = [*chain[1:], None]
    turns = [
        Turn(
            session,
            0,
            start + first.t,
            0.0,
            user,
            max(1, first.output_tokens),
            system=system,
            parent=stream.parent,
            ended_by=_ended_by(first, following[0]),
        )
    ]
    replayed = first.input_tokens  # the replay's prompt length at the previous turn
    for k, (before, request) in enumerate(pairwise(chain), 1):
        user_tokens = max(
            params.min_user_tokens, request.input_tokens - replayed - turns[-1].output_tokens
        )
        replayed += turns[-1].output_tokens + user_tokens
        gap = max(0.0, request.t - before.t - (before.api_time or 0.0))
        if params.max_gap is not None:
            gap = min(gap, params.max_gap)
        turns.append(
            Turn(
                session,
                k,
                start + request.t,
                gap,
                (TextBlock(f"{session}/t{k}", user_tokens),),
                max(1, request.output_tokens),
                ended_by=_ended_by(request, following[k]),
            )
        )
    return turns


def streams(trace: AgentxTrace) -> list[Stream]:
    """The main agent's stream, then each subagent's, named as the module docstring says."""
    main = f"{KIND}-{trace.id}"
    parent = main if any(r.input_tokens for r in trace.requests) else None
    found = [Stream(main, trace.requests, trace.prefix_tokens, None)]
    seen: dict[str, int] = {}
    for sub in trace.subagents:
        seen[sub.agent_id] = seen.get(sub.agent_id, 0) + 1
        repeat = seen[sub.agent_id]
        name = f"{main}/{sub.agent_id}" + (f"#{repeat}" if repeat > 1 else "")
        found.append(Stream(name, sub.requests, sub.prefix_tokens, parent))
    return found


def trace_turns(trace: AgentxTrace, start: float, params: AgentxParams) -> list[Turn]:
    """Every session of one trace, its first request arriving at ``start``."""
    agents = streams(trace)
    origin = min((r.t for s in agents for r in s.requests if r.input_tokens), default=0.0)
    turns: list[Turn] = []
    for stream in agents:
        for n, chain in enumerate(link_chains(stream.requests)):
            session = stream.session + (f"~{n}" if n else "")
            requests = [stream.requests[i] for i in chain]
            chained = chain_turns(stream, session, requests, trace, start - origin, params)
            turns.extend(within_context(chained, params.max_context_tokens))
    return turns


def load(path: Path, params: AgentxParams | None = None, seed: int = 0) -> list[Turn]:
    """The turns of the AgentX traces at ``path``, traces in file order."""
    params = params or AgentxParams()
    traces = read_traces(path)
    if params.max_traces is not None:
        traces = traces[: params.max_traces]
    starts = poisson_arrivals(seed, KIND, params.rate, len(traces))
    turns: list[Turn] = []
    for trace, start in zip(traces, starts, strict=True):
        turns.extend(trace_turns(trace, start, params))
    return turns


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvrouter bench gen agentx``'s flags."""
    parser.add_argument(
        "--source",
        type=Path,
        required=True,
        help="a Weka-layout trace .json, a directory of them, or a .jsonl of one a line",
    )
    parser.add_argument(
        "--rate", type=float, default=DEFAULT_RATE, help="trace starts per second, Poisson"
    )
    parser.add_argument("--max-traces", type=int, help="only the first traces")
    parser.add_argument("--max-gap", type=float, help="cap each pause between turns (s)")
    parser.add_argument("--min-user-tokens", type=int, default=DEFAULT_MIN_USER_TOKENS)
    add_max_context_argument(parser)


def params_from(args: argparse.Namespace) -> AgentxParams:
    return AgentxParams(
        rate=args.rate,
        min_user_tokens=args.min_user_tokens,
        max_gap=args.max_gap,
        max_traces=args.max_traces,
        max_context_tokens=args.max_context_tokens,
    )


def from_args(args: argparse.Namespace) -> list[Turn]:
    return load(args.source, params_from(args), args.seed)
