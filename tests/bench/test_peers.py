"""The peer routers' command lines, as their documentation gives them."""

from __future__ import annotations

from pathlib import Path

from bench.compare.demo import DemoConfig
from bench.compare.peers import peer_specs, smg_command, vllm_router_command

URLS = ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]


def test_peer_commands_are_the_documented_ones() -> None:
    config = DemoConfig()
    assert smg_command(Path("/p/smg"), config, URLS, 8000, 9000) == (
        "/p/smg",
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--worker-urls",
        *URLS,
        "--policy",
        "cache_aware",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        "9000",
        "--disable-tokenizer-autoload",
    )
    assert vllm_router_command(Path("/p/vllm-router"), config, URLS, 8000, 9001) == (
        "/p/vllm-router",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--worker-urls",
        *URLS,
        "--policy",
        "cache_aware",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        "9001",
    )


def test_only_the_peers_present_are_run(tmp_path: Path) -> None:
    (tmp_path / "smg").touch(mode=0o755)
    specs = peer_specs(DemoConfig(), tmp_path, URLS)
    assert [spec.label for spec in specs] == ["smg", "smg-sticky"]
    assert specs[1].commands[0][-3:] == (
        "--sticky-sessions",
        "--routing-key-headers",
        "X-Session-Id",
    )
