"""Faults of several hosts under recorder traffic, on simulated hosts (``cluster/hosts.py``; root).

    python bench/hosts.py [--hosts 5] [--fault-s 30]

h1 runs the recorder, following the endpoint record of two replicas in PostgreSQL
(``deploy.endpoint_store``: written from h5), its store on S3 and its WAL on its own disk; h2 and
h3 a ``prodrl serve`` replica each (a tiny lab policy); h4 the S3 endpoint (moto) and PostgreSQL;
h5 three clients calling back to back (``cluster/traffic.py``). Each fault runs under that
traffic for ``--fault-s`` seconds, then is undone, and the traffic goes on until it has answered as
many calls again:

- **partition**: the traffic between h1 and h3 is dropped (packets vanish: connections time out),
  then healed;
- **host loss**: h3 is powered off (its link drops, its processes die with it), then booted empty and
  its server started again;
- **s3 outage**: h4's link is cut (the recorder keeps answering: rows wait in its WAL), then restored;
- **pg restart**: PostgreSQL on h4 is stopped (fast shutdown: connections cut), then started again
  (the recorder routes on the last endpoint record it read meanwhile).

``failed``: calls the clients saw fail during the fault's traffic; ``lost``: its acknowledged calls
that are not in the store once the recorder has stopped (SIGTERM: it flushes).

- **redeploy**: a Ray head on h2 and a worker on h3; h1 (no raylet) deploys a Ray-placed fleet of two
  replicas through Ray Client (``cluster/fleet_driver.py``, the export fetched from S3 by the nodes),
  then rolls it v1 -> v2 under traffic through a recorder on h1 following its endpoint file:
  ``failed``, and ``capacity`` (answered calls per second during the rollout over the
  ``--fault-s`` steady seconds before it).

- **round from raylet-less dagster**: on the same Ray cluster, h1 (no raylet) bootstraps the lab policy
  and runs one round as Dagster's run worker does (``cluster/host_services.round_from_host``: its
  Dagster instance in PostgreSQL on h4, its store on h4's S3 endpoint): training ranks on h2 and h3,
  evaluation and scoring as Ray jobs, the fleet placed on h2 and h3 and rolled to the round's
  version. ``ok`` when all of that is read back (``fleet_driver round-report``), else what was not.

Last line:

``hosts: hosts=N; round from raylet-less dagster=X; redeploy failed=X capacity=Y; partition failed=X lost=Z; host loss failed=X lost=Z; pg restart lost=Z; s3 outage lost=Z``

Smoke size (``--smoke``, bench/_smoke.py): 3 s faults, 10 calls before and after each, no redeploy
and no round (with the redeploy the smoke run took ~105 s on a quiet machine and 337 s beside a full
test run, without it ~35 s quiet; ``tests/test_hosts.py`` deploys the same fleet and runs the same
round from the same raylet-less host).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _smoke import parse_args  # noqa: E402

from prodrl_pipelines.cluster import hosts as simhosts  # noqa: E402
from prodrl_pipelines.cluster.host_services import HostPostgres, start_ray  # noqa: E402

PRODRL = str(Path(sys.executable).with_name("prodrl"))
MOTO = str(Path(sys.executable).with_name("moto_server"))
CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
         "AWS_EC2_METADATA_DISABLED": "true"}
TOKEN = "bench-token"


def env() -> dict:
    import os

    drop = ("RAY_ADDRESS", "PRODRL_SETTINGS_JSON", "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **CREDS}


def until(what: str, cond, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"hosts bench: not within {timeout_s:.0f}s: {what}")
        time.sleep(0.2)


def answers(host: simhosts.Host, url: str, *headers: str) -> bool:
    args = [a for h in headers for a in ("-H", h)]
    return host.run(["curl", "-s", "-m", "3", "-o", "/dev/null", "-w", "%{http_code}", *args, url]).stdout == "200"


class Traffic:
    """Clients on ``host`` through the recorder; ``answered()`` so far; ``stop()`` -> the result file."""

    def __init__(self, host: simhosts.Host, recorder: str, name: str) -> None:
        self.dir_in, self.dir_out = f"/tmp/{name}", host.tmp / name
        self.dir_out.mkdir()
        self.proc = host.popen([sys.executable, "-m", "prodrl_pipelines.cluster.traffic", recorder, TOKEN,
                                self.dir_in, "3"], env=env(), log=host.tmp / f"{name}.log")

    def answered(self) -> int:
        try:
            return int((self.dir_out / "progress").read_text() or 0)
        except (OSError, ValueError):
            return 0

    def stop(self) -> dict:
        (self.dir_out / "stop").write_text("")
        self.proc.wait(900)
        return json.loads((self.dir_out / "result.json").read_text())


SEEN = ("replica_health_failures", "upstream_connect_timeouts", "upstream_replica_refused", "upstream_retries",
        "upstream_timeouts")


def counters(host: simhosts.Host, recorder: str) -> dict:
    res = host.run(["curl", "-s", "-m", "10", "-H", f"Authorization: Bearer {TOKEN}", f"{recorder}/stats"])
    try:
        c = json.loads(res.stdout).get("counters", {})
    except ValueError:
        return {}
    return {k: c.get(k, 0) for k in SEEN}


def under_traffic(hs, recorder: str, name: str, calls: int, fault, undo, fault_s: float) -> tuple[dict, dict]:
    """The traffic's result and what the recorder counted meanwhile (``SEEN``)."""
    before = counters(hs[5], recorder)
    t = Traffic(hs[5], recorder, name)
    until(f"{name}: calls before the fault", lambda: t.answered() >= calls)
    fault()
    time.sleep(fault_s)  # the fault's length is the bench's parameter, not a wait for an event
    undo()
    again = t.answered()
    until(f"{name}: calls after the fault", lambda: t.answered() >= again + calls)
    res = t.stop()
    after = counters(hs[5], recorder)
    return res, {k: after.get(k, 0) - before.get(k, 0) for k in SEEN if after.get(k, 0) - before.get(k, 0)}


def redeploy(hs, dashboard: str, export: Path, s3: str, steady_s: float, calls: int) -> str:
    """A Ray-placed fleet (head on h2, worker on h3) rolled out v1 -> v2 from h1, which runs no raylet,
    under traffic through a recorder on h1 that follows its endpoint file: ``failed=X capacity=Y``
    (capacity: answered calls per second during the rollout over the ``steady_s`` just before it)."""
    h1, h5 = hs[1], hs[5]
    driver = {**env(), "PRODRL_S3_BUCKET": "exports", "PRODRL_S3_ENDPOINT_URL": s3,
              "PRODRL_SETTINGS_JSON": json.dumps({"cluster": "ray", "cluster_address": dashboard})}

    def fleet(*args: str) -> dict:
        res = h1.run([sys.executable, "-m", "prodrl_pipelines.cluster.fleet_driver", *args], env=driver, timeout=900)
        if res.returncode != 0:
            raise SystemExit(f"hosts bench: fleet {args} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
        return json.loads(res.stdout.strip().splitlines()[-1])

    for n in (1, 2):
        shutil.copytree(export, h1.tmp / "exports" / f"round-00000{n}")
    fleet("deploy", "/tmp/home", "/tmp/exports/round-000001", "v1")
    rec = h1.popen([PRODRL, "record", "--follow", "/tmp/home/deployment/endpoint.json", "--store", "/tmp/store2",
                    "--host", h1.address, "--port", "9101", "--upstream-timeout", "30"],
                   env={**env(), "PRODRL_RECORDER_TOKEN": TOKEN}, log=h1.tmp / "record2.log")
    recorder = f"http://{h1.address}:9101"
    until("the fleet's recorder", lambda: answers(h5, f"{recorder}/health", f"Authorization: Bearer {TOKEN}"))
    t = Traffic(h5, recorder, "redeploy")
    try:
        until("calls before the redeploy", lambda: t.answered() >= calls)
        n0, t0 = t.answered(), time.monotonic()
        time.sleep(steady_s)  # the steady window the rollout is compared with (a length, not an event)
        steady = (t.answered() - n0) / (time.monotonic() - t0)
        n1, t1 = t.answered(), time.monotonic()
        fleet("deploy", "/tmp/home", "/tmp/exports/round-000002", "v2")
        during = (t.answered() - n1) / (time.monotonic() - t1)
    finally:
        res = t.stop()
        rec.stop()
        fleet("stop", "/tmp/home")
    versions = sorted({v for _, _, v, _ in res["acked"]})
    print(f"redeploy: {len(res['acked'])} calls answered ({versions}), {len(res['failed'])} failed; "
          f"{steady:.1f} calls/s steady, {during:.1f} during the rollout", flush=True)
    return f"{len(res['failed'])} capacity={during / steady:.2f}" if steady > 0 else f"{len(res['failed'])} capacity=0"


def round_from(hs, dashboard: str, s3: str, pg: HostPostgres) -> str:
    """``ok`` when h1's round ran where the topology puts each step, else what did not."""
    from prodrl_pipelines.cluster.host_services import round_from_host

    try:
        got = round_from_host(hs[1], {**env(), "PRODRL_S3_ENDPOINT_URL": s3, "PRODRL_S3_PREFIX": "prod",
                                      "PRODRL_DEPLOY_API_KEY": "bench-deploy-key"}, dashboard, pg.url)
    except RuntimeError as e:
        print(f"round: {e}", flush=True)
        return "failed"
    expected = {"train on h2 and h3": got["train_hosts"] == ["h2", "h3"],
                "no raylet on h1": got["raylet_here"] is False,
                "deployed": bool(got["decision"].get("deployed")) and got["live"] == "round-000001",
                "replicas on h2 and h3": sorted(u.split("//")[1].split(":")[0] for u in got["replicas"])
                == sorted([hs[2].address, hs[3].address]),
                **{f"{step} job": f"prodrl-{step}-round-000001:SUCCEEDED" in got["jobs"]
                   for step in ("train", "eval", "score")}}
    print(f"round: {got['seconds']:.0f} s on h1; {json.dumps({k: got[k] for k in ('train_hosts', 'decision', 'jobs')})}",
          flush=True)
    missing = [k for k, ok in expected.items() if not ok]
    return "ok" if not missing else "failed(" + ",".join(m.replace(" ", "-") for m in missing) + ")"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=5)
    ap.add_argument("--fault-s", type=float, default=30.0, help="how long each fault lasts")
    ap.add_argument("--calls", type=int, default=60, help="calls answered before each fault, and again after it")
    ap.add_argument("--no-redeploy", dest="redeploy", action="store_false",
                    help="skip the Ray-placed redeploy (printed not-run)")
    ap.add_argument("--no-round", dest="round", action="store_false",
                    help="skip the round from the raylet-less host (printed not-run)")
    a = parse_args(ap, argv, fault_s=3.0, calls=10, redeploy=False, round=False)
    if a.hosts < 5:
        ap.error("--hosts: at least 5 (recorder, two replicas, S3, clients)")
    why = simhosts.unavailable()
    if why:
        print(f"skipped: simulated hosts unavailable: {why}")
        return 0
    from prodrl_pipelines.lab.warmstart import build_base_policy
    from prodrl_pipelines.quant.export import export_policy

    work = Path(tempfile.mkdtemp(prefix="bench-hosts-"))
    export = work / "export"
    export_policy(build_base_policy(work / "base", size="tiny", sft_steps=5, progress=False), export, "bf16")
    out: dict[str, str] = {"round from raylet-less dagster": "not-run"}
    with simhosts.SimulatedHosts(a.hosts, work / "hosts") as hs:
        h1, h2, h3, h4, h5 = hs[1], hs[2], hs[3], hs[4], hs[5]
        s3 = f"http://{h4.address}:9000"
        h4.popen([MOTO, "-H", h4.address, "-p", "9000"], env=env(), log=h4.tmp / "moto.log")
        until("the S3 endpoint", lambda: h5.run(["curl", "-s", "-m", "3", "-o", "/dev/null", s3]).returncode == 0)
        h5.run([sys.executable, "-c", "import boto3, sys; boto3.client('s3', endpoint_url=sys.argv[1], "
                "region_name='us-east-1').create_bucket(Bucket='trajectories')", s3], env=env(), check=True)

        servers = []

        def serve(h: simhosts.Host) -> None:
            shutil.copytree(export, h.tmp / "export", dirs_exist_ok=True)
            servers.append(h.popen([PRODRL, "serve", "/tmp/export", "--host", h.address, "--port", "8000",
                                    "--served-model-name", "v1"], env=env(), log=h.tmp / "serve.log"))
            until(f"the replica on {h.name}", lambda: answers(h5, f"http://{h.address}:8000/health"))

        for h in (h2, h3):
            serve(h)
        urls = [f"http://{h.address}:8000" for h in (h2, h3)]
        pg = HostPostgres(h4).init()
        where = f"{pg.url}#bench"
        h5.run([sys.executable, "-m", "prodrl_pipelines.cluster.fleet_driver", "endpoint", where, "v1", json.dumps(urls)],
               env=env(), check=True)
        recorder_proc = h1.popen([PRODRL, "record", "--follow", where, "--s3-bucket",
                                  "trajectories", "--s3-endpoint-url", s3, "--wal-dir", "/tmp/wal", "--host", h1.address,
                                  "--port", "9100", "--upstream-timeout", "30"],
                                 env={**env(), "PRODRL_RECORDER_TOKEN": TOKEN}, log=h1.tmp / "record.log")
        recorder = f"http://{h1.address}:9100"
        until("the recorder", lambda: answers(h5, f"{recorder}/health", f"Authorization: Bearer {TOKEN}"))

        results, seen = {}, {}
        for name, fault, undo in (("partition", lambda: hs.partition(h1, h3), lambda: hs.heal(h1, h3)),
                                  ("host loss", h3.power_off, lambda: (h3.boot(), serve(h3))),
                                  ("s3 outage", h4.cut, h4.restore),
                                  ("pg restart", pg.stop, pg.start)):
            results[name], seen[name] = under_traffic(hs, recorder, name.replace(" ", "_"), a.calls, fault, undo,
                                                      a.fault_s)
        recorder_proc.stop(grace_s=300)  # SIGTERM: what it acknowledged is flushed to the store
        for name, res in results.items():
            d = name.replace(" ", "_")
            check = h5.run([sys.executable, "-m", "prodrl_pipelines.cluster.traffic", "stored", f"/tmp/{d}/result.json",
                            "--s3-bucket", "trajectories", "--s3-endpoint-url", s3], env=env(), timeout=600, check=True)
            kept = json.loads(check.stdout.strip().splitlines()[-1])
            print(f"{name}: {len(res['acked'])} calls answered, {len(res['failed'])} failed "
                  f"({[f[2][:80] for f in res['failed'][:3]]}); acknowledged {kept['acked']}, lost {kept['lost']}, "
                  f"stored twice {kept['twice']}; recorder: {seen[name]}", flush=True)
            failed = f"failed={len(res['failed'])} " if name in ("partition", "host loss") else ""
            out[f"{name} " + ("failed" if failed else "lost")] = (f"{len(res['failed'])} lost={kept['lost']}"
                                                                  if failed else str(kept["lost"]))
        for p in servers:
            p.stop()
        out["redeploy failed"] = "not-run capacity=not-run"
        if a.redeploy or a.round:
            dashboard, _ = start_ray(h2, [h3], {**env(), "PRODRL_NODE_CACHE": "/tmp/node-exports"})
            if a.redeploy:
                out["redeploy failed"] = redeploy(hs, dashboard, export, s3, a.fault_s, a.calls)
            if a.round:
                out["round from raylet-less dagster"] = round_from(hs, dashboard, s3, pg)
    shutil.rmtree(work, ignore_errors=True)
    print(f"hosts: hosts={a.hosts}; round from raylet-less dagster={out['round from raylet-less dagster']}; "
          f"redeploy failed={out['redeploy failed']}; partition failed={out['partition failed']}; "
          f"host loss failed={out['host loss failed']}; pg restart lost={out['pg restart lost']}; "
          f"s3 outage lost={out['s3 outage lost']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
