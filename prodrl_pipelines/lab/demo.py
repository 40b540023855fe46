"""The lab demo: the whole prod-RL loop on the lab model, driven in one process (``prodrl demo``).

Bootstrap (if needed), then per round: lab traffic through the live deployment (over loopback HTTP:
episodes -> ``prodrl record`` -> ``prodrl serve``, kept up across rounds and restarted when the live
version changes; ``PRODRL_LAB_TRAFFIC=in_process`` keeps the in-process path), a sensor tick, and
the round job. Its command is registered in ``lab.cli``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

DEMO_SETTINGS = {
    # Sized so 4+ rounds fit in a few minutes on 2 CPU cores (see README): S*B = 1024 episodes/round.
    "steps_per_round": 8, "batch_size": 128, "learning_rate": 1e-4,
    "heldout_size": 512, "max_tokens": 8,
}


# The demo prints its own one-line-per-step story; the full event log is in the Dagster instance.
QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


@contextmanager
def keeping_sigterm():
    """Run Dagster in-process and leave SIGTERM's disposition as it was. When Dagster's execution
    ends it maps SIGTERM to SIGINT's handler (``capture_interrupts``): in a process that ignores
    SIGINT (a shell's background job, a test worker) SIGTERM is then ignored, so ``kill`` stops this
    process no more and every server it starts afterwards inherits the ignored SIGTERM."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if before is not None:  # None: set outside Python, nothing to put back
            signal.signal(signal.SIGTERM, before)


def _use_home(home: Path, settings: dict) -> None:
    """Point Dagster (and a later `dagster dev` in this shell) at ``home``."""
    home = home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    from prodrl_pipelines.config import environment

    os.environ.update(environment.write(settings={**settings, "home": str(home)}, home=str(home)))
    (home / "settings.json").write_text(json.dumps({**settings, "home": str(home)}, indent=1))
    dh = home / "dagster_home"
    dh.mkdir(exist_ok=True)
    if os.environ.get("PRODRL_DAGSTER_HOME"):  # e.g. this repo, whose dagster.yaml uses PostgreSQL
        os.environ["DAGSTER_HOME"] = str(Path(os.environ["PRODRL_DAGSTER_HOME"]).resolve())
        if os.environ.get("DAGSTER_PG_URL"):
            from prodrl_pipelines.config.preflight import check_postgres

            check_postgres(os.environ["DAGSTER_PG_URL"], "DAGSTER_PG_URL")
    else:  # embedded default: SQLite under the run's own DAGSTER_HOME
        os.environ["DAGSTER_HOME"] = str(dh)
        (dh / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")


def run_loop(home: Path, settings: dict, rounds: int, log=print, instance=None, via: str | None = None) -> list[dict]:
    """Bootstrap (if needed), then per round: serve traffic, tick the sensor, run the round.

    ``via``: how lab traffic reaches the deployment (``lab.http_traffic.TRAFFIC_MODES``); default
    ``$PRODRL_LAB_TRAFFIC``, else ``http``."""
    _use_home(home, settings)
    from dagster import DagsterInstance

    from prodrl_pipelines.definitions import build_definitions
    from prodrl_pipelines.resources.settings import make_resources, open_services

    from prodrl_pipelines.config import environment

    # the demo's files live in its home; its store is S3 where the environment names a bucket
    # (PRODRL_S3_*), as a cluster whose nodes do not share this disk needs
    s3 = {k: v for k, v in environment.read_store().items() if k != "root"}
    res = make_resources({**settings, "home": str(home)}, s3=s3 if s3.get("s3_bucket") else None)
    defs = build_definitions(res)
    instance = instance or DagsterInstance.get()
    svc = open_services(res["settings"], res["store"])
    s = svc.settings
    if svc.ledger.live() is None:
        t0 = time.time()
        log(f"round 0 from base_model={s.base_model!r} (the lab: tokenizer, model, SFT warm start) ...")
        with keeping_sigterm():
            defs.resolve_job_def("bootstrap").execute_in_process(instance=instance, run_config=QUIET)
        log(f"  base policy ready in {time.time() - t0:.0f}s, held-out reward "
            f"{svc.ledger.round_summary('round-000000').get('heldout_reward', float('nan')):.3f}")

    from prodrl_pipelines.lab.http_traffic import LabDeployment, traffic_mode

    via = traffic_mode(via)
    managed = s.deploy.target != "pointer"  # the deploy target serves: the lab only records in front
    if managed:
        from prodrl_pipelines.deploy_targets.endpoint_store import endpoint_location

        via = via if via.startswith("http") else "http"
        lab_dep = LabDeployment(home / "logs" / "lab_traffic", follow=endpoint_location(s.home_path, s.deploy))
    else:
        lab_dep = LabDeployment(home / "logs" / "lab_traffic") if via.startswith("http") else None
    try:
        return _run_rounds(defs, instance, res, svc, s, rounds, log, via, lab_dep)
    finally:
        if lab_dep is not None:
            lab_dep.stop()
        if managed:
            from prodrl_pipelines.deploy_targets import make_target

            target = make_target(s)
            if hasattr(target, "stop"):
                target.stop()  # the demo's servers end with it (a production deployment would stay)


def _run_rounds(defs, instance, res, svc, s, rounds: int, log, via: str, lab_dep) -> list[dict]:
    from dagster import build_sensor_context

    from prodrl_pipelines.loop.round_state import round_index
    from prodrl_pipelines.lab.traffic import simulate_traffic
    from prodrl_pipelines.sensors import data_volume_sensor

    for _ in range(rounds):
        t0 = time.time()
        existing = instance.get_dynamic_partitions("rounds")
        latest = max(existing, key=round_index) if existing else None
        if latest and svc.ledger.decision(latest) is None:
            log(f"{latest}: unfinished (crashed or interrupted) -> resuming it")
            run_round(defs, instance, latest, {})
            continue
        if latest and svc.ledger.decision(latest).get("review") == "pending":  # promotion: review
            log(f"{latest}: awaits review in the MLflow registry (`prodrl review list`); the loop waits for it")
            break
        if s.recipe.max_policy_lag >= 1:
            # One-round async (DESIGN.md s.5), played in sequence: the live policy mu_k serves the
            # S*B episodes it collects while round k trains on the oldest eligible data, mu_{k-1}'s,
            # collected during round k-1. Before the first round mu_0 also serves a warm-up batch.
            live = svc.ledger.live().policy_version
            n = s.recipe.trajectories_per_round * (2 if latest is None else 1)
            log(f"async: {live} serves {n} lab episodes while the next round trains ({via})")
            simulate_traffic(svc, n, via=via, deployment=lab_dep)
        ctx = build_sensor_context(instance=instance, definitions=defs, resources=res)
        key, reason = None, ""
        for _attempt in range(3):
            result = data_volume_sensor(ctx)
            if getattr(result, "run_requests", None):
                break
            reason = getattr(result, "skip_message", str(result))
            live = svc.ledger.live().policy_version
            log(f"sensor: {reason} -> serving {s.recipe.trajectories_per_round} lab episodes from {live} ({via})")
            simulate_traffic(svc, s.recipe.trajectories_per_round, via=via, deployment=lab_dep)
        else:
            raise RuntimeError(f"sensor never requested a round: {reason}")
        for req in result.dynamic_partitions_requests:
            instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
        key = result.run_requests[0].partition_key
        log(f"{key}: running the round job")
        summ = run_round(defs, instance, key, result.run_requests[0].tags)
        log(f"{key}: done in {time.time() - t0:.0f}s; held-out {summ.get('heldout_reward', float('nan')):.3f}, "
            f"gate {'passed' if summ['gate_passed'] else 'FAILED'}")
    return summary_rows(svc)


def run_round(defs, instance, key: str, tags: dict) -> dict:
    """Execute the round job for one partition; returns the round's summary once the gate decided."""
    from prodrl_pipelines.resources.settings import open_services

    with keeping_sigterm():
        out = defs.resolve_job_def("prod_rl_round").execute_in_process(
            instance=instance, partition_key=key, raise_on_error=False, tags=tags, run_config=QUIET)
    res = defs.resources
    summ = open_services(res["settings"], res["store"]).ledger.round_summary(key)
    if "gate_passed" not in summ:
        errors = [f"{e.step_key}: {e.event_specific_data.error.message.strip().splitlines()[-1]}"
                  for e in out.get_step_failure_events()]
        raise RuntimeError(f"{key} failed before the gate decided (Dagster run {out.run_id}): " + "; ".join(errors))
    return summ


def summary_rows(svc) -> list[dict]:
    rows, live = [], None
    for h in svc.ledger.round_summaries():
        if h.get("deployed"):
            live = h.get("policy_version", live)
        rows.append({
            "round": h["round"], "heldout_reward": h.get("heldout_reward"),
            "heldout_reward_ci": h.get("heldout_reward_ci"), "gate_passed": h.get("gate_passed"),
            "deployed": bool(h.get("deployed")), "policy_version": live,
            "num_trajectories": h.get("num_trajectories", 0), "mismatch_abs_logp": h.get("mismatch_abs_logp"),
            "mlflow_run_id": h.get("mlflow_run_id"),
            # the deploy's parity probe, when the round deployed through one
            "probe_mean_abs": h.get("probe_mean_abs"), "probe_p99_abs": h.get("probe_p99_abs"),
            "deploy_seconds": h.get("deploy_seconds"),
        })
    return rows


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="prod RL rounds")
    for c in ("round", "trajectories", "held-out reward", "mismatch |logpi_k-logmu|", "gate", "deployed?", "live policy"):
        t.add_column(c)
    for r in rows:
        hr = "-" if r["heldout_reward"] is None else f"{r['heldout_reward']:.3f} ± {r['heldout_reward_ci']:.3f}"
        mm = "-" if r["mismatch_abs_logp"] is None else f"{r['mismatch_abs_logp']:.4f}"
        gate = "base" if r["round"] == 0 else ("passed" if r["gate_passed"] else "failed")
        t.add_row(str(r["round"]), str(r["num_trajectories"]), hr, mm, gate, "yes" if r["deployed"] else "no",
                  str(r["policy_version"]))
    Console(width=140).print(t)


# `prodrl demo --engine vllm`: the deployment is a real vLLM (CPU build), restarted on every deploy,
# serving the bf16 export (vLLM's NVFP4 MoE kernels are GPU-only): its bf16 kernels against the fp32
# trainer are the seed's engine mismatch.
VLLM_DEMO_SETTINGS = {"target": "vllm-restart", "export_scheme": "bf16",
                      "server_args": ["--max-model-len", "256", "--max-num-seqs", "32", "--max-num-batched-tokens", "1024", "--enforce-eager"]}


def engine_settings(engine: str) -> dict:
    return {} if engine == "local" else dict(VLLM_DEMO_SETTINGS)  # vLLM: environment.vllm_python()


def cmd_demo(args) -> int:
    settings = {**DEMO_SETTINGS, **engine_settings(args.engine)}
    if args.settings:
        settings.update(json.loads(Path(args.settings).read_text()))
    home = Path(args.runs_dir).resolve() / args.name
    t0 = time.time()
    rows = run_loop(home, settings, args.rounds)
    print_table(rows)
    out = home / "summary.json"
    from prodrl_pipelines.lab.http_traffic import TRAFFIC_ENV, traffic_mode
    from prodrl_pipelines.lab.provenance import provenance

    prov = provenance(sys.argv[1:])
    if os.environ.get(TRAFFIC_ENV):  # how the traffic was served decides whether a rerun reproduces it
        prov["command"] = f"{TRAFFIC_ENV}={os.environ[TRAFFIC_ENV]} {prov['command']}"
    out.write_text(json.dumps({**prov, "name": args.name, "engine": args.engine, "traffic": traffic_mode(),
                               "settings": settings, "seconds": round(time.time() - t0, 1), "rounds": rows},
                              indent=1))
    print(f"wrote {out} ({time.time() - t0:.0f}s). Browse: DAGSTER_HOME={os.environ['DAGSTER_HOME']} "
          f"PRODRL_HOME={home} dagster dev; mlflow ui --backend-store-uri sqlite:///{home / 'mlflow.db'}")
    return 0
