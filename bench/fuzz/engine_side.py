"""The engine side of ``kvrouter bench fuzz``: a router with a hostile engine in its fleet.

The router serves two models: the hostile engine's (``bench.fuzz.hostile_engine``) and a
simulated engine's. For each generated case (``bench.fuzz.engine_inputs``) the hostile
engine is told what to answer, which page its next scrapes get and which KV-event
messages to publish, and a client request for its model goes through the router.
Meanwhile normal traffic for the other model must keep getting 200s.

Properties of each answer to the hostile model: an HTTP answer came (never silence,
never a closed connection without a status); a status the engine did not send is the
router's own error, JSON in the API's shape, never a 500; a body cut short only where
the engine broke its own (its framing, its connection, an SSE event past the limit).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import orjson

from bench.fuzz.client import Answer, RawRequest, send, status_label, violation
from bench.fuzz.engine_inputs import EngineCase
from bench.fuzz.hostile_engine import case_marker
from bench.fuzz.hostile_process import HostileEngineProcess

HOSTILE_MODEL = "hostile-model"
# What may make the router cut a reply it had begun to pass on: the engine's own break.
BREAKS = frozenset({"framing", "connection", "sse", "body", "huge", "head"})
# A case hostile in none but these is an answer the router must pass on whole.
SOUND = frozenset({"usage", "slow"})
SHOWN = 20
_PATHS = {
    "chat": b"/v1/chat/completions",
    "completions": b"/v1/completions",
    "messages": b"/v1/messages",
    "responses": b"/v1/responses",
}


def hostile_request(case: EngineCase, api_key: str, number: int | None = None) -> RawRequest:
    """The client's request for the case: the API it names, streamed or not; with a
    ``number``, marked as that case's (``case_marker``)."""
    text = (case_marker(number) if number is not None else "") + "fuzz the engine side"
    body: dict[str, object] = {"model": HOSTILE_MODEL, "stream": case.stream}
    if case.api == "completions":
        body |= {"prompt": text, "max_tokens": 4}
    elif case.api == "messages":
        body |= {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
    elif case.api == "responses":
        body |= {"input": text, "store": False}
    else:
        body |= {"messages": [{"role": "user", "content": text}]}
    headers = (
        (b"Content-Type", b"application/json"),
        (b"Authorization", b"Bearer " + api_key.encode()),
    )
    return RawRequest(b"POST", _PATHS[case.api], headers, orjson.dumps(body))


def engine_violation(case: EngineCase, request: RawRequest, answer: Answer) -> str | None:
    """What is wrong with the router's answer to a request the hostile engine served."""
    if case.labels <= SOUND and case.reply.status == 200:
        if answer.status != 200 or answer.cut:
            return f"a sound 200 answered {answer.status}{' cut short' if answer.cut else ''}"
        return None
    if answer.status == case.reply.status and answer.status >= 400 and not answer.cut:
        return None  # the engine's own error, passed on
    if answer.cut and answer.status < 400:
        return None if case.labels & BREAKS else "a reply cut short that the engine sent whole"
    return violation(request, answer)


@dataclass(slots=True)
class EngineTally:
    statuses: Counter[str] = field(default_factory=Counter)
    violations: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    labels: Counter[str] = field(default_factory=Counter)

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())

    def record(self, case: EngineCase, answer: Answer, broken: str | None) -> None:
        self.statuses[status_label(answer)] += 1
        self.labels.update(case.labels or {"clean"})
        if broken is not None:
            self.violations[broken] += 1
            if len(self.examples) < SHOWN:
                self.examples.append(f"{broken}: {describe_case(case)}")


def describe_case(case: EngineCase, limit: int = 300) -> str:
    wire = b"".join(case.reply.pieces)
    return (
        f"{case.api} stream={case.stream} end={case.reply.end} labels={sorted(case.labels)} "
        f"reply[{len(wire)}]={wire[:limit]!r}"
    )


def play_numbered(
    engine: HostileEngineProcess,
    port: int,
    api_key: str,
    number: int,
    case: EngineCase,
    timeout_s: float,
) -> tuple[Answer, str | None]:
    """One case, from a driver's thread (one of several at once): set it, send its
    request, judge the answer."""
    engine.add_case(number, case)
    try:
        request = hostile_request(case, api_key, number)
        answer = send("127.0.0.1", port, request, timeout_s)
    finally:
        engine.drop_case(number)
    return answer, engine_violation(case, request, answer)
