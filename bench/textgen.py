"""Deterministic filler text made of whole stand-in tokens.

Every word in the vocabulary is exactly 4 ASCII bytes, so ``tokens`` words are exactly
``tokens`` tokens for the simulator's tokenizer (see ``bench.tokenizer``) and roughly
the same count for a real BPE tokenizer. The same key always gives the same text, so
trace blocks that share an id share their text, and so their cached prefix.
"""

from __future__ import annotations

import random
from functools import lru_cache

_WORDS = (
    "the ",
    "and ",
    "def ",
    "for ",
    "int ",
    "let ",
    "var ",
    "use ",
    "mod ",
    "fn  ",
    "code",
    "data",
    "test",
    "file",
    "line",
    "read",
    "load",
    "save",
    "find",
    "open",
    "path",
    "node",
    "list",
    "dict",
    "map ",
    "set ",
    "key ",
    "type",
    "call",
    "self",
    "ret ",
    "err ",
    "log ",
    "run ",
    "add ",
    "sum ",
    "max ",
    "min ",
    "len ",
    "new ",
    "api ",
    "http",
    "user",
    "time",
    "size",
    "byte",
    "char",
    "word",
    "text",
    "html",
    "json",
    "yaml",
    "conf",
    "init",
    "main",
    "exit",
    "fail",
    "pass",
    "todo",
    "note",
    "fix ",
    "bug ",
    "diff",
    "git ",
    "tree",
    "root",
    "leaf",
    "hash",
    "sort",
    "scan",
    "loop",
    "wait",
    "sync",
    "lock",
    "pool",
    "task",
    "job ",
    "cpu ",
    "gpu ",
    "mem ",
    "(x) ",
    "[i] ",
    "{ } ",
    "a.b ",
    "x=1 ",
    "y+=2",
    "if  ",
    "else",
    "elif",
    "try ",
    "out ",
    "in  ",
    "of  ",
    "to  ",
    "is  ",
    "as  ",
    "not ",
    "or  ",
    "at  ",
    "on  ",
    "we  ",
    "it  ",
    "can ",
    "will",
    "must",
    "may ",
    "next",
    "last",
    "step",
    "plan",
    "\n   ",
    ";\n  ",
    ".\n  ",
    ",   ",
    ":   ",
    "()\n ",
    "  # ",
    "    ",
)


@lru_cache(maxsize=4096)
def text_for(key: str, tokens: int) -> str:
    """``tokens`` stand-in tokens of text, a pure function of ``key`` and ``tokens``."""
    if tokens <= 0:
        return ""
    rng = random.Random(key)
    return "".join(rng.choices(_WORDS, k=tokens))


def generated_text(rng: random.Random, tokens: int) -> str:
    """Text for a simulated engine's output: fresh words drawn from ``rng``."""
    return "".join(rng.choices(_WORDS, k=tokens))
