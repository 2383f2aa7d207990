"""The router's configuration: a file, the environment and flags, and their errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from policies.registry import policy_names
from router.cli import main as cli_main
from router.cli.serve import started_line
from router.config import RouterConfig, WorkerConfig
from router.config_loader import load_config
from router.errors import ConfigError

GOOD_YAML = """\
workers:
  - http://127.0.0.1:9001
  - {url: "http://127.0.0.1:9002", name: big, kv_tokens: 200000}
policy: cache_aware
policy_knobs: {cache_threshold: 0.5, balance_abs_threshold: 8}
upstream: {read_timeout_s: 30, max_attempts: 3}
prefix: {block_bytes: 128}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvrouter.yaml"
    path.write_text(text)
    return path


def test_load_config_from_a_file(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD_YAML), environ={})
    assert [(w.name, w.url, w.kv_tokens) for w in config.workers] == [
        ("127.0.0.1:9001", "http://127.0.0.1:9001", None),
        ("big", "http://127.0.0.1:9002", 200_000),
    ]
    assert config.policy == "cache_aware"
    assert config.policy_knobs == {"cache_threshold": 0.5, "balance_abs_threshold": 8}
    assert config.upstream.read_timeout_s == 30.0 and config.upstream.max_attempts == 3
    assert config.upstream.connect_timeout_s == 5.0  # untouched defaults stay
    assert config.prefix.block_bytes == 128 and config.prefix.block_tokens == 32
    assert config.port == 8000


def test_environment_overrides_the_file_and_flags_override_both(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD_YAML + "port: 7000\n")
    environ = {
        "KVROUTER_PORT": "9000",
        "KVROUTER_UPSTREAM__MAX_ATTEMPTS": "5",
        "KVROUTER_PREFIX__RECORD_REPLIES": "false",
        "OTHER_PORT": "1",
    }
    config = load_config(path, environ=environ)
    assert config.port == 9000 and config.upstream.max_attempts == 5
    assert config.upstream.read_timeout_s == 30.0  # the file's sibling setting survives
    assert config.prefix.record_replies is False and config.prefix.block_bytes == 128
    flagged = load_config(
        path, flags={"port": 9100, "upstream": {"max_attempts": 1}}, environ=environ
    )
    assert flagged.port == 9100 and flagged.upstream.max_attempts == 1
    workers = load_config(None, environ={"KVROUTER_WORKERS": "http://a:1,http://b:2"})
    assert [w.name for w in workers.workers] == ["a:1", "b:2"]


def test_policy_knobs_from_the_environment_are_typed() -> None:
    # Knobs have no types in RouterConfig; they are read as YAML, as --policy-knob does.
    config = load_config(
        None,
        environ={
            "KVROUTER_POLICY": "cache_aware",
            "KVROUTER_POLICY_KNOBS__CACHE_THRESHOLD": "0.5",
            "KVROUTER_POLICY_KNOBS__LOW_MATCH_TARGET": "least_load",
        },
    )
    assert config.policy_knobs == {"cache_threshold": 0.5, "low_match_target": "least_load"}


def test_load_config_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTER_PORT", "9123")
    assert load_config().port == 9123


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("upstream: {max_atempts: 3}\n", "upstream.max_atempts: unknown setting"),
        ("prot: 1\n", "prot: unknown setting"),
        ("upstream: {read_timeout_s: soon}\n", "upstream.read_timeout_s: expected a number"),
        ("upstream: {read_timeout_s: -1}\n", "upstream.read_timeout_s: must be > 0"),
        ("upstream: {max_attempts: 1.5}\n", "upstream.max_attempts: expected an integer"),
        ("prefix: {record_replies: maybe}\n", "prefix.record_replies: expected true or false"),
        ("upstream: 3\n", "upstream: expected a mapping"),
        ("workers: [ftp://x]\n", "workers[0].url: 'ftp://x' is not an http(s) URL"),
        ('workers: ["http://[::1"]\n', "workers[0].url: 'http://[::1' is not an http(s) URL"),
        ("workers: [http://a:99999]\n", "workers[0].url: 'http://a:99999' has no valid port"),
        ("workers: [http://a:1, http://a:1]\n", "workers: two workers are named 'a:1'"),
        (
            'workers: [{url: "http://a:1", name: "a b"}]\n',
            "workers[0].name: 'a b' must be at most 512 printable characters without spaces",
        ),
        (
            "policy: cache_aware\npolicy_knobs: {cache_treshold: 1}\n",
            "policy: policy 'cache_aware' has no knob 'cache_treshold'",
        ),
    ],
)
def test_config_errors_name_the_field(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), environ={})
    assert str(info.value).startswith(expected), str(info.value)


def test_an_unknown_policy_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "policy: fastest\n"), environ={})
    message = str(info.value)
    assert message.startswith("policy: unknown policy 'fastest'")
    assert message.endswith("known policies: " + ", ".join(policy_names()))
    with pytest.raises(ConfigError, match=r"^policy: unknown policy 'x'"):
        load_config(flags={"policy": "x"}, environ={})
    RouterConfig(policy="x")  # the schema knows no policies: the loader checks them


def test_check_config_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path, GOOD_YAML)
    assert cli_main(["check-config", str(good)]) == 0
    assert capsys.readouterr().out == f"{good}: ok (2 workers, policy cache_aware)\n"
    bad = tmp_path / "bad.yaml"
    bad.write_text("upstream: {max_atempts: 3}\n")
    assert cli_main(["check-config", str(bad)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{bad}: invalid: upstream.max_atempts: unknown setting")
    assert cli_main(["check-config", str(tmp_path / "missing.yaml")]) == 1
    assert "No such file" in capsys.readouterr().out


def test_check_config_names_every_wrong_setting_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "port: eighty\n"
        "colour: blue\n"
        "upstream: {max_atempts: 3, connect_timeout_s: soon}\n"
        "workers: [{url: http://a:8000, kv_tokens: many}, {url: http://b:8000, kv_tokens: x}]\n"
    )
    assert cli_main(["check-config", str(bad)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.removeprefix(f"{bad}: invalid: ").split(":")[0] for line in lines] == [
        "colour",
        "port",
        "upstream.max_atempts",
        "upstream.connect_timeout_s",
        "workers[0].kv_tokens",
        "workers[1].kv_tokens",
    ]


def test_a_wrong_policy_is_named_beside_the_files_other_problems() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(flags={"policy": "nope", "port": "x"}, environ={})
    assert [p.split(":")[0] for p in refused.value.problems] == ["port", "policy"]


def test_the_clients_variables_are_not_router_settings() -> None:
    # kvrouter top and admin read KVROUTER_URL; serve must not take it for a setting.
    config = load_config(environ={"KVROUTER_URL": "http://router:9000", "KVROUTER_PORT": "9"})
    assert config.port == 9


def test_serve_says_where_it_listens_and_whether_clients_need_a_key() -> None:
    open_router = RouterConfig(workers=(WorkerConfig("http://a:8000"),))
    line = started_line(open_router)
    assert "http://0.0.0.0:8000 (every interface)" in line
    assert "client keys off: anyone who reaches the port is served" in line
    local = RouterConfig(host="127.0.0.1", port=9000, api_keys=("k1", "k2"))
    line = started_line(local)
    assert "http://127.0.0.1:9000," in line and "every interface" not in line
    assert "client keys on (2)" in line
    assert "http://[::]:8000 (every interface)" in started_line(RouterConfig(host="::"))
