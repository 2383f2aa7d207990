#!/usr/bin/env bash
# Install aiperf (NVIDIA's benchmarking client) into a virtual environment of its own, once
# per machine.
#
# tests/bench/test_aiperf_client.py and `kvrouter bench aiperf` run aiperf as an outside
# client of the router. It cannot share the router's environment: aiperf 0.13 pins
# prometheus-client~=0.23.1, the router needs >=0.26. Prints the environment's directory on
# its last line. Idempotent: an environment whose marker names this version is reused as it
# is, and so is one made by hand that already holds this version (it gets the marker).
#
# KVROUTER_AIPERF_HOME overrides the directory (default ~/.cache/kvrouter/aiperf-VERSION).
# A directory that is neither such an environment nor one this script started is never
# removed.
set -euo pipefail

version="${KVROUTER_AIPERF_VERSION:-0.13.0}"
home="${KVROUTER_AIPERF_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/kvrouter/aiperf-$version}"
marker="$home/.kvrouter-installed"
wanted="aiperf==$version"

if [ -f "$marker" ] && [ "$(cat "$marker")" = "$wanted" ]; then
    echo "$home"
    exit 0
fi

# An environment made by hand (python3 -m venv DIR && DIR/bin/pip install aiperf==VERSION).
if [ ! -f "$marker" ] && [ -x "$home/bin/python" ] && [ -x "$home/bin/aiperf" ]; then
    found="$("$home/bin/python" -c 'from importlib.metadata import version; print(version("aiperf"))' 2>/dev/null || true)"
    if [ "$found" = "$version" ]; then
        echo "$wanted" > "$marker"
        echo "$home"
        exit 0
    fi
fi

if [ -e "$home" ] && [ ! -f "$marker" ] && [ -n "$(ls -A "$home")" ]; then
    echo "install-aiperf.sh: $home holds something else; not removing it" >&2
    exit 1
fi

rm -rf "$home"
python3 -m venv "$home"
# From here on the directory is this script's: an interrupted install is started over.
echo "installing $wanted" > "$marker"
py="$home/bin/python"
"$py" -m pip install -q --upgrade pip >&2
"$py" -m pip install -q "$wanted" >&2
"$home/bin/aiperf" --version >&2

echo "$wanted" > "$marker"
echo "$home"
