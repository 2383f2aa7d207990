"""Own and inclusive time per function from py-spy's raw (collapsed-stack) output.

``py-spy record --format raw`` writes one line per distinct stack, outermost frame first:
``func (file.py:line);func (file.py:line);... COUNT``. A function's own time is the
samples with it as the innermost frame; its inclusive time the samples with it anywhere
in the stack (counted once per stack, so recursion does not count twice). Line numbers
are dropped: the unit here is the function.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def function_of(frame: str) -> str:
    """``func (path/to/file.py:12)`` -> ``func (path/to/file.py)``."""
    match = _FRAME.match(frame.strip())
    if match is None:
        return frame.strip()
    return f"{match['func']} ({match['file']})"


@dataclass(frozen=True, slots=True)
class Profile:
    samples: int
    own: Counter[str]
    inclusive: Counter[str]
    own_by_file: Counter[str]

    def top(self, counter: Counter[str], n: int) -> list[tuple[str, int, float]]:
        """The ``n`` largest entries, each with its share of all samples."""
        total = max(self.samples, 1)
        return [(name, count, count / total) for name, count in counter.most_common(n)]


def _file_of(function: str) -> str:
    match = re.search(r"\(([^()]*)\)$", function)
    return match.group(1) if match else function


def summarize(lines: Iterable[str]) -> Profile:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    by_file: Counter[str] = Counter()
    samples = 0
    for line in lines:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [function_of(f) for f in stack.split(";") if f]
        if not frames:
            continue
        samples += count
        own[frames[-1]] += count
        by_file[_file_of(frames[-1])] += count
        for function in set(frames):
            inclusive[function] += count
    return Profile(samples, own, inclusive, by_file)


def format_profile(profile: Profile, n: int = 25) -> str:
    """The top entries as plain text: own time, inclusive time, own time per file."""
    out = [f"{profile.samples} samples"]
    for title, counter in (
        ("own time (innermost frame)", profile.own),
        ("inclusive time (anywhere in the stack)", profile.inclusive),
        ("own time by file", profile.own_by_file),
    ):
        out.append(f"\n{title}:")
        out.extend(
            f"{share:6.1%} {count:7d}  {name}" for name, count, share in profile.top(counter, n)
        )
    return "\n".join(out)
