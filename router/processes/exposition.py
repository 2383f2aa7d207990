"""One Prometheus exposition from every process of a ``--processes N`` router.

Every sample keeps its value and gains ``process="<index>"``: the group reads as N
replicas would, each with its own series, through one endpoint. Nothing is summed here,
and that is deliberate:

* a counter summed over processes falls when one process restarts (its count starts
  again from 0), and ``rate()`` reads the fall as a reset: the whole sum counted again;
  per process, a restart is the ordinary reset of one series;
* circuit breakers, health verdicts and the engines' own gauges (``running``,
  ``waiting``) are each process's view of one worker: summed, they would double; per
  process they show which process opened which circuit;
* ``sum without (process) (...)``, like ``sum without (instance)`` over replicas, gives
  the router's totals; the indexes are the process indexes, a fixed set (a restarted
  process keeps its index, never its pid).

``kvrouter_process_up{process}`` is 1 for each process that answered this scrape, 0 for
one that did not (restarting): its series are absent from this scrape only.
"""

from __future__ import annotations

from collections.abc import Sequence

UP_FAMILY = (
    b"# HELP kvrouter_process_up 1 if the router process answered this scrape "
    b"(kvrouter serve --processes N).\n# TYPE kvrouter_process_up gauge\n"
)


def with_label(line: bytes, label: bytes) -> bytes:
    """``name{a="b"} 1`` -> ``name{<label>,a="b"} 1``; ``name 1`` -> ``name{<label>} 1``."""
    space = line.find(b" ")
    brace = line.find(b"{")
    if brace != -1 and (space == -1 or brace < space):
        rest = line[brace + 1 :]
        return line[: brace + 1] + label + (b"" if rest.startswith(b"}") else b",") + rest
    return line[:space] + b"{" + label + b"}" + line[space:]


def merge(scrapes: Sequence[tuple[int, bytes | None]]) -> bytes:
    """The text exposition (format 0.0.4) of ``(process index, its /metrics body or None
    if it did not answer)``: each family once, its HELP and TYPE from the first process
    that had it, then every process's samples in index order."""
    headers: dict[bytes, list[bytes]] = {}
    samples: dict[bytes, list[bytes]] = {}
    for index, body in sorted(scrapes, key=lambda s: s[0]):
        if body is None:
            continue
        label = b'process="%d"' % index
        family = b""
        for line in body.splitlines():
            if line.startswith((b"# HELP ", b"# TYPE ")):
                family = line.split(b" ", 3)[2]
                lines = headers.setdefault(family, [])
                samples.setdefault(family, [])
                if not any(h[:7] == line[:7] for h in lines):
                    lines.append(line)
            elif line and not line.startswith(b"#"):
                if family not in samples:  # a sample with no header before it
                    family = line.split(b"{", 1)[0].split(b" ", 1)[0]
                    headers.setdefault(family, [])
                    samples[family] = []
                samples[family].append(with_label(line, label))
    out = []
    for family, lines in headers.items():
        out.extend(lines)
        out.extend(samples[family])
    body = b"\n".join(out) + b"\n" if out else b""
    up = b"".join(
        b'kvrouter_process_up{process="%d"} %s\n' % (i, b"1.0" if b is not None else b"0.0")
        for i, b in sorted(scrapes, key=lambda s: s[0])
    )
    return body + UP_FAMILY + up
