"""A tokenizer aiperf loads without the network: a model directory's tokenizer files laid
out as a Hugging Face hub cache entry.

aiperf needs a tokenizer even when it counts tokens from the server's usage (it builds
its datasets with one). Run offline (``HF_HUB_OFFLINE``, which is what keeps it from
asking the hub), it looks a tokenizer name up in the hub cache only, never as a path:
``$HF_HOME/hub/models--local--qwen3-tok/snapshots/<revision>/`` with ``refs/main``
naming the revision.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_NAME = "local/qwen3-tok"  # what aiperf's --tokenizer names
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
REVISION = "0" * 40  # any commit-shaped name: refs/main is all that points at it


def hub_cache_home(model_dir: Path, hf_home: Path) -> Path:
    """``hf_home`` holding ``model_dir``'s tokenizer files as ``TOKENIZER_NAME``."""
    repo = hf_home / "hub" / f"models--{TOKENIZER_NAME.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(model_dir / name, snapshot / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    return hf_home


def offline_environment(hf_home: Path) -> dict[str, str]:
    """The variables under which aiperf reads ``hf_home``'s cache and nothing else."""
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
