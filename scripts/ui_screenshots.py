"""Screenshots of the Dagster and MLflow UIs on real runs, for the README.

    python scripts/ui_screenshots.py runs/demo                  # docs/asset_graph.png, docs/round_partitions.png
    python scripts/ui_screenshots.py runs/demo --review runs/review
        # also builds runs/review (tiny lab model, promotion: review; round 1 approved, round 2
        # pending) unless it exists, and writes docs/review_registry.png (the MLflow registry with
        # a pending and an approved version), docs/review_pending_version.png and
        # docs/review_waiting_round.png (the Dagster page of the round waiting for review)

Starts `dagster-webserver` (and `mlflow ui`) on the runs' stores, drives Debian's Chromium (headless)
with Playwright, dismisses the first-visit dialog, saves the pages, and stops the servers.
Needs: `apt-get install chromium`, `pip install playwright` (the `docs` extra).
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PORT = int(os.environ.get("PORT", "3111"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


MLFLOW_PORT = int(os.environ.get("MLFLOW_PORT", "5111"))
REVIEW_SETTINGS = {"lab_size": "tiny", "lab_sft_steps": 30, "steps_per_round": 2, "batch_size": 4,
                   "heldout_size": 12, "max_tokens": 6, "gate_tolerance": 0.5, "promotion": "review"}


def build_review_home(home: Path) -> None:
    """A lab loop in review mode: round 1 approved in the registry and deployed, round 2 pending."""
    from dagster import DagsterInstance, build_sensor_context

    from prodrl_pipelines.lab.demo import run_loop
    from prodrl_pipelines.sensors import registry_sensor
    from prodrl_pipelines.loop.lineage import CHAMPION

    run_loop(home, REVIEW_SETTINGS, rounds=1)  # bootstrap, round 1 -> pending
    from prodrl_pipelines.definitions import build_definitions
    from prodrl_pipelines.resources.settings import make_resources, open_services

    res = make_resources({**REVIEW_SETTINGS, "home": str(home)})
    defs = build_definitions(res)
    instance = DagsterInstance.get()
    lineage = open_services(res["settings"], res["store"], res["mlflow"]).lineage
    lineage.tag_version("2", {"review_by": "reviewer"})
    lineage.client.set_registered_model_alias(lineage.model_name, CHAMPION, "2")  # approve as in the UI
    tick = registry_sensor(build_sensor_context(instance=instance, definitions=defs, resources=res))
    req = tick.run_requests[0]
    assert defs.resolve_job_def("registry_decision").execute_in_process(
        instance=instance, partition_key=req.partition_key, tags=req.tags).success
    run_loop(home, REVIEW_SETTINGS, rounds=1)  # round 2 -> pending


def serve(cmd: list[str], env: dict, url: str, what: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(120):
        try:
            urllib.request.urlopen(url, timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    os.killpg(proc.pid, signal.SIGTERM)
    raise SystemExit(f"{what} did not come up")


def dagster_env(home: Path) -> dict:
    return {**os.environ, "DAGSTER_HOME": str(home / "dagster_home"), "PRODRL_HOME": str(home),
            "PRODRL_SETTINGS_JSON": (home / "settings.json").read_text(), "MLFLOW_UI_URL": f"http://127.0.0.1:{MLFLOW_PORT}"}


def capture(shots: list[tuple[str, str]], out: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 900})
        for name, url in shots:
            # the MLflow UI keeps polling its server, so it never goes network-idle
            page.goto(url, wait_until="load" if "#/models" in url else "networkidle")
            page.wait_for_timeout(3000)
            for name_ in ("Skip", "Close"):  # Dagster's first-visit dialog, MLflow's assistant panel
                button = page.get_by_role("button", name=name_)
                if button.count():
                    button.first.click()
            page.wait_for_timeout(1500)
            page.screenshot(path=str(out / name))
            print("wrote", out / name)
        browser.close()


def demo_shots(home: Path, base: str, web_cmd: list[str], out: Path) -> None:
    web = serve(web_cmd, dagster_env(home), f"{base}/server_info", "dagster-webserver")
    try:
        rounds = sorted(json.loads((home / "summary.json").read_text())["rounds"], key=lambda r: r["round"])
        last = f"round-{rounds[-1]['round']:06d}"
        capture([("asset_graph.png", f"{base}/locations/prodrl_pipelines.definitions/asset-groups/prod_rl_round"),
                 ("round_partitions.png", f"{base}/assets/heldout_eval?view=partitions&partition={last}")], out)
    finally:
        os.killpg(web.pid, signal.SIGTERM)
        web.wait(timeout=30)


def main() -> int:
    args = sys.argv[1:]
    review_home = None
    if "--review" in args:
        i = args.index("--review")
        review_home = Path(args[i + 1]).resolve()
        args = args[:i] + args[i + 2:]
    home = Path(args[0] if args else "runs/demo").resolve()
    out = Path(__file__).resolve().parents[1] / "docs"
    out.mkdir(exist_ok=True)
    base = f"http://127.0.0.1:{PORT}"
    web_cmd = [sys.executable, "-m", "dagster_webserver", "-m", "prodrl_pipelines.definitions", "-h", "127.0.0.1",
               "-p", str(PORT)]
    if not (home / "summary.json").exists():
        print(f"{home} holds no demo run (make demo): its screenshots are skipped")
    else:
        demo_shots(home, base, web_cmd, out)
    if review_home is None:
        return 0
    if not (review_home / "settings.json").exists():
        build_review_home(review_home)
    ml = f"http://127.0.0.1:{MLFLOW_PORT}"
    mlflow = serve([str(Path(sys.executable).parent / "mlflow"), "ui", "--backend-store-uri", f"sqlite:///{review_home / 'mlflow.db'}",
                    "--host", "127.0.0.1", "--port", str(MLFLOW_PORT)], dict(os.environ), f"{ml}/health", "mlflow ui")
    web = serve(web_cmd, dagster_env(review_home), f"{base}/server_info", "dagster-webserver")
    try:
        capture([("review_registry.png", f"{ml}/#/models/prodrl-policy"),
                 ("review_pending_version.png", f"{ml}/#/models/prodrl-policy/versions/3"),
                 ("review_waiting_round.png", f"{base}/assets/heldout_eval?view=checks"),
                 ], out)
    finally:
        for proc in (web, mlflow):
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
