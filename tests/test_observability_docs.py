"""The alert rules and the Grafana dashboard shipped in docs/observability: the rules load and fire on
the series that should fire them (``promtool test rules``), and every dashboard query is valid PromQL
(checked by promtool as recording rules). A real Prometheus runs them against a stack in test_make_up."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from prometheus_support import prometheus_bin

DOCS = Path(__file__).resolve().parents[1] / "docs" / "observability"


def _promtool(*args: str, cwd: Path = DOCS) -> str:
    out = subprocess.run([prometheus_bin("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_alert_rules_load_and_fire_exactly_when_they_should():
    assert "SUCCESS: 6 rules found" in _promtool("check", "rules", "alerts.yml")
    assert "SUCCESS" in _promtool("test", "rules", "alerts_test.yml")


def dashboard_queries() -> list[str]:
    dash = json.loads((DOCS / "grafana-dashboard.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_every_dashboard_query_is_valid_promql(tmp_path):
    queries = dashboard_queries()
    assert len(queries) >= 16
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:panel_{i}", "expr": q}
                                                         for i, q in enumerate(queries)]}]}
    (tmp_path / "dashboard_rules.yml").write_text(json.dumps(rules))  # JSON is YAML
    assert f"SUCCESS: {len(queries)} rules found" in _promtool("check", "rules", "dashboard_rules.yml", cwd=tmp_path)
