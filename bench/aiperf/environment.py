"""Where aiperf is installed: ``scripts/install-aiperf.sh``'s virtual environment.

aiperf cannot share the router's environment (aiperf 0.13 pins
``prometheus-client~=0.23.1``, the router needs 0.26 or later), so it is installed once
per machine in a directory of its own: ``KVROUTER_AIPERF_HOME``, or
``~/.cache/kvrouter/aiperf-VERSION``. The script writes ``aiperf==VERSION`` to the
directory's marker file once the environment is whole.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AIPERF_VERSION = "0.13.0"
INSTALL_SCRIPT = REPO / "scripts" / "install-aiperf.sh"
MARKER = ".kvrouter-installed"


def aiperf_home() -> Path:
    """The environment's directory, as the install script chooses it."""
    override = os.environ.get("KVROUTER_AIPERF_HOME")
    if override:
        return Path(override)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvrouter" / f"aiperf-{AIPERF_VERSION}"


def installed_aiperf(home: Path | None = None) -> Path | None:
    """The ``aiperf`` executable of a finished install in ``home`` (default:
    ``aiperf_home()``); None if there is none."""
    home = home or aiperf_home()
    marker = home / MARKER
    if marker.is_file() and marker.read_text().strip() == f"aiperf=={AIPERF_VERSION}":
        return home / "bin" / "aiperf"
    return None


def install_aiperf() -> Path:
    """The ``aiperf`` executable, installed on first use (a few minutes; blocking)."""
    done = subprocess.run(
        [str(INSTALL_SCRIPT)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "KVROUTER_AIPERF_VERSION": AIPERF_VERSION},
    )
    return Path(done.stdout.strip().splitlines()[-1]) / "bin" / "aiperf"
