"""Live progress of a replay on stderr.

On a terminal it is a rich progress bar; otherwise (CI logs, redirected output) one
status line every ``DEFAULT_STATUS_INTERVAL_S`` seconds. Either way the display is
redrawn by a task the display owns, not by rich's refresh thread, and the task is
cancelled when the display closes.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.replay.result import RequestRecord

DEFAULT_REFRESH_S = 0.5
DEFAULT_STATUS_INTERVAL_S = 10.0


class ProgressCounts:
    """Running totals of the records seen so far."""

    __slots__ = ("cached", "done", "errors", "oracle", "prompt", "total")

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = self.errors = self.prompt = self.cached = self.oracle = 0

    def add(self, record: RequestRecord) -> None:
        self.done += 1
        if not record.ok:
            self.errors += 1
            return
        self.prompt += record.prompt_tokens
        self.cached += record.cached_tokens
        self.oracle += record.oracle_cached_tokens

    def status(self) -> str:
        hit = self.cached / self.prompt if self.prompt else 0.0
        oracle = self.oracle / self.prompt if self.prompt else 0.0
        return f"hit {hit:6.1%} (oracle {oracle:6.1%})  errors {self.errors}"


class ProgressDisplay:
    """``async with ProgressDisplay(total) as display: ... display.add(record)``."""

    def __init__(
        self,
        total: int,
        console: Console | None = None,
        refresh_s: float = DEFAULT_REFRESH_S,
        status_interval_s: float = DEFAULT_STATUS_INTERVAL_S,
    ) -> None:
        self.counts = ProgressCounts(total)
        self._console = console or Console(stderr=True)
        self._live = self._console.is_terminal
        self._interval = refresh_s if self._live else status_interval_s
        self._bar = Progress(
            TextColumn("replay"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=self._console,
            auto_refresh=False,
            transient=False,
        )
        self._task_id = self._bar.add_task("replay", total=total, status=self.counts.status())
        self._redraw: asyncio.Task[None] | None = None

    def add(self, record: RequestRecord) -> None:
        self.counts.add(record)

    def _draw(self) -> None:
        if self._live:
            self._bar.update(self._task_id, completed=self.counts.done, status=self.counts.status())
            self._bar.refresh()
        else:
            c = self.counts
            self._console.print(
                f"replay {c.done}/{c.total} requests  {c.status()}", highlight=False
            )

    async def _redraw_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            self._draw()

    async def __aenter__(self) -> ProgressDisplay:
        if self._live:
            self._bar.start()
        self._redraw = asyncio.create_task(self._redraw_forever())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._redraw is not None:
            self._redraw.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._redraw
        self._draw()
        if self._live:
            self._bar.stop()
