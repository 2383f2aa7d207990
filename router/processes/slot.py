"""One process's place in a ``--processes N`` group, and the config every process serves.

The supervisor writes the config it resolved (file, environment and flags merged, the
port picked, the state URL set) into its private run directory; every process reads that
file and nothing else, so all of them serve exactly the same config, and secrets (API
keys, the admin token) travel in a file only this user can read rather than on command
lines that any user can list.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from router.config import RouterConfig
from router.config_loader import load_config

CONFIG_FILE = "config.json"
STORE_SOCKET = "state.sock"


@dataclass(frozen=True, slots=True)
class ProcessSlot:
    index: int
    count: int
    run_dir: Path

    def socket_path(self, index: int) -> Path:
        """Where process ``index`` answers its siblings and the supervisor (its own
        /metrics and admin calls, never the group's)."""
        return self.run_dir / f"process-{index}.sock"

    @property
    def own_socket(self) -> Path:
        return self.socket_path(self.index)

    @property
    def siblings(self) -> list[int]:
        return [i for i in range(self.count) if i != self.index]

    def flag(self) -> str:
        """The value of ``kvrouter serve --process-slot`` that makes a process this one."""
        return f"{self.index}:{self.run_dir}"

    @classmethod
    def parse(cls, text: str, count: int) -> ProcessSlot:
        index, sep, run_dir = text.partition(":")
        if not sep or not index.isdigit() or not 0 <= int(index) < count:
            raise ValueError(f"--process-slot: expected INDEX:DIR with INDEX < {count}")
        return cls(int(index), count, Path(run_dir))


def write_config(config: RouterConfig, run_dir: Path) -> Path:
    """``config`` as the file every process reads (JSON, which the YAML loader reads)."""
    path = run_dir / CONFIG_FILE
    data = json.dumps(dataclasses.asdict(config), indent=1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(data)
    return path


def read_config(path: Path) -> RouterConfig:
    """The config the supervisor wrote; the environment was merged into it already."""
    return load_config(path, environ={})
