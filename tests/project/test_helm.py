"""The Helm chart, proven without a cluster: Helm's own engine renders and lints it, every
manifest validates against the Kubernetes schemas, the schema rejects bad values, and
the router config it renders is accepted by ``kvrouter check-config``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from router.cli import main

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvrouter"
KUBE_VERSION = "1.30.0"
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule"}  # CRDs: not in the core schemas

OVERRIDES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "static workers, bundled redis, admin token": {
        "config": {
            "workers": ["http://vllm-0.vllm:8000", "http://vllm-1.vllm:8000"],
            "policy": "cache_aware",
            "policy_knobs": {"cache_threshold": 0.5},
        },
        "redis": {"bundled": True},
        "adminToken": {"value": "s3cret"},
        "clientTokens": {"values": ["team-a-key-123", "team-b-key-456"]},
    },
    "kubernetes discovery, external redis, autoscaling, monitoring": {
        "config": {
            "discovery": {"kubernetes": {"selector": "app=vllm", "port_name": "http"}},
            "admission": {"max_outstanding_per_worker": 64},
        },
        "redis": {"url": "redis://redis.cache:6379/2"},
        "autoscaling": {"enabled": True},
        "serviceMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "adminToken": {"existingSecret": "ops-token"},
    },
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    chart = helm_python.Chart.load(str(CHART))
    try:
        files = chart.render(values, name="demo", namespace="inference")
    finally:
        chart.close()
    return [
        doc
        for name, text in files.items()
        if name.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


@pytest.mark.parametrize("case", list(OVERRIDES))
def test_lints_renders_and_validates(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    values = OVERRIDES[case]
    report = helm_python.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] >= 2], (
        report
    )
    manifests = render(values)
    kinds = {m["kind"] for m in manifests}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    for manifest in manifests:
        if manifest["kind"] in CUSTOM_KINDS:
            assert manifest["apiVersion"] == "monitoring.coreos.com/v1" and manifest["spec"]
            continue
        kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)
    config = next(
        m for m in manifests if m["kind"] == "ConfigMap" and "router.yaml" in m.get("data", {})
    )
    path = tmp_path / "router.yaml"
    path.write_text(config["data"]["router.yaml"])
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().out


def test_options_render_what_they_promise() -> None:
    case = OVERRIDES["static workers, bundled redis, admin token"]
    manifests = render(case)
    by_kind = {(m["kind"], m["metadata"]["name"]): m for m in manifests}
    assert ("StatefulSet", "demo-kvrouter-redis") in by_kind
    router_yaml = yaml.safe_load(by_kind[("ConfigMap", "demo-kvrouter")]["data"]["router.yaml"])
    assert router_yaml["state"]["url"] == "redis://demo-kvrouter-redis:6379/0"
    deployment = by_kind[("Deployment", "demo-kvrouter")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert [e["name"] for e in container["env"]] == ["KVROUTER_ADMIN_TOKEN", "KVROUTER_API_KEYS"]
    clients = by_kind[("Secret", "demo-kvrouter-clients")]
    assert clients["stringData"]["api-keys"] == "team-a-key-123,team-b-key-456"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    dashboards = [
        m
        for m in manifests
        if m["kind"] == "ConfigMap" and m["metadata"]["labels"].get("grafana_dashboard") == "1"
    ]
    assert len(dashboards) == 2


@pytest.mark.parametrize(
    "bad",
    [
        {"replicaCount": "two"},
        {"config": {"policy": "fastest"}},
        {"unknown": 1},
        {"redis": {"url": "http://not-redis"}},
        {"service": {"type": "Magic"}},
        {"autoscaling": {"targetCPUUtilizationPercentage": 150}},
        {"clientTokens": {"values": ["has,comma"]}},
    ],
)
def test_the_schema_rejects_bad_values(bad: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        render(bad)


def test_the_chart_carries_the_same_rules_and_dashboards_as_deploy() -> None:
    assert (CHART / "files" / "rules.yml").read_text() == (
        ROOT / "deploy" / "prometheus" / "rules.yml"
    ).read_text()
    for dashboard in (ROOT / "deploy" / "grafana").glob("*.json"):
        assert (
            CHART / "files" / "dashboards" / dashboard.name
        ).read_text() == dashboard.read_text()
