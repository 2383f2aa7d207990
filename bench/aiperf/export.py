"""What aiperf measured, read from its artifact directory.

``profile_export.jsonl``: one line per request, ``{"metadata", "metrics", "error"}``;
metadata names the conversation (the dataset's ``session_id``), the turn and the
``x_correlation_id`` sent with it; each metric is ``{"value", "unit"}``, TTFT in ms,
token counts from the server's usage (``--use-server-token-count``).
``profile_export_aiperf.json``: the run's summary, each metric with ``avg``, ``p50``,
``p90``, ``p99``, ``count``, ... and its ``unit``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

RECORDS = "profile_export.jsonl"
SUMMARY = "profile_export_aiperf.json"
TTFT = "time_to_first_token"


@dataclass(frozen=True, slots=True)
class AiperfRecord:
    """One request as aiperf saw it."""

    conversation: str
    turn: int
    correlation_id: str  # sent as X-Correlation-ID and X-Session-Affinity
    ttft_ms: float | None
    prompt_tokens: int | None
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens
    error: str | None


@dataclass(frozen=True, slots=True)
class TtftPercentiles:
    """aiperf's own TTFT summary over the run's requests, in milliseconds."""

    p50_ms: float
    p90_ms: float
    p99_ms: float
    count: int


def _value(metrics: dict[str, Any], name: str) -> Any:
    metric = metrics.get(name)
    return None if metric is None else metric.get("value")


def _count(metrics: dict[str, Any], name: str) -> int | None:
    value = _value(metrics, name)
    return None if value is None else int(value)


def record(line: dict[str, Any]) -> AiperfRecord:
    metadata, metrics = line["metadata"], line.get("metrics") or {}
    ttft = _value(metrics, TTFT)
    if ttft is not None and metrics[TTFT].get("unit") != "ms":
        raise ValueError(f"aiperf's TTFT in {metrics[TTFT].get('unit')!r}, not ms")
    error = line.get("error")
    return AiperfRecord(
        conversation=str(metadata["conversation_id"]),
        turn=int(metadata["turn_index"]),
        correlation_id=str(metadata["x_correlation_id"]),
        ttft_ms=None if ttft is None else float(ttft),
        prompt_tokens=_count(metrics, "usage_prompt_tokens"),
        cached_tokens=_count(metrics, "usage_prompt_cache_read_tokens"),
        error=None if error is None else str(error.get("message") or error),
    )


def read_records(artifact_dir: Path) -> list[AiperfRecord]:
    lines = (artifact_dir / RECORDS).read_bytes().splitlines()
    return [record(orjson.loads(line)) for line in lines if line.strip()]


def read_ttft(artifact_dir: Path) -> TtftPercentiles:
    summary = orjson.loads((artifact_dir / SUMMARY).read_bytes())
    ttft = summary.get(TTFT)
    if ttft is None:
        raise ValueError(f"{artifact_dir / SUMMARY} has no TTFT: no request streamed a token")
    if ttft.get("unit") != "ms":
        raise ValueError(f"aiperf's TTFT in {ttft.get('unit')!r}, not ms")
    return TtftPercentiles(
        float(ttft["p50"]), float(ttft["p90"]), float(ttft["p99"]), int(ttft["count"])
    )
