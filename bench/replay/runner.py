"""Replay a trace: sessions arrive open-loop, turns within a session are closed-loop.

Timing. Session *i* starts ``(arrival_i - arrival_0) / time_scale`` wall seconds after
the run starts (the first selected session starts at once). Turn *k+1* of a session is
sent ``gap / time_scale`` seconds after turn *k*'s response ended. At most
``concurrency`` requests are in flight; a request waiting for a slot is not yet sent, so
its TTFT does not include that wait. Recorded times are multiplied back by
``time_scale`` (simulated seconds, see ``bench.replay.result``).

Failures. A failed request is recorded and the session goes on with its next turn; the
failed turn is left out of the conversation (see ``Conversation``), so later turns still
extend the prefix the engine may hold. With ``retries``, a turn refused before its first
token (408, 409, 429, 5xx or no answer, as the OpenAI and Anthropic SDKs retry) is sent
again up to that many times, after the wait it asks for (``retry-after-ms``, else
``Retry-After``; taken up to 60 s) or else 0.5 s doubling to 8 s less up to a quarter
at random (simulated seconds), without holding a slot meanwhile; its record's times run
from the first attempt. A session whose turn is still refused after them gives up: its
later turns are not sent (``gave_up``).

APIs. A session whose trace names an API (``Turn.api`` on its turn 0) is replayed
through it; the others through ``ReplayConfig.api``, the run's default. Each record
says which API carried its request.

Duration. With ``duration_s`` (simulated seconds from the first arrival), sessions that
arrive later are not replayed and no new turn starts after it; requests in flight finish.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from bench.replay.api_streams import StreamOutcome
from bench.replay.client import (
    DEFAULT_REQUEST_TIMEOUT_S,
    Assign,
    ChatClient,
    discover_model,
    open_http_session,
)
from bench.replay.conversation import Conversation, tokenize_prompt, tokenize_reply
from bench.replay.oracle import PrefixOracle
from bench.replay.result import RequestRecord, RunMeta, RunResult
from bench.tokenizer import num_tokens
from bench.workloads.api_bodies import APIS, DEFAULT_API, Api, ChatRequest
from bench.workloads.trace import EndedBy, Session, Turn, group_sessions
from router.clock import monotonic
from router.wire.blocks import DEFAULT_BLOCK_TOKENS

DEFAULT_CONCURRENCY = 64
DEFAULT_TIME_SCALE = 1.0

RecordSink = Callable[[RequestRecord], None]


# The OpenAI and Anthropic SDKs' retry timing: the wait a refusal asks for is taken as it
# is (here up to a minute, which is all kvrouter asks; the SDKs take longer ones too);
# otherwise half a second, doubling to at most 8 s.
MAX_RETRY_AFTER_S = 60.0
INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    target: str
    trace: Path
    model: str | None = None  # None: the first model the target lists
    # Further router replicas; each request goes to one of all targets, at random or
    # to each in turn.
    more_targets: tuple[str, ...] = ()
    assign: Assign = "random"
    concurrency: int = DEFAULT_CONCURRENCY
    time_scale: float = DEFAULT_TIME_SCALE
    max_sessions: int | None = None
    duration_s: float | None = None  # simulated seconds
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S  # wall seconds
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    # The API of sessions whose trace names none (bench.workloads.api_bodies).
    api: Api = DEFAULT_API
    slo_ttft_s: float | None = None  # the TTFT objective goodput counts against
    retries: int = 0  # a refused turn is sent again this many times (the SDKs': 2)

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str]] = [
            (self.target.startswith(("http://", "https://")), "target must be an http(s) URL"),
            (self.concurrency >= 1, "concurrency must be >= 1"),
            (self.time_scale > 0, "time_scale must be > 0"),
            (self.max_sessions is None or self.max_sessions >= 1, "max_sessions must be >= 1"),
            (self.duration_s is None or self.duration_s > 0, "duration must be > 0"),
            (self.request_timeout_s > 0, "request_timeout must be > 0"),
            (self.block_tokens >= 1, "block_tokens must be >= 1"),
            (self.api in APIS, f"api must be one of {', '.join(APIS)}"),
            (self.slo_ttft_s is None or self.slo_ttft_s > 0, "slo_ttft must be > 0"),
            (self.retries >= 0, "retries must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def select_sessions(
    turns: Sequence[Turn], max_sessions: int | None = None, duration_s: float | None = None
) -> list[Session]:
    """The sessions a run replays, by arrival: the first ``max_sessions`` of those that
    arrive within ``duration_s`` of the first."""
    sessions = group_sessions(turns)
    if duration_s is not None and sessions:
        first = sessions[0].arrival
        sessions = [s for s in sessions if s.arrival - first < duration_s]
    return sessions[:max_sessions] if max_sessions is not None else sessions


class _Run:
    """The state of one replay: the clock, the in-flight bound, the oracle, the records."""

    def __init__(self, config: ReplayConfig, client: ChatClient, sink: RecordSink | None) -> None:
        self._config = config
        self._scale = config.time_scale
        self._rng = random.Random(0)  # the backoff's jitter, the same every run
        self._client = client
        self._default_api = config.api
        self._sink = sink
        self._slots = asyncio.Semaphore(config.concurrency)
        self._oracle = PrefixOracle(config.block_tokens)
        self._deadline = (
            None if config.duration_s is None else config.duration_s / config.time_scale
        )
        self._t0 = monotonic()
        self.records: list[RequestRecord] = []

    def elapsed(self) -> float:
        """Wall seconds since the run started."""
        return monotonic() - self._t0

    def _past_deadline(self) -> bool:
        return self._deadline is not None and self.elapsed() >= self._deadline

    async def launch(self, sessions: Sequence[Session]) -> None:
        if not sessions:
            return
        first = sessions[0].arrival
        async with asyncio.TaskGroup() as group:
            for session in sessions:
                delay = (session.arrival - first) / self._scale - self.elapsed()
                if delay > 0:
                    await asyncio.sleep(delay)
                group.create_task(self._session(session))

    async def _session(self, session: Session) -> None:
        conversation = Conversation(session.turns[0].system)
        api = session.turns[0].api or self._default_api
        parent = session.turns[0].parent
        tools = api == "chat" and any(t.ended_by == "tool" for t in session.turns)
        after: EndedBy | None = None  # how the previous turn's reply ended
        for turn in session.turns:
            if turn.turn > 0 and turn.gap > 0:
                await asyncio.sleep(turn.gap / self._scale)
            if self._past_deadline():
                return
            request = ChatRequest(
                turn.session,
                conversation.request(turn),
                turn.output_tokens,
                api,
                parent,
                tools=tools,
                calls_tool=tools and turn.ended_by == "tool",
            )
            if not await self._turn(turn, conversation, request, after):
                return  # refused after every retry: the session gives up
            after = turn.ended_by

    async def _turn(
        self,
        turn: Turn,
        conversation: Conversation,
        request: ChatRequest,
        after: EndedBy | None = None,
    ) -> bool:
        """Send one turn (again, while it is refused and retries are left) and record
        it; False: the session gives up."""
        messages = request.messages
        prompt = tokenize_prompt(messages)
        async with self._slots:
            # The oracle sees requests in the order they are sent.
            oracle_hit = self._oracle.hit_tokens(prompt)
            self._oracle.observe_prompt(prompt)
            start = sent = self.elapsed()
            outcome = await self._client.stream_chat(request)
        attempts = 1
        while _refused(outcome) and attempts <= self._config.retries:
            await asyncio.sleep(self._backoff(outcome, attempts))
            async with self._slots:
                sent = self.elapsed()
                outcome = await self._client.stream_chat(request)
            attempts += 1
        gave_up = self._config.retries > 0 and _refused(outcome)
        waited = sent - start  # wall seconds before the last attempt went out
        if outcome.error is None:
            conversation.commit(messages, outcome.reply, outcome.tool_call)
            generated = tokenize_reply(outcome.reply, outcome.tool_call)
            self._oracle.observe_completion(prompt, generated)
        s = self._scale
        record = RequestRecord(
            session=turn.session,
            turn=turn.turn,
            start=start * s,
            ttft_s=None if outcome.ttft_s is None else (outcome.ttft_s + waited) * s,
            latency_s=(outcome.latency_s + waited) * s,
            prompt_tokens=(
                num_tokens(prompt) if outcome.prompt_tokens is None else outcome.prompt_tokens
            ),
            cached_tokens=outcome.cached_tokens,
            oracle_cached_tokens=oracle_hit,
            completion_tokens=outcome.completion_tokens,
            worker=outcome.worker,
            error=outcome.error,
            status=outcome.status,
            api=request.api or self._default_api,
            after=after,
            attempts=attempts,
            gave_up=gave_up,
            retry_wait_s=waited * s,
        )
        self.records.append(record)
        if self._sink is not None:
            self._sink(record)
        return not gave_up

    def _backoff(self, outcome: StreamOutcome, attempts: int) -> float:
        """Wall seconds before attempt ``attempts + 1``, as the SDKs wait."""
        after = outcome.retry_after_s
        if after is not None and 0 < after <= MAX_RETRY_AFTER_S:
            return after
        backoff: float = min(INITIAL_BACKOFF_S * 2.0 ** (attempts - 1), MAX_BACKOFF_S)
        return backoff * (1 - 0.25 * self._rng.random()) / self._scale


def _refused(outcome: StreamOutcome) -> bool:
    """Refused before a first token, as the SDKs retry: 408, 409, 429, 5xx, no answer."""
    if outcome.error is None or outcome.ttft_s is not None:
        return False
    status = outcome.status
    return status in (0, 408, 409, 429) or status >= 500


async def replay(
    config: ReplayConfig, sessions: Sequence[Session], sink: RecordSink | None = None
) -> RunResult:
    """Replay ``sessions`` against ``config.target``; ``sink`` sees each record as it ends."""
    target = config.target.rstrip("/")
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    async with open_http_session(config.concurrency, config.request_timeout_s) as http:
        model = config.model or await discover_model(http, target)
        client = ChatClient(
            http, target, model, config.more_targets, assign=config.assign, api=config.api
        )
        run = _Run(config, client, sink)
        await run.launch(sessions)
        duration = run.elapsed() * config.time_scale
    records = sorted(run.records, key=lambda r: (r.start, r.session, r.turn))
    meta = RunMeta(
        target=target,
        trace=str(config.trace),
        model=model,
        time_scale=config.time_scale,
        concurrency=config.concurrency,
        started_at=started_at,
        duration_s=duration,
        api=config.api,
        slo_ttft_s=config.slo_ttft_s,
    )
    return RunResult(meta, tuple(records))
