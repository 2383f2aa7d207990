"""The reader of aiperf's ``synthesize agentic-code`` output, on a real sample and by hand."""

from __future__ import annotations

import argparse
import math
from itertools import pairwise
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.compare.demo import DemoConfig
from bench.compare.matrix import AIPERF_AGENTIC_SAMPLE
from bench.compare.matrix import rows as matrix_rows
from bench.workloads import aiperf_agentic
from bench.workloads import cli as workloads_cli
from bench.workloads.sampling import poisson_arrivals
from bench.workloads.trace import (
    Session,
    TextBlock,
    TraceFormatError,
    group_sessions,
    read_trace,
    render_text,
    text_tokens,
)

SAMPLE = Path(__file__).parent / "data" / "aiperf_agentic"
CHARS_PER_TOKEN = 4  # bench.textgen's words


def _raw_sessions(dataset: Path = SAMPLE / "dataset.jsonl") -> dict[str, list[dict[str, Any]]]:
    sessions: dict[str, list[dict[str, Any]]] = {}
    for line in dataset.read_bytes().splitlines():
        row = orjson.loads(line)
        sessions.setdefault(row["session_id"], []).append(row)
    return sessions


def _cache_layers() -> tuple[int, int, int]:
    """(block size, L1 blocks, L1.5 blocks) from the sample's manifest."""
    params = orjson.loads((SAMPLE / "manifest.json").read_bytes())["generation_params"]
    block = params["block_size"]
    cache = params["cache"]
    l1 = math.ceil(cache["layer1_tokens"] / block)
    return block, l1, math.ceil(cache["layer1_5_tokens"] / block)


def _sample_sessions(**params: Any) -> dict[str, Session]:
    turns = aiperf_agentic.load(
        SAMPLE / "dataset.jsonl", aiperf_agentic.AiperfAgenticParams(**params), seed=3
    )
    return {s.id: s for s in group_sessions(turns)}


def _first_text(session: Session) -> str:
    return render_text(session.turns[0].user)


def _shared_chars(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_the_sample_keeps_every_row_length_and_delay() -> None:
    raw = _raw_sessions()
    sessions = _sample_sessions()
    assert list(sessions) != [] and set(sessions) == set(raw)
    for sid, rows in raw.items():
        turns = sessions[sid].turns
        assert [text_tokens(t.user) for t in turns] == [r["input_length"] for r in rows]
        assert [t.output_tokens for t in turns] == [r["output_length"] for r in rows]
        assert [t.gap for t in turns] == [0.0] + [r["delay"] / 1000 for r in rows[1:]]
        first = turns[0].user
        assert isinstance(first, tuple)
        assert [b.key for b in first] == [f"aiperf-{h}" for h in rows[0]["hash_ids"]]
        for before, turn in pairwise(turns):
            assert turn.arrival == pytest.approx(before.arrival + turn.gap)
        assert all(t.ended_by is None and t.parent is None for t in turns)


def test_sessions_start_in_file_order_as_a_poisson_process() -> None:
    order = list(_raw_sessions())
    starts = poisson_arrivals(3, aiperf_agentic.KIND, 0.5, len(order))
    sessions = _sample_sessions(rate=0.5)
    assert [sessions[sid].arrival for sid in order] == starts
    assert starts[0] == 0.0 and starts == sorted(starts) and starts[-1] > 0


def _restart_and_origin(raw: dict[str, list[dict[str, Any]]]) -> tuple[str, str]:
    """The restart continuation and the session whose turn 0 its own starts with."""
    (restart,) = [sid for sid, rows in raw.items() if rows[0].get("is_restart")]
    ids = raw[restart][0]["hash_ids"]
    origin = next(
        sid
        for sid, rows in raw.items()
        if sid != restart and ids[: len(rows[0]["hash_ids"])] == rows[0]["hash_ids"]
    )
    return restart, origin


def test_the_cache_layers_become_shared_prefixes() -> None:
    raw = _raw_sessions()
    sessions = _sample_sessions()
    block, l1, l15 = _cache_layers()
    groups = {sid: rows[0]["group_id"] for sid, rows in raw.items()}
    assert len(set(groups.values())) == 2  # the sample has both groups
    related = set(_restart_and_origin(raw))
    ids = list(raw)
    pairs = [(a, b) for i, a in enumerate(ids) for b in ids[i + 1 :] if {a, b} != related]
    assert len(pairs) == len(ids) * (len(ids) - 1) // 2 - 1
    for a, b in pairs:
        shared = _shared_chars(_first_text(sessions[a]), _first_text(sessions[b]))
        # L1 is everyone's, L1.5 only a group's; fresh text after it may agree on a
        # word or two by chance, never on a whole block.
        expected = l1 + l15 if groups[a] == groups[b] else l1
        assert shared // (block * CHARS_PER_TOKEN) == expected, (a, b)


def test_a_restart_continuation_starts_with_the_earlier_sessions_turn_0() -> None:
    raw = _raw_sessions()
    sessions = _sample_sessions()
    restart, origin = _restart_and_origin(raw)
    assert raw[restart][0]["group_id"] == raw[origin][0]["group_id"]
    assert len(raw[restart][0]["hash_ids"]) > len(raw[origin][0]["hash_ids"])
    assert _first_text(sessions[restart]).startswith(_first_text(sessions[origin]))


def _row(sid: str, length: int, output: int, ids: list[int]) -> dict[str, Any]:
    return {"session_id": sid, "input_length": length, "output_length": output, "hash_ids": ids}


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def test_hand_written_rows_with_another_block_size(tmp_path: Path) -> None:
    rows = [
        {**_row("a", 150, 10, [0, 1, 2]), "timestamp": 0.0, "group_id": 0},
        {**_row("b", 100, 20, [0, 1]), "timestamp": 0.0, "group_id": 0},
        {**_row("a", 64, 30, [7]), "delay": 2500.0},
        {**_row("a", 65, 0, [8, 9]), "delay": 0},
    ]
    path = _write(tmp_path / "d.jsonl", rows)
    params = aiperf_agentic.AiperfAgenticParams(block_tokens=64)
    sessions = {s.id: s for s in group_sessions(aiperf_agentic.load(path, params))}
    a = sessions["a"].turns
    assert a[0].user == (
        TextBlock("aiperf-0", 64),
        TextBlock("aiperf-1", 64),
        TextBlock("aiperf-2", 22),
    )
    assert a[1].user == (TextBlock("aiperf-7", 64),) and a[1].gap == 2.5
    assert a[2].user == (TextBlock("aiperf-8", 64), TextBlock("aiperf-9", 1))
    assert a[2].output_tokens == 1  # a reply of 0 tokens cannot be asked for
    assert sessions["b"].turns[0].user == (TextBlock("aiperf-0", 64), TextBlock("aiperf-1", 36))
    # The 512-token default does not fit these rows.
    with pytest.raises(TraceFormatError, match="block"):
        aiperf_agentic.load(path, aiperf_agentic.AiperfAgenticParams())


def test_max_sessions_and_max_context_cut_the_trace(tmp_path: Path) -> None:
    rows = [
        _row("a", 1000, 100, [0, 1]),
        {**_row("a", 400, 100, [2]), "delay": 1000},
        {**_row("a", 400, 100, [3]), "delay": 1000},
        _row("b", 3000, 10, [0, 4, 5, 6, 7, 8]),
        _row("c", 10, 10, [9]),
    ]
    path = _write(tmp_path / "d.jsonl", rows)
    cut = aiperf_agentic.AiperfAgenticParams(max_context_tokens=2000)
    kept = aiperf_agentic.load(path, cut)
    # a: 1000+100, +400+100 = 1600, +400 passes 2000 with its reply; b's turn 0 passes.
    assert [(t.session, t.turn) for t in kept] == [("a", 0), ("a", 1), ("c", 0)]
    first_two = aiperf_agentic.load(path, aiperf_agentic.AiperfAgenticParams(max_sessions=2))
    assert sorted({t.session for t in first_two}) == ["a", "b"]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (_row("a", 1000, 10, [0]), "hash_ids"),
        ({"session_id": "a", "input_length": 10, "hash_ids": [0]}, "output_length"),
        ({**_row("a", 10, 10, [0]), "delay": -5}, "negative delay"),
        (_row("a", 0, 10, []), "hash_ids"),
    ],
)
def test_malformed_rows_are_refused(tmp_path: Path, row: dict[str, Any], message: str) -> None:
    path = _write(tmp_path / "d.jsonl", [row])
    with pytest.raises(TraceFormatError, match=message):
        aiperf_agentic.load(path, aiperf_agentic.AiperfAgenticParams())


def test_kvrouter_bench_gen_reads_the_sample(tmp_path: Path) -> None:
    out = tmp_path / "trace.jsonl"
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="bench_command")
    workloads_cli.register(sub)
    argv = ["gen", aiperf_agentic.KIND, "--source", str(SAMPLE / "dataset.jsonl")]
    args = parser.parse_args([*argv, "--rate", "1", "-o", str(out)])
    assert args.func(args) == 0
    written = read_trace(out)
    assert len(written) == sum(len(rows) for rows in _raw_sessions().values())
    assert {t.session for t in written} == set(_raw_sessions())


def test_the_matrix_row_replays_the_committed_sessions() -> None:
    row = {r.name: r for r in matrix_rows()}["aiperf-agentic"]
    turns = row.workload(DemoConfig(seed=5))
    committed = _raw_sessions(AIPERF_AGENTIC_SAMPLE)
    assert len(committed) == 24
    assert {t.session for t in turns} == set(committed)
    assert "agentx" not in {r.name for r in matrix_rows()}  # no trace given, no row
