"""``kvrouter bench rescore DIR``: a matrix's figures again, from the runs it saved.

Every figure but the capacity reference comes from a run's own records; the reference is
computed from the trace and those records (``bench.replay.reference``). When the
reference's definition changes, a finished matrix (hours of real-clock runs beside the
peer routers) need not be run again: each row directory holds every round's trace
(``trace.rN.jsonl``) and every router's records (``<router>.rN.json``), and this rebuilds
``matrix.json``, ``matrix.md`` and the plots from them with the current code.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import orjson

from bench.compare.demo import DEFAULT_ENGINES, DEFAULT_KV_TOKENS
from bench.compare.matrix import rows, write_outputs
from bench.replay.reference import ReferenceParams, capacity_reference
from bench.replay.result import load_result
from bench.replay.rounds import Rounds, ScoredRun
from bench.workloads.trace import read_trace

RUN_FILE = re.compile(r"(?P<label>.+)\.r(?P<round>\d+)\.json")


def rescore_row(directory: Path, params: ReferenceParams) -> Rounds:
    """Every ``<router>.rN.json`` in ``directory``, scored against ``trace.rN.jsonl``;
    routers in the order of the row's ``rounds.json`` (the order they ran in)."""
    found: dict[str, dict[int, Path]] = {}
    for path in directory.glob("*.r*.json"):
        match = RUN_FILE.fullmatch(path.name)
        if match:
            found.setdefault(match["label"], {})[int(match["round"])] = path
    listed = orjson.loads((directory / "rounds.json").read_bytes())
    rounds = Rounds()
    for label in [name for name in listed if name in found]:
        for round_number, path in sorted(found[label].items()):
            turns = read_trace(directory / f"trace.r{round_number}.jsonl")
            result = load_result(path)
            reference = capacity_reference(turns, result.records, params)
            rounds.add(label, ScoredRun.of(result, reference.hit_rate))
    return rounds


def rescore(out: Path, engines: int, kv_tokens: int = DEFAULT_KV_TOKENS) -> dict[str, Rounds]:
    """Every matrix row directory in ``out``; ``kv_tokens`` for the rows without their own
    (the matrix's ``--kv-tokens``)."""
    present = {d.name for d in out.iterdir() if d.is_dir()}
    order = [row for row in rows() if row.name in present]
    results = {
        row.name: rescore_row(out / row.name, ReferenceParams(engines, row.kv_tokens or kv_tokens))
        for row in order
    }
    write_outputs(out, results, order)
    return results


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser(
        "rescore", help="rebuild a matrix's figures from its saved runs", description=__doc__
    )
    parser.add_argument("out", type=Path, help="the matrix's --out directory")
    parser.add_argument(
        "--engines", type=int, default=DEFAULT_ENGINES, help="engines the matrix ran with"
    )
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=DEFAULT_KV_TOKENS,
        help="KV tokens per engine the matrix ran with (rows without their own)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    results = rescore(args.out, args.engines, args.kv_tokens)
    print((args.out / "matrix.md").read_text(), end="")
    return 0 if results else 1
