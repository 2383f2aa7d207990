"""Parse trace files in the Weka layout that aiperf 0.13 replays for InferenceX AgentX.

aiperf's ``inferencex-agentx-mvp`` scenario (``aiperf/common/scenario/
inferencex_agentx_mvp.py``) requires one of the ``semianalysis_cc_traces_weka*``,
``weka_trace`` or ``weka_hf`` loaders; all of them validate each trace as
``WekaTrace`` (``aiperf/dataset/loader/weka_trace_models.py``) and rebuild it with
``WekaTraceLoader`` (``weka_trace.py``). The Hugging Face corpora
(``semianalysisai/cc-traces-weka-*``) hold one trace a row; ``weka_trace`` reads a
``.json`` file or a directory of them. A trace is one recorded Claude Code session::

    {"id": str, "models": [str], "block_size": int, "hash_id_scope": "local",
     "tool_tokens": int, "system_tokens": int, "requests": [REQUEST | SUBAGENT, ...]}

    REQUEST   {"type": "n" | "s", "t": s, "model": str, "in": tokens, "out": tokens,
               "hash_ids": [int], "stop": "tool_use" | "end_turn" | "",
               "api_time": s | null, "think_time": s | null,
               "input_types": [str], "output_types": [str], "ttft": s ("s" only)}
    SUBAGENT  {"type": "subagent", "t": s, "agent_id": str, "subagent_type": str,
               "status": str, "duration_ms": ms | null, "requests": [REQUEST, ...],
               "models": [str], "tool_tokens": int, "system_tokens": int, ...}

``t`` is the request's start in seconds from the session's start (older captures
time a subagent's requests from its spawn; aiperf takes a request timed before its
subagent's ``t`` as relative, and so does this reader). ``hash_ids`` name the prompt's
``block_size``-token blocks from the start (each trace declares its size; aiperf's
default for these corpora is 64), a request's whole prompt, not only its new part;
``hash_id_scope: "local"`` (the only scope aiperf accepts; this reader also takes
``"global"``, ids shared across traces) means ids are shared within the trace, parent
and subagents alike, and mean nothing across traces.
``api_time`` is how long the server took; ``stop`` says whether the reply ended in a
tool call; ``input_types`` name the content blocks of the request's new input
(``"tool_result"`` among them when it answers a tool call). ``tool_tokens +
system_tokens`` is the declared prefix that aiperf sends as a system message. Fields
this reader does not use are ignored rather than rejected.

Besides the two layouts aiperf reads (one ``.json`` trace, a directory of them), a
``.jsonl`` file is read as one trace a line: the Hugging Face rows written out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from bench.workloads.trace import TraceFormatError

# A subagent request timed this far before its spawn is timed from the spawn (aiperf's
# _JOIN_EPSILON_SECONDS).
_RELATIVE_EPSILON_S = 1e-6

Scope = Literal["local", "global"]


@dataclass(frozen=True, slots=True)
class AgentxRequest:
    t: float  # start, seconds from the trace's start (subagents' on the same timeline)
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    stop: str
    api_time: float | None
    input_types: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AgentxSubagent:
    agent_id: str
    t: float
    prefix_tokens: int  # its declared tool_tokens + system_tokens
    requests: tuple[AgentxRequest, ...]


@dataclass(frozen=True, slots=True)
class AgentxTrace:
    id: str
    block_size: int
    scope: Scope
    prefix_tokens: int  # the declared tool_tokens + system_tokens
    requests: tuple[AgentxRequest, ...]  # the main agent's own calls
    subagents: tuple[AgentxSubagent, ...]


def _field(obj: dict[str, Any], name: str, where: str) -> Any:
    if name not in obj:
        raise TraceFormatError(f"{where}: missing field {name!r}")
    return obj[name]


def _count(value: Any, name: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceFormatError(f"{where}: {name!r} must be a non-negative integer")
    return value


def _seconds(value: Any, name: str, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TraceFormatError(f"{where}: {name!r} must be a number of seconds")
    return float(value)


def _request(obj: Any, spawned_at: float | None, where: str) -> AgentxRequest:
    if not isinstance(obj, dict) or obj.get("type") not in ("n", "s"):
        raise TraceFormatError(f"{where}: expected a request of type 'n' or 's'")
    t = _seconds(_field(obj, "t", where), "t", where)
    if spawned_at is not None and t + _RELATIVE_EPSILON_S < spawned_at:
        t += spawned_at
    hash_ids = obj.get("hash_ids", [])
    types = obj.get("input_types", [])
    api_time = obj.get("api_time")
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) for h in hash_ids):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of integers")
    if not isinstance(types, list) or not all(isinstance(k, str) for k in types):
        raise TraceFormatError(f"{where}: 'input_types' must be a list of strings")
    return AgentxRequest(
        t=t,
        input_tokens=_count(_field(obj, "in", where), "in", where),
        output_tokens=_count(_field(obj, "out", where), "out", where),
        hash_ids=tuple(hash_ids),
        stop=str(obj.get("stop") or ""),
        api_time=None if api_time is None else _seconds(api_time, "api_time", where),
        input_types=tuple(types),
    )


def _prefix_tokens(obj: dict[str, Any], where: str) -> int:
    return sum(_count(obj.get(name, 0), name, where) for name in ("tool_tokens", "system_tokens"))


def _subagent(obj: dict[str, Any], where: str) -> AgentxSubagent:
    t = _seconds(_field(obj, "t", where), "t", where)
    inner = _field(obj, "requests", where)
    if not isinstance(inner, list):
        raise TraceFormatError(f"{where}: 'requests' must be a list")
    return AgentxSubagent(
        agent_id=str(_field(obj, "agent_id", where)),
        t=t,
        prefix_tokens=_prefix_tokens(obj, where),
        requests=tuple(_request(r, t, f"{where}.requests[{i}]") for i, r in enumerate(inner)),
    )


def trace_from_json(obj: Any, where: str) -> AgentxTrace:
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    block_size = _count(_field(obj, "block_size", where), "block_size", where)
    scope = obj.get("hash_id_scope", "local")
    if block_size < 1:
        raise TraceFormatError(f"{where}: 'block_size' must be positive")
    if scope not in ("local", "global"):
        raise TraceFormatError(f"{where}: unknown hash_id_scope {scope!r}")
    entries = _field(obj, "requests", where)
    if not isinstance(entries, list):
        raise TraceFormatError(f"{where}: 'requests' must be a list")
    requests: list[AgentxRequest] = []
    subagents: list[AgentxSubagent] = []
    for i, entry in enumerate(entries):
        at = f"{where}.requests[{i}]"
        if isinstance(entry, dict) and entry.get("type") == "subagent":
            subagents.append(_subagent(entry, at))
        else:
            requests.append(_request(entry, None, at))
    return AgentxTrace(
        id=str(_field(obj, "id", where)),
        block_size=block_size,
        scope="global" if scope == "global" else "local",
        prefix_tokens=_prefix_tokens(obj, where),
        requests=tuple(requests),
        subagents=tuple(subagents),
    )


def _load_json(data: bytes, where: str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: {exc}") from exc


def read_traces(path: Path) -> list[AgentxTrace]:
    """The traces at ``path`` (a ``.json`` trace, a directory of them, or a ``.jsonl``
    of one trace a line), in file order (directories: sorted by name)."""
    traces: list[AgentxTrace] = []
    if path.is_dir():
        for file in sorted(path.glob("*.json")):
            traces.append(trace_from_json(_load_json(file.read_bytes(), str(file)), str(file)))
    elif path.suffix == ".jsonl":
        with path.open("rb") as src:
            for lineno, line in enumerate(src, 1):
                if line.strip():
                    where = f"{path}:{lineno}"
                    traces.append(trace_from_json(_load_json(line, where), where))
    else:
        traces.append(trace_from_json(_load_json(path.read_bytes(), str(path)), str(path)))
    ids = [trace.id for trace in traces]
    if len(set(ids)) != len(ids):
        raise TraceFormatError(f"{path}: a trace id appears twice; ids name sessions")
    return traces
