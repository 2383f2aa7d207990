#!/usr/bin/env bash
# The README's test command: install what the tests need on a bare Debian machine, then
# run them. Extra arguments go to pytest (scripts/test.sh -x tests/project/test_cli.py).
#
# The tests start their own redis-server (and Sentinel and Cluster nodes) and a real
# Prometheus (with promtool) on free ports: their Debian packages are installed when a
# binary is missing (with sudo when not root). APT_GET overrides the apt-get command.
# Real vLLM engines (tests/vllm_engines.py) run from scripts/install-vllm.sh's environment
# (INSTALL_VLLM overrides the script), aiperf (tests/bench/test_aiperf_client.py) from
# scripts/install-aiperf.sh's (INSTALL_AIPERF overrides it).
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v redis-server >/dev/null && command -v redis-cli >/dev/null || missing+=(redis-server)
command -v prometheus >/dev/null && command -v promtool >/dev/null || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
    # sudo resets the environment, so DEBIAN_FRONTEND goes through env.
    apt_get=(env DEBIAN_FRONTEND=noninteractive "${APT_GET:-apt-get}")
    if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then
        apt_get=(sudo "${apt_get[@]}")
    fi
    echo "scripts/test.sh: installing ${missing[*]}: ${apt_get[*]}" >&2
    "${apt_get[@]}" update -qq
    "${apt_get[@]}" install -y -qq --no-install-recommends "${missing[@]}"
fi

python3 -m pip install -e '.[test]'
# The real-engine tests' vLLM (CPU build) in an environment of its own, kept between runs.
"${INSTALL_VLLM:-scripts/install-vllm.sh}" >/dev/null
# aiperf, the outside client, likewise: its pins would fight the router's.
"${INSTALL_AIPERF:-scripts/install-aiperf.sh}" >/dev/null
python3 -m pytest -q "$@"
