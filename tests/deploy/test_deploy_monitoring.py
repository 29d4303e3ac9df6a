"""k8s/monitoring: the Grafana dashboard queries only metrics the code exports, shows what issue 14
asks for, and its ConfigMap renders, validates and carries the Grafana sidecar's label.

The exported names come from the code itself: the metric objects the services create (the
coordinator's, the model pools', the gateway's) are built here on a fresh registry and collected,
so a renamed metric fails this test, whatever the dashboard says.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import yaml
from deploy_support import ROOT, render
from test_deploy_validators import kubernetes_validate

from gateway import http_metrics
from specdec.core.kpolicy import DraftRecord
from specdec.rpc.metrics import (
    GenerationMetrics,
    MetricsInterceptor,
    Registry,
    observe_draft_health,
    observe_draft_records,
)
from specdec.rpc.model_service import observe_kv_cache, observe_scheduler

MONITORING = ROOT / "k8s" / "monitoring"
DASHBOARD = MONITORING / "specdec-dashboard.json"
_METRIC = re.compile(r"\bspecdec_[a-z0-9_]+\b")
QUANTILES = ("0.5", "0.9", "0.99")


class _Cache:
    hits = misses = total_tokens = 0

    def __len__(self) -> int:
        return 0


def exported_series() -> set[str]:
    """Every series name the services expose: each family the code creates, by its type's suffixes."""
    registry = Registry()
    MetricsInterceptor(registry, "coordinator")
    GenerationMetrics(registry, positions=1)
    observe_draft_health(registry, SimpleNamespace(fallback_rounds=0, failures=0, healthy=True))
    observe_draft_records(registry, {True: DraftRecord(), False: DraftRecord()})
    observe_kv_cache(registry, _Cache(), "target")
    stats, draft_rows = SimpleNamespace(steps=0, shared=0), SimpleNamespace(cut=0)
    scheduler = SimpleNamespace(stats=stats, queued=0, step_observers=[], draft_rows=draft_rows)
    observe_scheduler(registry, scheduler, "target")
    families = [*registry.collectors.collect(), *http_metrics.REQUESTS.collect(), *http_metrics.DURATION.collect()]
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    return {family.name + suffix for family in families for suffix in suffixes[family.type]}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every query; the templating's too."""
    out = [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p.get("targets", [])]
    out += [(f"variable {v['name']}", v.get("definition", "")) for v in dashboard()["templating"]["list"]]
    return out


def test_dashboard_queries_only_metrics_the_code_exports():
    exported = exported_series()
    assert {"specdec_inflight_requests", "specdec_http_requests_total"} <= exported  # the collection works
    used = {(title, name) for title, expr in queries() for name in _METRIC.findall(expr)}
    assert used
    unknown = sorted((title, name) for title, name in used if name not in exported)
    assert not unknown, f"the dashboard queries series the code does not export: {unknown}"


def histogram_quantiles(metric: str) -> set[str]:
    pattern = re.compile(rf"histogram_quantile\(([0-9.]+), sum by \(le[^)]*\) \(rate\({metric}_bucket\{{")
    return {q for _, expr in queries() for q in pattern.findall(expr)}


@pytest.mark.parametrize(
    "metric",
    [
        "specdec_request_duration_seconds",
        "specdec_time_to_first_token_seconds",
        "specdec_inter_token_latency_seconds",
        "specdec_http_request_duration_seconds",
    ],
)
def test_dashboard_shows_latency_percentiles(metric):
    assert set(QUANTILES) <= histogram_quantiles(metric), f"{metric}: p50, p90 and p99 expected"


def test_dashboard_shows_what_issue_14_asks_for():
    exprs = "\n".join(expr for _, expr in queries())
    acceptance = re.compile(
        r"rate\(specdec_spec_decode_num_accepted_tokens_total\{[^}]*\}\[[^]]+\]\)\) / "
        r"sum\(rate\(specdec_spec_decode_num_draft_tokens_total"
    )
    assert acceptance.search(exprs), "acceptance rate: accepted / draft tokens"
    assert re.search(
        r"specdec_tokens_per_round_sum\{[^}]*\}\[[^]]+\]\)\) / sum\(rate\(specdec_tokens_per_round_count", exprs
    )
    for needed in (
        "specdec_round_draft_seconds_sum",
        "specdec_round_verify_seconds_sum",
        "specdec_spec_decode_num_accepted_tokens_per_pos_total",
        "specdec_inflight_requests",
        "specdec_queued_sequences",
        "specdec_kv_cache_tokens",
        "specdec_http_requests_total",
    ):
        assert needed in exprs, f"the dashboard does not show {needed}"
    assert re.search(r'specdec_http_requests_total\{[^}]*code=~"\[45\]\.\."', exprs), "HTTP errors by code"


def balanced(expr: str) -> bool:
    stack, pairs = [], {")": "(", "]": "[", "}": "{"}
    for char in re.sub(r'"[^"]*"', '""', expr):  # label values may hold any bracket
        if char in "([{":
            stack.append(char)
        elif char in pairs and (not stack or stack.pop() != pairs[char]):
            return False
    return not stack and expr.count('"') % 2 == 0


def test_dashboard_is_well_formed():
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, f"{panel['title']}: gridPos {grid}"
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), f"{panel['title']}: targets"
        for target in panel["targets"]:
            assert balanced(target["expr"]), f"{panel['title']}: unbalanced {target['expr']}"
            assert 'namespace=~"$namespace"' in target["expr"], f"{panel['title']}: not filtered by namespace"
    cells = [
        (p["gridPos"]["y"], x)
        for p in board["panels"]
        for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
    ]
    assert len(cells) == len(set(cells)), "panels overlap"


def test_monitoring_kustomization_renders_the_dashboard_for_grafanas_sidecar(tmp_path):
    manifests = render(MONITORING)
    docs = [d for d in yaml.safe_load_all(manifests) if d]
    (config,) = docs
    assert config["kind"] == "ConfigMap" and config["metadata"]["name"] == "specdec-grafana-dashboard"
    assert config["metadata"]["labels"].get("grafana_dashboard") == "1", "the sidecar's default label"
    assert config["data"][DASHBOARD.name] == DASHBOARD.read_text()
    assert len(DASHBOARD.read_bytes()) < 256 * 1024, "kubectl apply's last-applied annotation holds 256 KiB"
    kubernetes_validate(manifests, tmp_path / "monitoring.yaml")
