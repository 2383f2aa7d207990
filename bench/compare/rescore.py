"""``kvrouter bench rescore DIR``: a matrix's figures again, from the runs it saved.

Every figure comes from a run's own records but the capacity reference, computed from
the trace and those records (``bench.replay.reference``), and what was read from the
routers after the run (the queue's sheds and waits: ``<router>.rN.extras.json``, kept as
read). When the reference's definition changes, a finished matrix (hours of real-clock
runs beside the peer routers) need not be run again: each row directory holds every
round's trace (``trace.rN.jsonl``) and every router's records (``<router>.rN.json``), and
this rebuilds ``matrix.json``, ``matrix.md`` and the plots from them with the current
code. Rows run at several offered loads (``--load``) are rescored load by load, and
``--slo-ttft`` scores goodput against another first-token objective than the one the
runs were made with (the same turns, read against a looser or a tighter target), written
``--into`` another directory so that the matrix's own figures stay.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from bench.compare.demo import DEFAULT_ENGINES, DEFAULT_KV_TOKENS, extras_path
from bench.compare.matrix import rows, write_outputs
from bench.compare.offered_load import load_label, loads_written
from bench.replay.reference import ReferenceParams, capacity_reference
from bench.replay.result import load_result
from bench.replay.rounds import Rounds, ScoredRun
from bench.workloads.trace import read_trace

RUN_FILE = re.compile(r"(?P<label>.+)\.r(?P<round>\d+)\.json")


def rescore_row(
    directory: Path, params: ReferenceParams, slo_ttft_s: float | None = None
) -> Rounds:
    """Every ``<router>.rN.json`` in ``directory``, scored against ``trace.rN.jsonl``
    (goodput against ``slo_ttft_s`` if given, else the runs' own); routers in the order
    of the row's ``rounds.json`` (the order they ran in)."""
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
            if slo_ttft_s is not None:
                result = replace(result, meta=replace(result.meta, slo_ttft_s=slo_ttft_s))
            reference = capacity_reference(turns, result.records, params)
            rounds.add(label, ScoredRun.of(result, reference.hit_rate, _extras(path)))
    return rounds


def _extras(run_path: Path) -> dict[str, float]:
    """What was read from the router after the run (none: a run saved without them)."""
    path = extras_path(run_path)
    if not path.exists():
        print(f"{run_path}: no {path.name}; the routers' figures are left out", file=sys.stderr)
        return {}
    saved = json.loads(path.read_text())  # the standard library's: inf and nan as written
    return {key: float(value) for key, value in saved.items()}


def rescore(
    out: Path,
    engines: int,
    kv_tokens: int = DEFAULT_KV_TOKENS,
    slo_ttft_s: float | None = None,
    into: Path | None = None,
) -> dict[str, Rounds]:
    """Every matrix row directory in ``out`` (a row run at offered loads: each load's);
    ``kv_tokens`` for the rows without their own (the matrix's ``--kv-tokens``). The
    figures are written to ``into`` (default ``out``)."""
    present = {d.name for d in out.iterdir() if d.is_dir()}
    order = [row for row in rows() if row.name in present]
    results: dict[str, Rounds] = {}
    for row in order:
        params = ReferenceParams(engines, row.kv_tokens or kv_tokens)
        at_loads = loads_written(out / row.name)
        if not at_loads:
            results[row.name] = rescore_row(out / row.name, params, slo_ttft_s)
        for load, directory in at_loads:
            if not (directory / "rounds.json").exists():
                print(f"{directory}: no rounds.json (a run cut short?); left out", file=sys.stderr)
                continue
            results[load_label(row.name, load)] = rescore_row(directory, params, slo_ttft_s)
    write_outputs(into or out, results, order)
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
    parser.add_argument(
        "--slo-ttft",
        type=_objective,
        default=None,
        dest="slo_ttft_s",
        metavar="SECS",
        help="score goodput against this TTFT objective (simulated seconds) instead of the "
        "runs' own (needs --into); the figures read from the routers (the queue's sheds and "
        "waits) are the runs' as they were",
    )
    parser.add_argument(
        "--into",
        type=Path,
        default=None,
        help="write matrix.json, matrix.md and the plots here instead of the matrix's "
        "directory (keeps its own figures)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.slo_ttft_s is not None and args.into is None:
        print(
            "--slo-ttft needs --into: the matrix's own figures are for its own objective",
            file=sys.stderr,
        )
        return 2
    results = rescore(args.out, args.engines, args.kv_tokens, args.slo_ttft_s, args.into)
    print(((args.into or args.out) / "matrix.md").read_text(), end="")
    return 0 if results else 1


def _objective(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError("must be a finite number of seconds > 0")
    return value
