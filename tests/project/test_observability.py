"""Every dashboard panel and every rule, evaluated by a real Prometheus scraping a router
and simulated engines while traffic flows; promtool checks the rule file."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from bench.dashboards import render_all
from bench.ports import free_port
from bench.textgen import text_for
from router.config import AdmissionConfig, HealthConfig, PrefixConfig, StateConfig, WorkerConfig
from tests.conftest import (
    TEST_MODEL,
    EngineFactory,
    RunningEngine,
    router_config,
    serve_router,
)
from tests.kv_publisher import publishing_engine
from tests.router_client import chat_body, conversation, post, set_faults, wait_for
from tests.token_model import build_model_dir

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
DASHBOARDS = sorted((ROOT / "deploy" / "grafana").glob("*.json"))
FAST = HealthConfig(interval_s=0.2, scrape_interval_s=0.2, stale_after_s=2.0)


def panel_queries() -> list[tuple[str, str]]:
    return [
        (f"{d.stem}: {p['title']}", t["expr"])
        for d in DASHBOARDS
        for p in json.loads(d.read_text())["panels"]
        for t in p["targets"]
    ]


def rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_promtool_accepts_the_rules() -> None:
    result = subprocess.run(
        ["promtool", "check", "rules", str(RULES)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert DASHBOARDS and len(panel_queries()) >= 15


@pytest.fixture
def prometheus_dir(tmp_path: Path) -> Iterator[Path]:
    assert shutil.which("prometheus"), "prometheus is not installed (.ci/run installs it)"
    yield tmp_path


def _prometheus(folder: Path, targets: dict[str, list[str]]) -> tuple[subprocess.Popen[bytes], str]:
    shutil.copy(RULES, folder / "rules.yml")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yml"],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": hosts}]}
            for job, hosts in targets.items()
        ],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    process = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return process, f"http://127.0.0.1:{port}"


async def _traffic(http: aiohttp.ClientSession, url: str, fleet: list[RunningEngine]) -> None:
    """Hits, a partial (a worker out of rotation), a retry, long enough for rates; one
    session speaks Anthropic Messages."""
    sessions = {f"s{i}": conversation(f"obs{i}", 400, 100) for i in range(4)}
    claude = [{"role": "user", "content": text_for("obs-claude", 300)}]
    for turn in range(4):
        if turn != 2:  # not while a worker fails: its retry would leave no Messages hit
            body = {"model": TEST_MODEL, "max_tokens": 16, "system": "Brief.", "messages": claude}
            async with http.post(url + "/v1/messages", json=body) as reply:
                message = await reply.json()
                assert reply.status == 200, message
            claude += [
                {"role": "assistant", "content": message["content"]},
                {"role": "user", "content": text_for(f"obs-claude{turn}", 100)},
            ]
        if turn == 2:
            await set_faults(http, fleet[0], fail_requests=True)
        if turn == 3:
            await set_faults(http, fleet[0], fail_requests=False)
        for key, messages in sessions.items():
            result = await post(http, url, chat_body(messages, max_tokens=16, user=key))
            assert result.status == 200
            messages += [
                {"role": "assistant", "content": result.text},
                {"role": "user", "content": text_for(f"{key}{turn}", 400)},
            ]
        await asyncio.sleep(1.5)


async def _query(http: aiohttp.ClientSession, prom: str, expr: str) -> list[Any]:
    async with http.get(prom + "/api/v1/query", params={"query": expr}) as response:
        body = await response.json()
    assert body["status"] == "success", (expr, body)
    result: list[Any] = body["data"]["result"]
    return result


@pytest.mark.timeout(180)
async def test_every_panel_and_rule_returns_data(
    engine_factory: EngineFactory, prometheus_dir: Path, redis_url: str
) -> None:
    model_dir = build_model_dir(prometheus_dir)
    async with (
        publishing_engine(engine_factory, tokenizer=str(model_dir), engine_id="0") as announcing,
        engine_factory(tokenizer=str(model_dir), engine_id="1") as silent,
        aiohttp.ClientSession() as http,
    ):
        fleet = [announcing[0], silent]
        # w0 in exact mode (its engine's KV events), w1 approximate: both kinds of series.
        config = router_config(
            fleet,
            workers=(
                WorkerConfig(fleet[0].url, name="w0", kv_events=announcing[1]),
                WorkerConfig(fleet[1].url, name="w1"),
            ),
            prefix=PrefixConfig(block_bytes=64, tokenizer=str(model_dir)),
            health=FAST,
            state=StateConfig(url=redis_url),
            admission=AdmissionConfig(enabled=True),  # the queue panel's wait series
        )
        async with serve_router(config) as router:
            process, prom = _prometheus(
                prometheus_dir,
                {"kvrouter": _hosts([router.url]), "engines": _hosts([e.url for e in fleet])},
            )
            try:
                await _wait_ready(http, prom)
                started = time.time()

                async def scraping() -> bool:  # rates need samples from before the traffic
                    return len(await _query(http, prom, 'up{job="kvrouter"} == 1')) == 1

                await wait_for(scraping, timeout_s=20)
                await asyncio.sleep(2)
                await _traffic(http, router.url, fleet)
                await asyncio.sleep(4)  # scrapes and rule evaluations after it
                empty = [
                    name for name, expr in panel_queries() if not await _query(http, prom, expr)
                ]
                empty += [
                    r["record"]
                    for r in rules()
                    if "record" in r and not await _query(http, prom, r["record"])
                ]
                assert empty == [], f"no data for: {empty}"
                by_api = await _query(http, prom, "kvrouter:hit_rate_engine_by_api:ratio_rate5m")
                assert {r["metric"]["api"] for r in by_api} >= {"chat", "messages"}
                for rule in (r for r in rules() if "alert" in r):
                    await _query(http, prom, rule["expr"])  # valid; quiet while all is well
                    for name in set(re.findall(r"\b(kvrouter_[a-z_]+)", rule["expr"])):
                        assert await _query(http, prom, name), (rule["alert"], name)
                # What an operator would see: every dashboard drawn from this run.
                out = Path(os.environ.get("KVROUTER_DASHBOARD_PNG_DIR") or prometheus_dir / "png")
                end = time.time()
                pngs = await render_all(prom, started, end, out)
                assert len(pngs) == len(DASHBOARDS)
                assert all(p.stat().st_size > 10_000 for p in pngs)
            finally:
                process.terminate()
                process.wait(10)


def _hosts(urls: list[str]) -> list[str]:
    return [u.removeprefix("http://") for u in urls]


async def _wait_ready(http: aiohttp.ClientSession, prom: str) -> None:
    for _ in range(200):
        try:
            async with http.get(prom + "/-/ready") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError("prometheus did not become ready")


def test_the_queue_alert_counts_each_engine_once_however_many_replicas_report_it(
    tmp_path: Path,
) -> None:
    # Found: the alert summed every replica's copy of an engine's waiting queue, so two
    # replicas saw a queue of 6 as 12 and fired on it.
    alert = next(rule for rule in rules() if rule.get("alert") == "KvrouterQueueGrowing")
    test = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": "kvrouter_worker_engine_waiting_requests"
                        f'{{worker="w0",instance="{replica}"}}',
                        "values": "0+0.5x60",  # 0 to 30 over an hour, on both replicas
                    }
                    for replica in ("r1", "r2")
                ],
                # Over 10 from minute 21 (from minute 11 counted twice), for 10 minutes.
                "alert_rule_test": [
                    {"eval_time": "25m", "alertname": "KvrouterQueueGrowing", "exp_alerts": []},
                    {
                        "eval_time": "40m",
                        "alertname": "KvrouterQueueGrowing",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning"},
                                "exp_annotations": alert["annotations"],
                            }
                        ],
                    },
                ],
            }
        ],
    }
    path = tmp_path / "queue_alert_test.yml"
    path.write_text(yaml.safe_dump(test))
    result = subprocess.run(
        ["promtool", "test", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _promtool_test(tmp_path: Path, input_series: list[dict[str, str]], alerts: list[Any]) -> None:
    test = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": input_series, "alert_rule_test": alerts}],
    }
    path = tmp_path / "alert_test.yml"
    path.write_text(yaml.safe_dump(test))
    result = subprocess.run(
        ["promtool", "test", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _fires(name: str, eval_time: str, worker: str) -> dict[str, Any]:
    alert = next(rule for rule in rules() if rule.get("alert") == name)
    return {
        "eval_time": eval_time,
        "alertname": name,
        "exp_alerts": [
            {
                "exp_labels": {"severity": "warning", "worker": worker},
                "exp_annotations": {
                    k: v.replace("{{ $labels.worker }}", worker)
                    for k, v in alert["annotations"].items()
                },
            }
        ],
    }


def _quiet(name: str, eval_time: str) -> dict[str, Any]:
    return {"eval_time": eval_time, "alertname": name, "exp_alerts": []}


def test_a_worker_failing_every_trial_is_alerted_though_it_reads_half_open_between(
    tmp_path: Path,
) -> None:
    def circuit(worker: str, values: str) -> dict[str, str]:
        return {
            "series": f'kvrouter_worker_circuit_state{{worker="{worker}",instance="r1"}}',
            "values": values,
        }

    fires = _fires("KvrouterWorkerEjected", "6m", "w0")
    fires["exp_alerts"][0]["exp_labels"]["instance"] = "r1"
    _promtool_test(
        tmp_path,
        [
            circuit("w0", "2 1 2 1 2 1 2 1 2 1"),  # each trial fails
            circuit("w1", "2 0 0 0 0 0 0 0 0 0"),  # the first trial closed it
            circuit("w2", "2 1 1 1 1 1 1 1 1 1"),  # recovered, no request since to try it
        ],
        [fires],
    )


def test_the_kv_event_alerts_name_the_worker_that_is_not_exact(tmp_path: Path) -> None:
    def mode(worker: str, mode: str, values: str) -> dict[str, str]:
        return {
            "series": f'kvrouter_prefix_mode{{worker="{worker}",mode="{mode}",instance="r1"}}',
            "values": values,
        }

    def series(name: str, worker: str, values: str, **labels: str) -> dict[str, str]:
        extra = "".join(f',{k}="{v}"' for k, v in labels.items())
        return {"series": f'{name}{{worker="{worker}",instance="r1"{extra}}}', "values": values}

    _promtool_test(
        tmp_path,
        [
            # w0: subscribed and exact, announcing as it serves.
            mode("w0", "exact", "1x40"),
            mode("w0", "approximate", "0x40"),
            series("kvrouter_kv_event_batches_total", "w0", "0+5x40"),
            series("kvrouter_requests_total", "w0", "0+5x40", outcome="success"),
            series("kvrouter_kv_event_gaps_total", "w0", "0x40"),
            # w1: subscribed, never exact, serving, silent; its stream then loses messages.
            mode("w1", "exact", "0x40"),
            mode("w1", "approximate", "1x40"),
            series("kvrouter_kv_event_batches_total", "w1", "0x40"),
            series("kvrouter_requests_total", "w1", "0+5x40", outcome="success"),
            series("kvrouter_kv_event_gaps_total", "w1", "0x20 1+1x20"),
            # w2: not subscribed (no event series): approximate by design, never alerted.
            mode("w2", "exact", "0x40"),
            mode("w2", "approximate", "1x40"),
            series("kvrouter_requests_total", "w2", "0+5x40", outcome="success"),
        ],
        [
            _quiet("KvrouterWorkerNotExact", "3m"),
            _fires("KvrouterWorkerNotExact", "10m", "w1"),
            _fires("KvrouterWorkerServesWithoutKvEvents", "20m", "w1"),
            _quiet("KvrouterKvEventGapsRepeat", "20m"),
            _fires("KvrouterKvEventGapsRepeat", "30m", "w1"),
        ],
    )
