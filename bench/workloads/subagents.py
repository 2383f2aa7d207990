"""Coding-agent sessions that spawn subagents (Claude Code's Task tool).

Each parent is an ``agent`` session (``bench.workloads.agent``). After a turn, with
probability ``spawn_share``, the parent hands a task to ``children`` subagents and waits
for them: each child is a session of its own (``Turn.parent`` names the parent) whose
prompt starts with the parent's system prompt, the same agent tools and instructions,
then its own task (a few hundred to a couple of thousand tokens), and which runs a few
tool-driven turns. The children start together a second after the parent's turn; the
parent's next turn comes once the longest child could have finished (its planned tool
time plus ``child_turn_s`` a turn). Children share nothing with their parent beyond the
system prompt: the parent's conversation is not in their prompts, as in Claude Code.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field, replace

from bench.workloads.agent import AgentParams, generate
from bench.workloads.flags import given
from bench.workloads.sampling import LogNormal, build_session, session_rng, within_context
from bench.workloads.trace import Turn

KIND = "subagents"

DEFAULT_SPAWN_SHARE = 0.08  # of a parent's turns: about 2.6 spawns in a 33-turn session
DEFAULT_CHILDREN = 2
DEFAULT_CHILD_TURNS = LogNormal(median=8, sigma=0.5, low=2, high=30)
DEFAULT_CHILD_TASK = LogNormal(median=800, sigma=0.6, low=100, high=3000)
# A child turn's time besides its tool call (prefill and decode), in the parent's wait.
DEFAULT_CHILD_TURN_S = 2.0
CHILD_START_S = 1.0


@dataclass(frozen=True, slots=True)
class SubagentParams:
    # Subagents multiply a parent's work: 40 parents (240 sessions in all) overloaded the
    # matrix's fleet (TTFT p50 18 s), 20 leave it loaded as the agent row is.
    parents: AgentParams = field(default_factory=lambda: AgentParams(sessions=20))
    spawn_share: float = DEFAULT_SPAWN_SHARE
    children: int = DEFAULT_CHILDREN
    child_turns: LogNormal = DEFAULT_CHILD_TURNS
    child_task: LogNormal = DEFAULT_CHILD_TASK
    child_turn_s: float = DEFAULT_CHILD_TURN_S

    def __post_init__(self) -> None:
        if not 0 <= self.spawn_share <= 1:
            raise ValueError(f"spawn_share must be in [0, 1], got {self.spawn_share}")
        if self.children < 1:
            raise ValueError(f"children must be >= 1, got {self.children}")


def _child(
    params: SubagentParams, seed: int, parent: list[Turn], name: str, start: float
) -> list[Turn]:
    """A subagent of ``parent`` (its turns), starting at ``start``: its prompt begins with
    the parent's system prompt."""
    rng = random.Random(f"{KIND}:{seed}:{name}")
    agent = params.parents
    turns = params.child_turns.draw_int(rng)
    users = [
        (params.child_task if k == 0 else agent.tool_result).draw_int(rng) for k in range(turns)
    ]
    outputs = [agent.output.draw_int(rng) for _ in range(turns)]
    gaps = [agent.tool_time.draw(rng) for _ in range(turns)]
    session = build_session(name, start, parent[0].system, users, outputs, gaps)
    session = within_context(session, agent.max_context_tokens)
    if not session:  # its first prompt alone is past the context limit
        return []
    return [replace(session[0], parent=parent[0].session), *session[1:]]


def _with_children(params: SubagentParams, seed: int, index: int, parent: list[Turn]) -> list[Turn]:
    """The parent's turns, its gaps stretched over the children it waits for, and the
    children."""
    rng = session_rng(seed, f"{KIND}-spawns", index)
    out: list[Turn] = []
    children: list[Turn] = []
    wait = 0.0  # the longest child of the previous turn's spawn, 0 without one
    shift = 0.0  # how much later the parent runs than planned, from earlier waits
    for k, planned in enumerate(parent):
        gap = max(planned.gap, wait) if k else planned.gap
        shift += gap - planned.gap
        turn = replace(planned, gap=gap, arrival=planned.arrival + shift)
        out.append(turn)
        wait = 0.0
        if k + 1 == len(parent) or rng.random() >= params.spawn_share:
            continue
        for c in range(params.children):
            name = f"{turn.session}/sub{k}-{c}"
            child = _child(params, seed, parent, name, turn.arrival + CHILD_START_S)
            children.extend(child)
            span = sum(t.gap for t in child) + params.child_turn_s * len(child)
            wait = max(wait, CHILD_START_S + span)
    return out + children


def generate_with_subagents(params: SubagentParams, seed: int) -> list[Turn]:
    by_session: dict[str, list[Turn]] = {}
    for turn in generate(params.parents, seed):
        by_session.setdefault(turn.session, []).append(turn)
    turns: list[Turn] = []
    for index, session in enumerate(by_session.values()):
        turns.extend(_with_children(params, seed, index, session))
    return sorted(turns, key=lambda t: (t.arrival, t.session, t.turn))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spawn-share", type=float, help="share of parent turns that spawn")
    parser.add_argument("--children", type=int, help="subagents a spawn starts")


def from_args(args: argparse.Namespace) -> list[Turn]:
    d = SubagentParams()
    parents = replace(
        d.parents,
        sessions=given(args.sessions, d.parents.sessions),
        rate=given(args.rate, d.parents.rate),
    )
    params = replace(
        d,
        parents=parents,
        spawn_share=given(args.spawn_share, d.spawn_share),
        children=given(args.children, d.children),
    )
    return generate_with_subagents(params, args.seed)
