"""Screenshots of the Dagster UI on a real run, for the README (issue 6).

    python scripts/ui_screenshots.py runs/demo   # writes docs/asset_graph.png, docs/round_partitions.png

Starts `dagster-webserver` on the run's instance, drives Debian's Chromium (headless) with
Playwright, dismisses the first-visit dialog, saves the pages, and stops the webserver.
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


def main() -> int:
    home = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/demo").resolve()
    out = Path(__file__).resolve().parents[1] / "docs"
    out.mkdir(exist_ok=True)
    env = {**os.environ, "DAGSTER_HOME": str(home / "dagster_home"), "PRODRL_HOME": str(home),
           "PRODRL_SETTINGS_JSON": (home / "settings.json").read_text()}
    web = subprocess.Popen([sys.executable, "-m", "dagster_webserver", "-m", "prodrl_pipelines.definitions",
                            "-h", "127.0.0.1", "-p", str(PORT)], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{PORT}"
        for _ in range(120):
            try:
                json.load(urllib.request.urlopen(f"{base}/server_info", timeout=2))
                break
            except OSError:
                time.sleep(1)
        else:
            raise SystemExit("dagster-webserver did not come up")
        from playwright.sync_api import sync_playwright

        rounds = sorted(json.loads((home / "summary.json").read_text())["rounds"], key=lambda r: r["round"])
        last = f"round-{rounds[-1]['round']:06d}"
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1500, "height": 900})
            shots = [
                ("asset_graph.png", "/locations/prodrl_pipelines.definitions/asset-groups/prod_rl_round"),
                ("round_partitions.png", f"/assets/heldout_eval?view=partitions&partition={last}"),
            ]
            for name, path in shots:
                page.goto(base + path, wait_until="networkidle")
                skip = page.get_by_role("button", name="Skip")
                if skip.count():
                    skip.first.click()
                page.wait_for_timeout(2500)
                page.screenshot(path=str(out / name))
                print("wrote", out / name)
            browser.close()
    finally:
        os.killpg(web.pid, signal.SIGTERM)
        web.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
