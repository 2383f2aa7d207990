"""The replay result: one record per request, run metadata, and the summary of a run.

All times are in *simulated* seconds: the simulated engine runs ``time_scale`` times
faster than real time, so the replay multiplies every measured wall-clock interval by
``time_scale`` to make the numbers read like a real engine's (``time_scale`` 1 against a
real engine leaves them as measured).

File layout (JSON)::

    {"schema": "kvrouter.replay/1",
     "meta": {target, trace, model, time_scale, concurrency, started_at, duration_s,
              api, time_unit},
     "summary": {...},        # for people and jq; loaders recompute it from the records
     "records": [{session, turn, start, ttft_s, latency_s, prompt_tokens, cached_tokens,
                  oracle_cached_tokens, completion_tokens, worker, error, status,
                  api, after, attempts, gave_up, retry_wait_s}, ...]}

``meta.api`` is the run's default API; each record's ``api`` the one that carried it
(records written before the field existed read as ``meta.api``). A run through more
than one API has its summary split by API too (``Summary.by_api``).

A turn *missed* the cache when it is not a session's first turn (turn > 0) and its
cached tokens are below ``MISS_FRACTION`` (half) of what the oracle (a perfect router
with unlimited cache, see ``bench.replay.oracle``) would have had cached. First turns
can only hit on prefixes other sessions share (system prompts), so they are counted on
their own and left out of the miss share.

A record's ``after`` is how the session's previous reply ended, as the trace has it
(``"tool"``: the turn carries a tool's result, sent as soon as the tool finished;
``"user"``: a person answered); None for first turns and traces that do not say. The
turns after a tool call are the ones an agent waits on: their TTFT has a figure of its
own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

SCHEMA = "kvrouter.replay/1"
TIME_UNIT = "simulated seconds (wall-clock seconds x time_scale)"
MISS_FRACTION = 0.5


@dataclass(frozen=True, slots=True)
class RequestRecord:
    session: str
    turn: int
    start: float  # since run start
    ttft_s: float | None  # None: no content chunk arrived
    latency_s: float  # to the end of the stream, or to the error
    prompt_tokens: int  # the server's usage; the local count when it sent none
    cached_tokens: int
    oracle_cached_tokens: int
    completion_tokens: int
    worker: str | None  # the x-kvrouter-worker response header
    error: str | None
    status: int  # HTTP status; 0 when no response arrived
    api: str = "chat"  # bench.workloads.api_bodies.Api: the API that carried the request
    after: str | None = None  # bench.workloads.trace.EndedBy of the session's previous turn
    attempts: int = 1  # sent this many times (retried after refusals)
    gave_up: bool = False  # refused after every retry: the session sent nothing more
    # From the first attempt to the one recorded: refusals and the waits after them.
    # ``ttft_s`` and ``latency_s`` include it, as the client felt them. None: not known
    # (a result written before it was kept).
    retry_wait_s: float | None = None

    @property
    def served_ttft_s(self) -> float | None:
        """The TTFT of the attempt that was served, from when it was sent: what the
        router and engine took once they accepted the request. None also when the turn
        was retried and its wait is not known."""
        if self.ttft_s is None:
            return None
        if self.retry_wait_s is None:
            return self.ttft_s if self.attempts == 1 else None
        return self.ttft_s - self.retry_wait_s

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class RunMeta:
    target: str
    trace: str
    model: str
    time_scale: float
    concurrency: int
    started_at: str  # ISO 8601, UTC
    duration_s: float  # simulated
    # bench.workloads.api_bodies.Api: the default, for sessions whose trace names none;
    # results written before it: chat
    api: str = "chat"
    # The TTFT a turn must meet to count towards goodput (simulated seconds); None: none.
    slo_ttft_s: float | None = None


@dataclass(frozen=True, slots=True)
class RunResult:
    meta: RunMeta
    records: tuple[RequestRecord, ...]


@dataclass(frozen=True, slots=True)
class TurnStats:
    turn: int
    requests: int
    hit_rate: float
    oracle_hit_rate: float


@dataclass(frozen=True, slots=True)
class ApiStats:
    api: str
    requests: int
    errors: int
    hit_rate: float  # token-weighted, successful requests only
    ttft_p50: float | None
    ttft_p99: float | None


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    oracle_cached_tokens: int
    completion_tokens: int
    hit_rate: float  # token-weighted, successful requests only
    oracle_hit_rate: float
    turn0_requests: int
    turn0_missed: int  # turn-0 requests under half the oracle (shared-prefix misses)
    later_requests: int  # successful turn > 0 requests
    missed_turns: int
    missed_share: float  # missed_turns / later_requests
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    missed_ttft_p50: float | None
    missed_ttft_p90: float | None
    missed_ttft_p99: float | None
    latency_p50: float | None
    latency_p99: float | None
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    by_turn: tuple[TurnStats, ...]
    # Load imbalance over the workers that served requests: the coefficient of
    # variation (standard deviation over mean) of their requests and of the tokens they
    # prefilled (prompt minus cached). None: fewer than two workers named.
    requests_cov: float | None = None
    prefill_cov: float | None = None
    # Per API, in order of first use; empty when the run used one API only.
    by_api: tuple[ApiStats, ...] = ()
    # With a TTFT objective: the share of turns that met it (a failed turn did not), the
    # turns a second that did, and the median over sessions of each one's share.
    slo_met_share: float | None = None
    goodput_per_s: float | None = None
    session_slo_met_median: float | None = None
    # Turns sent again after a refusal (beyond the first attempt), and sessions that gave
    # up after their retries (``ReplayConfig.retries``).
    retries: int = 0
    sessions_given_up: int = 0
    # Turns that carried a tool's result (the previous reply called it); None: none.
    after_tool_requests: int = 0
    after_tool_ttft_p50: float | None = None
    after_tool_ttft_p99: float | None = None
    # TTFT p99 of the attempts served, each from when it was sent (the client's retries
    # after refusals left out): the router's latency for the requests it admitted.
    served_ttft_p99: float | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation, as numpy's default."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def is_miss(record: RequestRecord) -> bool:
    """Fewer cached tokens than half the oracle's (any turn; callers split off turn 0)."""
    return record.cached_tokens < MISS_FRACTION * record.oracle_cached_tokens


def _by_turn(ok: Sequence[RequestRecord]) -> tuple[TurnStats, ...]:
    groups: dict[int, list[RequestRecord]] = {}
    for record in ok:
        groups.setdefault(record.turn, []).append(record)
    stats = []
    for turn in sorted(groups):
        group = groups[turn]
        prompt = sum(r.prompt_tokens for r in group)
        stats.append(
            TurnStats(
                turn=turn,
                requests=len(group),
                hit_rate=_ratio(sum(r.cached_tokens for r in group), prompt),
                oracle_hit_rate=_ratio(sum(r.oracle_cached_tokens for r in group), prompt),
            )
        )
    return tuple(stats)


def by_api(records: Sequence[RequestRecord]) -> tuple[ApiStats, ...]:
    """Requests, hit rate and TTFT per API, in order of first use."""
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        groups.setdefault(record.api, []).append(record)
    stats = []
    for api, group in groups.items():
        ok = [r for r in group if r.ok]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        stats.append(
            ApiStats(
                api=api,
                requests=len(group),
                errors=len(group) - len(ok),
                hit_rate=_ratio(sum(r.cached_tokens for r in ok), sum(r.prompt_tokens for r in ok)),
                ttft_p50=percentile(ttfts, 50),
                ttft_p99=percentile(ttfts, 99),
            )
        )
    return tuple(stats)


def coefficient_of_variation(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    if mean == 0:
        return None
    variance = sum((v - mean) ** 2 for v in values) / len(values)
    return float(variance**0.5 / mean)


def load_imbalance(records: Sequence[RequestRecord]) -> tuple[float | None, float | None]:
    """Coefficients of variation of requests and of prefilled tokens across workers."""
    requests: dict[str, float] = {}
    prefill: dict[str, float] = {}
    for r in records:
        if r.worker is None:
            continue
        requests[r.worker] = requests.get(r.worker, 0) + 1
        prefill[r.worker] = prefill.get(r.worker, 0) + max(0, r.prompt_tokens - r.cached_tokens)
    return (
        coefficient_of_variation(list(requests.values())),
        coefficient_of_variation(list(prefill.values())),
    )


def run_span(records: Sequence[RequestRecord]) -> float:
    """From the first request's start to the last one's end."""
    if not records:
        return 0.0
    return max(r.start + r.latency_s for r in records) - min(r.start for r in records)


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float | None = None,
    slo_ttft_s: float | None = None,
) -> Summary:
    """Summary of a run; throughput is over ``duration_s``, or the records' span; goodput
    counts the turns whose TTFT was within ``slo_ttft_s``."""
    ok = [r for r in records if r.ok]
    turn0 = [r for r in ok if r.turn == 0]
    later = [r for r in ok if r.turn > 0]
    missed = [r for r in later if is_miss(r)]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    missed_ttfts = [r.ttft_s for r in missed if r.ttft_s is not None]
    after_tool = [r for r in ok if r.after == "tool"]
    after_tool_ttfts = [r.ttft_s for r in after_tool if r.ttft_s is not None]
    latencies = [r.latency_s for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    oracle = sum(r.oracle_cached_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    duration = run_span(records) if duration_s is None else duration_s
    requests_cov, prefill_cov = load_imbalance(ok)
    apis = by_api(records)
    return Summary(
        requests=len(records),
        errors=len(records) - len(ok),
        prompt_tokens=prompt,
        cached_tokens=cached,
        oracle_cached_tokens=oracle,
        completion_tokens=completion,
        hit_rate=_ratio(cached, prompt),
        oracle_hit_rate=_ratio(oracle, prompt),
        turn0_requests=len(turn0),
        turn0_missed=sum(1 for r in turn0 if is_miss(r)),
        later_requests=len(later),
        missed_turns=len(missed),
        missed_share=_ratio(len(missed), len(later)),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        missed_ttft_p50=percentile(missed_ttfts, 50),
        missed_ttft_p90=percentile(missed_ttfts, 90),
        missed_ttft_p99=percentile(missed_ttfts, 99),
        latency_p50=percentile(latencies, 50),
        latency_p99=percentile(latencies, 99),
        duration_s=duration,
        requests_per_s=_ratio(len(ok), duration),
        output_tokens_per_s=_ratio(completion, duration),
        by_turn=_by_turn(ok),
        requests_cov=requests_cov,
        prefill_cov=prefill_cov,
        by_api=apis if len(apis) > 1 else (),
        **_goodput(records, duration, slo_ttft_s),
        retries=sum(r.attempts - 1 for r in records),
        sessions_given_up=len({r.session for r in records if r.gave_up}),
        after_tool_requests=len(after_tool),
        after_tool_ttft_p50=percentile(after_tool_ttfts, 50),
        after_tool_ttft_p99=percentile(after_tool_ttfts, 99),
        served_ttft_p99=percentile([t for r in ok if (t := r.served_ttft_s) is not None], 99),
    )


def _goodput(
    records: Sequence[RequestRecord], duration: float, slo_ttft_s: float | None
) -> dict[str, float | None]:
    """``Summary``'s goodput fields: every turn sent counts, and met the objective only if
    it succeeded with a first token within ``slo_ttft_s``."""
    if slo_ttft_s is None or not records:
        return {}
    met_by_session: dict[str, list[bool]] = {}
    for r in records:
        met = r.ok and r.ttft_s is not None and r.ttft_s <= slo_ttft_s
        met_by_session.setdefault(r.session, []).append(met)
    met_total = sum(sum(m) for m in met_by_session.values())
    shares = [sum(m) / len(m) for m in met_by_session.values()]
    return {
        "slo_met_share": met_total / len(records),
        "goodput_per_s": _ratio(met_total, duration),
        "session_slo_met_median": percentile(shares, 50),
    }


def result_to_json(result: RunResult) -> dict[str, Any]:
    meta = asdict(result.meta)
    meta["time_unit"] = TIME_UNIT
    summary = summarize(result.records, result.meta.duration_s, result.meta.slo_ttft_s)
    return {
        "schema": SCHEMA,
        "meta": meta,
        "summary": asdict(summary),
        "records": [asdict(r) for r in result.records],
    }


class ResultFormatError(ValueError):
    """A file that is not a replay result this version can read."""


def result_from_json(obj: Any, where: str = "result") -> RunResult:
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        raise ResultFormatError(f"{where}: not a {SCHEMA} result")
    try:
        meta_obj = {k: v for k, v in obj["meta"].items() if k != "time_unit"}
        meta = RunMeta(**meta_obj)
        records = tuple(RequestRecord(**{"api": meta.api, **r}) for r in obj["records"])
    except (KeyError, TypeError, AttributeError) as exc:
        raise ResultFormatError(f"{where}: {exc}") from exc
    return RunResult(meta, records)


def save_result(result: RunResult, path: Path) -> None:
    path.write_bytes(orjson.dumps(result_to_json(result), option=orjson.OPT_INDENT_2))


def load_result(path: Path) -> RunResult:
    try:
        obj = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise ResultFormatError(f"{path}: {exc}") from exc
    return result_from_json(obj, str(path))
