"""The subagent workload: parents that hand tasks to subagents and wait for them."""

from __future__ import annotations

from bench.workloads.agent import AgentParams
from bench.workloads.subagents import CHILD_START_S, SubagentParams, generate_with_subagents
from bench.workloads.trace import Turn

PARAMS = SubagentParams(parents=AgentParams(sessions=6, rate=0.1), spawn_share=0.2)


def sessions(turns: list[Turn]) -> dict[str, list[Turn]]:
    out: dict[str, list[Turn]] = {}
    for turn in turns:
        out.setdefault(turn.session, []).append(turn)
    return out


def test_children_start_from_their_parents_system_prompt_and_the_parent_waits() -> None:
    turns = generate_with_subagents(PARAMS, seed=3)
    assert turns == generate_with_subagents(PARAMS, seed=3)  # the same every time
    by_session = sessions(turns)
    children = {s: t for s, t in by_session.items() if t[0].parent is not None}
    assert children and len(children) % PARAMS.children == 0
    for name, child in children.items():
        parent = by_session[child[0].parent or ""]
        spawned_after = int(name.rsplit("/sub", 1)[1].split("-")[0])
        assert child[0].system == parent[0].system and child[0].system is not None
        assert child[0].arrival == parent[spawned_after].arrival + CHILD_START_S
        assert all(t.parent is None for t in child[1:])
        span = sum(t.gap for t in child) + PARAMS.child_turn_s * len(child)
        assert parent[spawned_after + 1].gap >= CHILD_START_S + span  # waits for it
    parents = [t for s, t in by_session.items() if t[0].parent is None]
    assert len(parents) == PARAMS.parents.sessions
