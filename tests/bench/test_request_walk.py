"""``kvrouter bench walk``: the files one request visits in the router."""

from __future__ import annotations

from bench.cost.request_walk import Walk, walk_one


def test_visits_and_returns_are_counted_from_the_sequence() -> None:
    walk = Walk()
    for path in ("a", "a", "b", "c", "b", "a", "a"):
        walk.enter(path)
    assert walk.visits == ["a", "b", "c", "b", "a"]
    assert (walk.files, walk.returns) == (3, 2)


async def test_a_chat_request_is_traced_from_the_routers_front_through_a_policy() -> None:
    walk = await walk_one("chat", stream=False, compressed=False)
    # The request's bytes arrive at the front first: no engine ran router code before.
    assert walk.visits[0] == "router/edge/connection.py", walk.visits[:5]
    assert "router/edge/relay.py" in walk.visits and "router/routing/dispatch.py" in walk.visits
    assert any(path.startswith("policies/") for path in walk.visits)
