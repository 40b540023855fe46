"""`make up` exactly as the README shows it, on a database created for this test, driven over HTTP only.

The stack (S3 endpoint, MLflow server, Dagster webserver + daemon, `prodrl serve` + `prodrl record`,
first with `CLUSTER=ray`: a local two-node Ray cluster for the rounds' training, evaluation and
scoring) is started by the Makefile target; the test bootstraps through the webserver's GraphQL API, plays lab
episodes through the recorder with the official `openai` client, posts rewards, waits for the
daemon's sensor to run a round to its gate decision, reads the registry through MLflow's REST API,
stops the stack with Ctrl-C (SIGINT to the terminal's process group) and checks that no process it
started is left. Then it starts the stack again on the same home and database, without Ray: the previous round
is there, the deployment serves the live version, and new traffic is recorded.
"""

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psycopg2
import pytest
from dagster_graphql import DagsterGraphQLClient
from openai import OpenAI

from prodrl_pipelines.lab.tasks import ARITHMETIC
from prodrl_pipelines.config.preflight import libpq_dsn

from conftest import PG_URL, REPO
from prometheus_support import PrometheusServer
from test_observability_docs import dashboard_queries
from prodrl_pipelines.deploy_targets.processes import pick_port
from prodrl_pipelines.stack.prometheus_config import config_text

RUNS = """query($name: String!) { runsOrError(filter: {pipelineName: $name}) {
  ... on Runs { results { runId status tags { key value } } } } }"""
MATS = """query($key: AssetKeyInput!) { assetOrError(assetKey: $key) { ... on Asset {
  assetMaterializations { partition } } } }"""


def _db_url(name: str) -> str:
    return PG_URL.rsplit("/", 1)[0] + "/" + name


def _admin(sql: str) -> None:
    conn = psycopg2.connect(libpq_dsn(PG_URL))
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(sql)
    conn.close()


@pytest.fixture
def fresh_database():
    name = f"prodrl_up_{os.getpid()}"
    _admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    _admin(f"CREATE DATABASE {name}")
    yield _db_url(name)
    _admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


class MakeUp:
    """`make up` in a process group of its own, as a terminal would run it."""

    def __init__(self, home: Path, db_url: str, log: Path, settings: Path | None = None, cluster: str = "local"):
        self.home, self.log = home, log
        env = {**os.environ, "DAGSTER_PG_URL": db_url}
        for k in ("DAGSTER_HOME", "PRODRL_HOME", "PRODRL_SETTINGS_JSON", "MLFLOW_TRACKING_URI", "PRODRL_RECORDER_TOKEN"):
            env.pop(k, None)
        (home / "stack.json").unlink(missing_ok=True)
        self.fh = open(log, "ab")
        extra = ([f"STACK_SETTINGS={settings}"] if settings else []) + [f"CLUSTER={cluster}"]
        self.proc = subprocess.Popen(["make", "up", f"STACK_HOME={home}", *extra], cwd=REPO, env=env, stdout=self.fh,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.t0 = time.monotonic()
        self.state = self.wait(lambda: self._state_if_up(), "the stack to come up", 600)  # a ceiling
        self.startup_s = time.monotonic() - self.t0

    def _state_if_up(self):
        p = self.home / "stack.json"
        return json.loads(p.read_text()) if p.exists() and "up in" in self.log.read_text() else None

    def wait(self, cond, what: str, timeout_s: float = 1200):  # generous: the stack shares 2 cores with the suite
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"make up exited with {self.proc.returncode} while waiting for {what}:\n"
                            f"{self.log.read_text()[-4000:]}")
            v = cond()
            if v:
                return v
            time.sleep(1)
        logs = {n: (self.home / "logs" / f"{n}.log").read_text(errors="replace")[-3000:]
                for n in ("daemon", "webserver", "serve", "record") if (self.home / "logs" / f"{n}.log").exists()}
        pytest.fail(f"timed out waiting for {what}; make up: {self.log.read_text()[-3000:]}; logs: {logs}; "
                    f"recorder: {self._recorder_stats()}")

    def _recorder_stats(self):
        """The recorder's counters (flushes, errors, calls) for a failure's message, if it answers."""
        try:
            token = (self.home / "recorder_token").read_text().strip()
            url = self.current_state()["urls"]["recorder"].removesuffix("/v1") + "/stats"
            return httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=30).json()
        except Exception as exc:  # noqa: BLE001 - only for the message
            return repr(exc)

    def current_state(self) -> dict:
        return json.loads((self.home / "stack.json").read_text())

    def kill(self) -> None:
        """After a failure: stop whatever is left (TERM to the stack, then KILL its services)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in self.current_state()["pids"].values() if (self.home / "stack.json").exists() else []:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, sig=signal.SIGINT) -> float:
        """Ctrl-C (or ``sig``) to the group, as a terminal sends it; returns the seconds it took."""
        pids = self.current_state()["pids"]
        t0 = time.monotonic()
        os.killpg(self.proc.pid, sig)
        # make dies of the signal once its recipe is done, as after a Ctrl-C in a terminal
        assert self.proc.wait(timeout=240) in (0, -sig), self.log.read_text()[-3000:]
        assert "\nstopped.\n" in self.log.read_text(), self.log.read_text()[-3000:]
        self.fh.close()
        left = _processes_in_sessions(set(pids.values()))
        assert not left, f"processes left after the stack stopped: {left}"
        return time.monotonic() - t0


def _processes_in_sessions(sids: set[int]) -> list[str]:
    """Live processes whose session is one the stack started (each service leads its own)."""
    left = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            state, sid = fields[0], int(fields[3])
            if sid in sids and state != "Z":
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")[:120]
                left.append(f"{d.name}: {cmd!r}")
        except (OSError, IndexError, ValueError):
            continue
    return left


def _rss_mb(pids: dict) -> dict:
    """Resident memory of each service with its children (its session), MB."""
    by_sid = {pid: name for name, pid in pids.items()}
    out: dict[str, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            sid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[3])
            if sid in by_sid:
                rss = [ln for ln in (d / "status").read_text().splitlines() if ln.startswith("VmRSS")]
                out[by_sid[sid]] = out.get(by_sid[sid], 0) + int(rss[0].split()[1]) // 1024
        except (OSError, IndexError, ValueError):
            continue
    return out


def _play(recorder: str, token: str, n: int, seed: int) -> tuple[str, int]:
    """``n`` arithmetic episodes through the recorder with the openai client, rewards posted after."""
    client = OpenAI(base_url=recorder, api_key=token, max_retries=0, timeout=120)
    model = client.models.list().data[0].id  # the served policy version
    tasks = ARITHMETIC.generate_tasks(n, seed)

    def episode(i):
        task, tid = tasks[i], f"up-{seed}-{i}"
        messages, texts = ARITHMETIC.initial_messages(task), []
        for turn in range(task.n_turns):
            r = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                               extra_headers={"X-Trajectory-Id": tid, "X-Task-Id": task.task_id})
            text = r.choices[0].message.content or ""
            texts.append(text)
            messages.append({"role": "assistant", "content": text})
            reply = ARITHMETIC.env_reply(task, turn, text)
            if reply is None:
                break
            messages.append(reply)
        return tid, ARITHMETIC.reward(task, texts)

    with ThreadPoolExecutor(16) as pool:
        done = list(pool.map(episode, range(n)))
    with httpx.Client(base_url=recorder.removesuffix("/v1"), headers={"Authorization": f"Bearer {token}"},
                      timeout=60) as http:
        for tid, reward in done:
            r = http.post("/v1/feedback", json={"trajectory_id": tid, "reward": reward, "source": "test/up"})
            assert r.status_code == 200, r.text
    return model, len(done)


class Background:
    """Chat calls through the recorder the whole time, one trajectory each: every failure is kept."""

    def __init__(self, recorder: str, token: str, model: str, workers: int = 2) -> None:
        self.client = OpenAI(base_url=recorder, api_key=token, max_retries=0, timeout=120)
        self.model, self.failures, self.sent, self.models = model, [], 0, set()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(workers)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            try:
                r = self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": f"{n % 7}+{i}="}], max_tokens=4,
                    extra_headers={"X-Trajectory-Id": f"bg-{i}-{n}"})
                self.models.add(r.model)
            except Exception as e:  # noqa: BLE001 - a failed call, whatever the reason
                self.failures.append(f"{type(e).__name__}: {e}")
            n += 1
            self.sent += 1
            time.sleep(1.0)  # steady, light: the round trains on the same two cores (each call costs CPU)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def _round_succeeded(gql, k: int):
    runs = gql._execute(RUNS, {"name": "prod_rl_round"})["runsOrError"]["results"]
    return [r for r in runs if r["status"] == "SUCCESS"
            and {"key": "dagster/partition", "value": f"round-{k:06d}"} in r["tags"]]


def _s3_object(endpoint: str, key: str) -> bytes:
    """An object of the stack's bucket, read over the S3 endpoint's HTTP API."""
    import boto3

    from prodrl_pipelines.stack.stack import S3_CREDENTIALS

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
    return client.get_object(Bucket="prodrl", Key=key)["Body"].read()


def _mlflow(url: str, path: str, **params) -> dict:
    r = httpx.get(f"{url}/api/2.0/mlflow/{path}", params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _prometheus_saw_the_stack(prom: PrometheusServer, up: MakeUp) -> None:
    """The stack's targets are up (the recorder, both replicas); the recorder's p99 added latency and
    round 1's trainer's last-step age answer; every dashboard query runs; the alert rules loaded."""
    def targets_up():
        jobs = [r["metric"]["job"] for r in prom.query('up{job=~"prodrl-recorder|prodrl-serve"} == 1')]
        return jobs.count("prodrl-recorder") == 1 and jobs.count("prodrl-serve") >= 2
    up.wait(targets_up, "Prometheus scraping the recorder and both replicas", 300)
    # a call answered by round 1's replicas (the background traffic saw one) reaches their counters
    up.wait(lambda: prom.query('sum(vllm:request_success_total{job="prodrl-serve"}) > 0'), "the replicas' counters", 300)
    p99 = prom.query("histogram_quantile(0.99, sum by (le) (rate(prodrl_recorder_added_latency_seconds_bucket[15m])))")
    assert len(p99) == 1 and float(p99[0]["value"][1]) >= 0, p99
    age = prom.query("time() - last_over_time(prodrl_trainer_last_step_timestamp_seconds[1h])")
    assert [r["metric"].get("job") for r in age] == ["prodrl-trainer"] and float(age[0]["value"][1]) >= 0, age
    steps = prom.query('last_over_time(prodrl_trainer_round_step[1h]) * on (instance) group_left(round) '
                       'last_over_time(prodrl_trainer_info[1h])')
    # its steps taken (of 2; a step without learning signal is skipped, not counted)
    assert [r["metric"]["round"] for r in steps] == ["round-000001"] and 0 <= float(steps[0]["value"][1]) <= 2, steps
    for q in dashboard_queries():
        prom.query(q)  # valid, and the series it names exist under these names
    rules = [r for g in httpx.get(prom.url + "/api/v1/rules", timeout=30).json()["data"]["groups"] for r in g["rules"]]
    assert len(rules) == 6 and all(r["health"] == "ok" for r in rules), rules


@pytest.mark.long(seconds=330)
def test_make_up_runs_the_loop_and_continues_after_a_restart(tmp_path, fresh_database):
    home = tmp_path / "stack"
    home.mkdir()
    started = []
    try:
        _loop_and_restart(home, tmp_path, fresh_database, started)
    finally:
        for up in started:
            up.kill()


def _loop_and_restart(home, tmp_path, fresh_database, started):
    figures = {}
    # the lab-demo settings at a small size (a round of 2 x 32 episodes, 32 held-out tasks, a base
    # warm-started for 40 steps, not the lab's 500: ~30 CPU-s less in bootstrap; what is tested is the
    # stack, not learning; the demo's size is make demo's)
    # with a gate every round passes: round 1 is redeployed under traffic
    settings = tmp_path / "stack-settings.json"
    settings.write_text(json.dumps({**json.loads((REPO / "examples" / "lab-demo.json").read_text()),
                                    "steps_per_round": 2, "batch_size": 32, "heldout_size": 32,
                                    "lab_sft_steps": 40, "gate_tolerance": 1.0,
                                    # rank 0 serves its gauges while a round trains, until scraped once more
                                    "observability_trainer_metrics_port": pick_port(),
                                    "observability_trainer_metrics_final_scrape_s": 300}))
    # with a local two-node Ray cluster: the rounds train, evaluate and score there as Ray jobs
    up = MakeUp(home, fresh_database, tmp_path / "make_up.log", settings, cluster="ray")
    started.append(up)
    # a real Prometheus scrapes the stack from the start: the stack's own scrape targets, every second
    assert (home / "prometheus" / "prometheus.yml").is_file() and "prometheus --config.file" in up.log.read_text()
    (tmp_path / "prometheus.yml").write_text(config_text(home, scrape_interval_s=1))
    prom = PrometheusServer(tmp_path / "prometheus.yml", tmp_path)
    started.append(prom)
    figures["startup_s"] = round(up.startup_s, 1)
    urls = up.state["urls"]
    assert f"Ray dashboard {urls['ray']}" in up.log.read_text() and "ray cluster" in up.state["pids"]
    assert httpx.get(urls["ray"] + "/api/version", timeout=60).status_code == 200  # the link answers
    nodes = httpx.get(urls["ray"] + "/nodes?view=summary", timeout=60).json()["data"]["summary"]
    assert len(nodes) == 2 and {n["raylet"]["nodeManagerAddress"] for n in nodes} == {"127.0.0.1"}, nodes
    assert up.state["schemas"] == {"dagster": "prodrl_dagster", "mlflow": "prodrl_mlflow"}
    token = (home / "recorder_token").read_text().strip()
    assert str(home / "recorder_token") in up.state["token_source"]
    printed = up.log.read_text()
    for url in (urls["dagster"], urls["mlflow"], urls["recorder"], urls["s3"]):
        assert url in printed
        assert httpx.get(url + ("/health" if url == urls["recorder"] else ""), timeout=60,
                         headers={"Authorization": f"Bearer {token}"}).status_code < 500, url  # answers from the start
    # before any policy is live the recorder says what to do next
    r = httpx.post(urls["recorder"] + "/chat/completions", headers={"Authorization": f"Bearer {token}"}, timeout=60,
                   json={"model": "any", "messages": [{"role": "user", "content": "1+1="}]})
    assert r.status_code == 503 and "bootstrap" in r.json()["error"]["message"], r.text
    gql = DagsterGraphQLClient(urls["dagster"].split("//")[1].split(":")[0], port_number=int(urls["dagster"].rsplit(":", 1)[1]))

    gql.submit_job_execution("bootstrap")
    up.wait(lambda: any(r["status"] == "SUCCESS" for r in
                        gql._execute(RUNS, {"name": "bootstrap"})["runsOrError"]["results"]), "bootstrap")
    up.wait(lambda: up.current_state()["deployed_version"] == "round-000000" and "prodrl record" in up.current_state()["pids"],
            "the deployment of round-000000")
    assert len([k for k in up.current_state()["pids"] if k.startswith("prodrl serve")]) == 2  # two replicas
    t_traffic = time.monotonic()
    background = Background(urls["recorder"], token, "round-000000")
    try:
        model, n = _play(urls["recorder"], token, 64, seed=1)
        assert model == "round-000000" and n == 64
        up.wait(lambda: _round_succeeded(gql, 1), "round 1 through the sensor")
        figures["traffic_to_decision_s"] = round(time.monotonic() - t_traffic, 1)
        up.wait(lambda: up.current_state()["deployed_version"] == "round-000001", "round 1 on every replica")
        # the background calls answered by round 1, however long a call takes on the loaded machine
        up.wait(lambda: "round-000001" in background.models or background.failures, "a call answered by round 1")
    finally:
        background.finish()
    # the rolling update of round 1 under steady traffic: no call failed, both versions answered
    assert not background.failures, background.failures[:5]
    assert background.models == {"round-000000", "round-000001"}, background.models
    # ... by replicas each owned by a Ray actor on the cluster (the old ones gone)
    from ray.util.state import list_actors

    def replica_hosts():
        return list_actors(address=urls["ray"], filters=[("class_name", "=", "ReplicaHost"), ("state", "=", "ALIVE")],
                           raise_on_missing_output=False)

    # an old replica's actor may still be stopping when the rollout has committed (a loaded machine)
    up.wait(lambda: len(replica_hosts()) <= 2, "the old replicas' actors gone", 300)
    hosts = replica_hosts()
    assert len(hosts) == 2, hosts
    figures["redeploy_calls"] = background.sent

    ml = urls["mlflow"]
    champion = _mlflow(ml, "registered-models/alias", name="prodrl-policy", alias="champion")["model_version"]
    challenger = _mlflow(ml, "registered-models/alias", name="prodrl-policy", alias="challenger")["model_version"]
    tags = {t["key"]: t["value"] for t in challenger.get("tags", [])}
    assert tags["prodrl.round"] == "round-000001" and tags["gate"] in ("passed", "failed")
    assert (tags.get("deployed") == "true") == (tags["gate"] == "passed")
    assert challenger["source"].startswith("s3://prodrl/")
    # round 1's training, held-out evaluation and scoring ran as Ray jobs; its ranks on both nodes
    jobs = httpx.get(urls["ray"] + "/api/jobs/", timeout=30).json()
    for step in ("train", "eval", "score"):
        # the last job of each step succeeded; an earlier one may have failed on the loaded machine and
        # been retried by the round's retry policy (a train job failed once so in a full suite's run)
        mine = sorted((j for j in jobs if (j.get("submission_id") or "").startswith(f"prodrl-{step}-round-000001")),
                      key=lambda j: j.get("start_time") or 0)
        assert mine and mine[-1]["status"] == "SUCCEEDED", (step, [(j["submission_id"], j["status"]) for j in jobs])
        assert all(j["status"] in ("SUCCEEDED", "FAILED", "STOPPED") for j in mine), (step, mine)
    workers = [json.loads(_s3_object(urls["s3"], f"prodrl/rounds/round-000001/train_workers/rank{r}.json"))
               for r in range(2)]
    assert workers[0]["node"] != workers[1]["node"], workers
    deployed_1 = champion["version"] == challenger["version"]
    _prometheus_saw_the_stack(prom, up)
    up.wait(lambda: "prodrl serve" in up.current_state()["pids"] and "prodrl record" in up.current_state()["pids"],
            "the deployment after round 1")
    figures["rss_mb"] = _rss_mb(up.current_state()["pids"])
    figures["stop_s"] = round(up.stop(signal.SIGINT), 1)

    # the same home and database again, now without Ray (the default): the previous round is there
    # and the loop goes on
    up = MakeUp(home, fresh_database, tmp_path / "make_up_2.log")
    started.append(up)
    figures["restart_s"] = round(up.startup_s, 1)
    urls = up.state["urls"]
    assert "ray" not in urls and "ray cluster" not in up.state["pids"]
    gql = DagsterGraphQLClient("127.0.0.1", port_number=int(urls["dagster"].rsplit(":", 1)[1]))
    assert _round_succeeded(gql, 1)
    live = "round-000001" if deployed_1 else "round-000000"
    up.wait(lambda: up.current_state()["deployed_version"] == live and "prodrl record" in up.current_state()["pids"],
            f"the deployment of {live} after the restart")
    again = _mlflow(urls["mlflow"], "registered-models/alias", name="prodrl-policy", alias="challenger")["model_version"]
    assert again["version"] == challenger["version"]
    parts = {m["partition"] for m in gql._execute(MATS, {"key": {"path": ["heldout_eval"]}})
             ["assetOrError"]["assetMaterializations"]}
    assert parts == {"round-000001"}
    # the loop goes on: new traffic is served by the live version and lands in the restored store
    model, n = _play(urls["recorder"], token, 16, seed=2)
    assert model == live and n == 16
    stats = httpx.get(urls["recorder"].removesuffix("/v1") + "/stats",
                      headers={"Authorization": f"Bearer {token}"}, timeout=60).json()["counters"]
    assert stats["rewards_recorded"] == 16 and stats["recorded_calls"] >= 16
    runs = gql._execute(RUNS, {"name": "prod_rl_round"})["runsOrError"]["results"]
    assert len(runs) == 1  # one run per round (run key = partition key), across the restart
    up.stop(signal.SIGTERM)
    print("stack figures:", json.dumps(figures))
