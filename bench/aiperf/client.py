"""One ``aiperf profile`` run: its command line, run as a process without blocking the
event loop (the router under test may share it), stopped if it overstays."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from bench.aiperf.hf_cache import TOKENIZER_NAME

LOG_NAME = "aiperf.log"  # its console output, in the artifact directory
# aiperf keeps every dataset it has tokenized under ~/.cache/aiperf, never evicted; each
# of our runs writes a dataset of its own.
NO_DATASET_CACHE = {"AIPERF_DATASET_MMAP_CACHE_ENABLED": "false"}
DEFAULT_TIMEOUT_S = 600.0
STOP_GRACE_S = 10.0


@dataclass(frozen=True, slots=True)
class AiperfRun:
    """aiperf's multi-turn mode over ``input_file`` (``bench.aiperf.sessions``): each of
    ``conversations`` conversations once, ``concurrency`` at a time, streamed chat
    completions to ``url``; token counts from the server's usage. ``workers``: aiperf's
    worker processes (None: its own choice, by the CPU count)."""

    url: str
    model: str
    input_file: Path
    conversations: int
    concurrency: int
    artifact_dir: Path
    workers: int | None = None
    tokenizer: str = TOKENIZER_NAME

    def argv(self, aiperf: Path) -> list[str]:
        argv = [
            str(aiperf),
            "profile",
            "--model",
            self.model,
            "--url",
            self.url,
            "--endpoint-type",
            "chat",
            "--streaming",
            "--tokenizer",
            self.tokenizer,
            "--input-file",
            str(self.input_file),
            "--custom-dataset-type",
            "multi_turn",
            "--conversation-num",
            str(self.conversations),
            "--concurrency",
            str(self.concurrency),
            "--use-server-token-count",
            "--output-artifact-dir",
            str(self.artifact_dir),
            "--ui-type",
            "none",
        ]
        if self.workers is not None:
            argv += ["--workers-max", str(self.workers), "--record-processors", "1"]
        return argv

    @property
    def log_path(self) -> Path:
        return self.artifact_dir / LOG_NAME


async def run_aiperf(
    aiperf: Path,
    run: AiperfRun,
    env: Mapping[str, str],
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> int:
    """aiperf's exit status; its console output goes to ``run.log_path``. ``env`` is
    added to this process's environment. Stopped (and ``TimeoutError`` raised) after
    ``timeout_s``, or when the caller is cancelled."""
    run.artifact_dir.mkdir(parents=True, exist_ok=True)
    # aiperf's packages are its environment's: this process's PYTHONPATH would put ours
    # (and their pins) before them.
    inherited = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with run.log_path.open("wb") as log:
        # A session of its own: aiperf runs its workers and record processors as child
        # processes, which a stop must reach too.
        process = await asyncio.create_subprocess_exec(
            *run.argv(aiperf),
            env={**inherited, **NO_DATASET_CACHE, **env},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        return await asyncio.wait_for(process.wait(), timeout_s)
    finally:
        if process.returncode is None:
            await _stop(process)


async def _stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM to aiperf's process group, SIGKILL if it has not exited in time."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), STOP_GRACE_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()


def log_tail(run: AiperfRun, lines: int = 40) -> str:
    """The end of aiperf's console output, for an error message."""
    if not run.log_path.is_file():
        return ""
    return "\n".join(run.log_path.read_text(errors="replace").splitlines()[-lines:])
