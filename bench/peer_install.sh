#!/usr/bin/env bash
# Install the peer routers for `kvrouter bench peers` into their own virtualenv.
#
#   bash bench/peer_install.sh [DIR]      # DIR defaults to /opt/peers
#
# Then run the benchmark inside a loopback-only network namespace (as root):
#
#   unshare -n bash -c 'ip link set lo up; kvrouter bench peers --peer-bin DIR/bin'
set -euo pipefail

DIR=${1:-/opt/peers}
SMG_VERSION=1.13.0          # SMG (Shepherd Model Gateway), the continuation of sglang-router
VLLM_ROUTER_VERSION=0.1.17

python3 -m venv "$DIR"
"$DIR/bin/pip" install --disable-pip-version-check --quiet \
    "smg==$SMG_VERSION" "vllm-router==$VLLM_ROUTER_VERSION"
"$DIR/bin/pip" show smg vllm-router | grep -E '^(Name|Version):'
for binary in smg vllm-router; do
    test -x "$DIR/bin/$binary" || { echo "missing $DIR/bin/$binary" >&2; exit 1; }
done
echo "peers installed: --peer-bin $DIR/bin"
