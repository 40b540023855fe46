"""A Prometheus configuration for a running stack: ``<home>/prometheus/prometheus.yml``.

Three scrape jobs read their targets from files the stack keeps current (``file_sd_configs``, re-read
by Prometheus when they change): ``prodrl-recorder`` (the recorder), ``prodrl-serve`` (every replica
of the deployment, canary included, as the endpoint file lists them: they move with each rolling
update) and ``prodrl-trainer`` (rank 0 of a round while it trains, ``observability.trainer_metrics_port``).
The alert rules shipped in ``docs/observability/alerts.yml`` are loaded. Start it with

    prometheus --config.file=<home>/prometheus/prometheus.yml --storage.tsdb.path=<home>/prometheus/data
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[2]
ALERT_RULES = REPO / "docs" / "observability" / "alerts.yml"
JOBS = ("prodrl-recorder", "prodrl-serve", "prodrl-trainer")


def config_text(home: Path, scrape_interval_s: float = 15.0, rules: Path = ALERT_RULES) -> str:
    d = Path(home) / "prometheus"
    lines = ["global:", f"  scrape_interval: {scrape_interval_s:g}s", f"  evaluation_interval: {scrape_interval_s:g}s",
             "rule_files:", f"  - {json.dumps(str(rules))}", "scrape_configs:"]
    for job in JOBS:
        lines += [f"  - job_name: {job}", "    file_sd_configs:", f"      - files: [{json.dumps(str(d / (job + '.json')))}]",
                  "        refresh_interval: 5s"]
    return "\n".join(lines) + "\n"


def write_config(home: Path, scrape_interval_s: float = 15.0) -> Path:
    d = Path(home) / "prometheus"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "prometheus.yml"
    path.write_text(config_text(home, scrape_interval_s))
    for job in JOBS:
        if not (d / f"{job}.json").exists():
            write_targets(home, job, [])
    return path


def host_port(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def write_targets(home: Path, job: str, targets: list[str], labels: dict[str, str] | None = None) -> bool:
    """``job``'s targets (``host:port``), written atomically when they changed; True when written."""
    path = Path(home) / "prometheus" / f"{job}.json"
    text = json.dumps([{"targets": sorted(set(targets)), "labels": labels or {}}] if targets else [], indent=1)
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True


def serving_targets(endpoint) -> list[str]:
    """Every replica of ``endpoint`` (the endpoint file's record), the canary's included."""
    if endpoint is None:
        return []
    urls = [r["url"] for r in endpoint.replica_list()]
    urls += [r["url"] for r in (endpoint.canary or {}).get("replicas", [])]
    return [host_port(u) for u in urls]
