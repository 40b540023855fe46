"""Lab traffic over loopback HTTP: episodes -> ``prodrl record`` -> ``prodrl serve``.

``served_deployment(svc)`` starts ``prodrl serve <live export>`` and ``prodrl record --upstream ...
--store <svc store root> --policy-version <live version>`` (for an S3-backed ``svc``: ``--s3-bucket
--s3-prefix --s3-endpoint-url --s3-region`` and a local ``--wal-dir``, ``LabDeployment.wal_dir``;
credentials from the environment) as subprocesses on free 127.0.0.1 ports,
waits for both to answer ``/health``, yields a ``LabDeployment`` and stops both on exit (the
recorder flushes its WAL to Parquet parts on SIGTERM). ``LabDeployment.ensure(svc)`` restarts both
when the live policy version changed since they started (a redeploy).

``simulate_traffic_http(svc, n)`` plays the same lab episodes as ``simulate_traffic`` (same tasks,
same trajectory ids) but every model call is a ``POST /v1/completions`` to the recorder carrying
``X-Trajectory-Id`` / ``X-Task-Id`` / ``X-Policy-Version``; the recorder records the call rows
(``task_id`` included), then each episode's reward is posted to ``/v1/feedback``. It returns once
the recorder reports every call and reward flushed to the store, so the sensor and the round see
them exactly like in-process rows.

Seeds: with ``seeded=True`` prompt i of turn t is sent with ``request_seed(turn_seed, i)`` and the
server generates it alone (reproducible, equal to ``LocalEngine.generate([p], params, that_seed)``),
but the in-process path draws one random stream per batch, so the sampled tokens differ from it.
The default (``seeded=False``) lets the server batch concurrent calls (much faster on CPU), but then
the tokens drawn depend on which calls arrived together: two runs of the same settings differ
(``PRODRL_LAB_TRAFFIC=http-seeded`` is the reproducible HTTP mode; measured on 2 cores: 1024
episodes ~19 s seeded vs ~6-11 s batched).

Concurrency: 32 calls in flight (``concurrency``); 128 was slower on 2 shared cores (1024 episodes:
~18 s vs ~8 s). Completions are never retried by the client: the recorder has no idempotency key,
so a retried call could be recorded twice (the recorder itself retries an upstream connection reset
before any answer, which cannot record twice).

Extra draw: with ``deploy.record_extra_draw`` the recorder runs with ``--record-extra-draw`` and asks
``prodrl serve`` for its ``extra_draw`` extension, so the ``score_centering_sampled`` correction
trains on HTTP traffic too.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from prodrl_pipelines.storage import keys
from prodrl_pipelines.engines.types import CallRecord, SamplingParams
from prodrl_pipelines.engines.vllm_client import VLLMClient
from prodrl_pipelines.evaluation.episodes import trajectory_ids
from prodrl_pipelines.deploy_targets.processes import pick_port, tail
from prodrl_pipelines.stack.serving import recorder_store_args
from prodrl_pipelines.lab.episodes import assistant_content, run_episodes, stop_token_ids
from prodrl_pipelines.lab.tasks import ARITHMETIC, get_task

__all__ = ["LabDeployment", "served_deployment", "simulate_traffic_http", "TRAFFIC_ENV", "TRAFFIC_MODES", "traffic_mode"]

TRAFFIC_ENV = "PRODRL_LAB_TRAFFIC"  # one of TRAFFIC_MODES; "http" by default in the demo
# http: the server batches concurrent unseeded calls, so the tokens drawn depend on arrival order
# (fast, not reproducible); http-seeded: every call carries its own seed and is generated alone
# (reproducible, ~2x slower on 2 cores); in_process: one seeded batch per turn (reproducible, fastest)
TRAFFIC_MODES = ("http", "http-seeded", "in_process")


def traffic_mode(via: str | None = None) -> str:
    """``via``, else ``$PRODRL_LAB_TRAFFIC``, else ``http``; refused unless one of ``TRAFFIC_MODES``."""
    mode = via or os.environ.get(TRAFFIC_ENV) or "http"
    if mode not in TRAFFIC_MODES:
        raise ValueError(f"lab traffic mode {mode!r} ({TRAFFIC_ENV}): one of {', '.join(TRAFFIC_MODES)}")
    return mode
SOURCE = "lab/arithmetic"


def _store_args(svc, wal_dir: Path) -> list[str]:
    try:
        return recorder_store_args(svc, wal_dir)
    except RuntimeError as e:
        raise RuntimeError(f"lab traffic over HTTP: {e}: set {TRAFFIC_ENV}=in_process") from None


def _default_log_dir(svc) -> Path:
    from prodrl_pipelines.storage.blobstore import LocalBlobStore
    from prodrl_pipelines.storage.s3 import S3BlobStore

    if isinstance(svc.blobs, LocalBlobStore):
        return Path(svc.blobs.root).parent / "logs" / "lab_traffic"
    if isinstance(svc.blobs, S3BlobStore):
        return svc.settings.home_path / "logs" / "lab_traffic"
    _store_args(svc, Path())  # raises: a store the recorder cannot write to
    raise AssertionError("unreachable")


class _Proc:
    def __init__(self, name: str, cmd: list[str], env: dict, log: Path) -> None:
        self.name, self.log = name, log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(log, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_health(self, url: str, headers: dict, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{tail(self.log, 30)}")
            try:
                if httpx.get(url, headers=headers, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not answer {url} within {timeout_s:.0f}s:\n{tail(self.log, 30)}")

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # own process group (start_new_session)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._fh.close()


class _EpisodeEngine:
    """The engine ``run_episodes`` sees: it tracks which episodes are still active (with the same
    ``env_reply`` rule as ``run_episodes``) so each prompt is sent with its episode's headers."""

    def __init__(self, client: VLLMClient, tokenizer, tasks, traj_ids, policy_version: str, seeded: bool,
                 env=ARITHMETIC):
        self.client, self.tokenizer, self.tasks, self.traj_ids, self.env = client, tokenizer, tasks, traj_ids, env
        self.policy_version, self.seeded = policy_version, seeded
        self.active = list(range(len(tasks)))
        self.turn = 0
        self.calls = 0

    def generate(self, prompts, params: SamplingParams, seed: int | None = None) -> list[CallRecord]:
        if len(prompts) != len(self.active):
            raise RuntimeError(f"episode tracking lost sync: {len(prompts)} prompts for {len(self.active)} episodes")
        headers = [{"X-Trajectory-Id": self.traj_ids[i], "X-Task-Id": self.tasks[i].task_id,
                    "X-Policy-Version": self.policy_version} for i in self.active]
        recs = self.client.generate(prompts, params, seed if self.seeded else None, headers=headers)
        still = []
        for i, rec in zip(self.active, recs):
            content = assistant_content(self.tokenizer, rec.output_token_ids)
            if self.env.env_reply(self.tasks[i], self.turn, content) is not None:
                still.append(i)
        self.active, self.turn = still, self.turn + 1
        self.calls += len(recs)
        return recs


class LabDeployment:
    """``prodrl serve`` + ``prodrl record`` subprocesses for the live policy (see the module doc)."""

    def __init__(self, log_dir: Path, *, threads: int = 1, max_batch_size: int = 256, flush_interval_s: float = 0.2,
                 concurrency: int = 32, startup_timeout_s: float = 180.0, wal_dir: Path | None = None,
                 follow: str | Path | None = None) -> None:
        # follow: the deployment's endpoint record (a file, or URL#NAME: deploy_targets.endpoint_store). The
        # deploy target (e.g. vllm-restart) serves the live export; only the recorder runs here, following
        # each switch (no server of its own).
        self.follow = str(follow) if follow else None
        self.log_dir = Path(log_dir)
        self.wal_dir = Path(wal_dir) if wal_dir else self.log_dir / "recorder_wal"  # S3 stores: WAL on local disk
        self.threads, self.max_batch_size, self.flush_interval_s = threads, max_batch_size, flush_interval_s
        self.concurrency, self.startup_timeout_s = concurrency, startup_timeout_s
        self.token = secrets.token_hex(16)
        self.policy_version: str | None = None
        self.export_dir: str | None = None
        self.client: VLLMClient | None = None
        self.recorder_url = ""
        self.serve_url = ""
        self._procs: list[_Proc] = []
        self._tokenizer = None

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"}

    def start(self, svc) -> LabDeployment:
        store_args = _store_args(svc, self.wal_dir)
        live = svc.live()
        k = svc.settings.deploy.num_top_logprobs
        env = {**os.environ, "PRODRL_RECORDER_TOKEN": self.token, "PYTHONUNBUFFERED": "1"}
        env.pop("VLLM_API_KEY", None)
        env.pop("PRODRL_UPSTREAM_API_KEY", None)
        sp, rp = pick_port(), pick_port()
        exe = [sys.executable, "-m", "prodrl_pipelines.cli"]
        if self.follow is not None:
            return self._start_following(svc, live, k, env, exe, store_args, rp)
        try:
            serve = _Proc("prodrl serve", exe + [
                "serve", str(live.export_dir), "--port", str(sp), "--served-model-name", live.policy_version,
                "--max-logprobs", str(max(k, 20)), "--generation-config", "vllm", "--threads", str(self.threads),
                "--max-batch-size", str(self.max_batch_size)], env, self.log_dir / "serve.log")
            self._procs.append(serve)
            rec = _Proc("prodrl record", exe + [
                "record", "--upstream", f"http://127.0.0.1:{sp}", *store_args, "--port", str(rp),
                "--policy-version", live.policy_version, "--tokenizer", str(live.export_dir),
                "--top-logprobs", str(k), "--upstream-max-logprobs", str(max(k, 20)),
                "--flush-interval", str(self.flush_interval_s),
                *(["--record-extra-draw"] if svc.settings.deploy.record_extra_draw else [])],
                env, self.log_dir / "record.log")
            self._procs.append(rec)
            serve.wait_health(f"http://127.0.0.1:{sp}/health", {}, self.startup_timeout_s)
            rec.wait_health(f"http://127.0.0.1:{rp}/health", self.auth, self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.serve_url, self.recorder_url = f"http://127.0.0.1:{sp}", f"http://127.0.0.1:{rp}"
        self.policy_version, self.export_dir = live.policy_version, str(live.export_dir)
        self.client = self.new_client()
        self._tokenizer = None
        return self

    def _start_following(self, svc, live, k: int, env: dict, exe: list[str], store_args: list[str], rp: int):
        self._wait_switched(live.policy_version)
        try:
            rec = _Proc("prodrl record", exe + [
                "record", "--follow", str(self.follow), *store_args, "--port", str(rp),
                "--tokenizer", str(live.export_dir), "--top-logprobs", str(k), "--upstream-max-logprobs", str(max(k + 1, 20)),
                "--flush-interval", str(self.flush_interval_s)], env, self.log_dir / "record.log")
            self._procs.append(rec)
            rec.wait_health(f"http://127.0.0.1:{rp}/health", self.auth, self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.recorder_url = f"http://127.0.0.1:{rp}"
        self.serve_url = self._followed().url
        self.policy_version, self.export_dir = live.policy_version, str(live.export_dir)
        self.client = self.new_client()
        self._tokenizer = None
        return self

    def _followed(self):
        from prodrl_pipelines.deploy_targets.endpoint_store import open_endpoint

        return open_endpoint(self.follow).read()

    def _wait_switched(self, version: str, timeout_s: float = 30.0) -> None:
        """The deploy target commits the endpoint record before the live pointer moves: it is there."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ep = self._followed()
                if ep is not None and ep.policy_version == version:
                    return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the deployment's endpoint file {self.follow} does not serve {version}")
            time.sleep(0.1)

    def new_client(self) -> VLLMClient:
        """A client of the recorder (its own connection pool)."""
        return VLLMClient(self.recorder_url, api_key=self.token, model=self.policy_version,
                               max_concurrency=self.concurrency)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        for p in reversed(self._procs):  # recorder first: it flushes, then the upstream goes
            p.stop()
        self._procs.clear()
        self.policy_version = None

    def ensure(self, svc) -> LabDeployment:
        """Running, and serving the live policy: (re)start both when the live version changed."""
        live = svc.live()
        alive = self._procs and all(p.proc.poll() is None for p in self._procs)
        if alive and self.follow is not None:  # the recorder follows the switch; nothing restarts here
            self._wait_switched(live.policy_version)
            if self.policy_version != live.policy_version:
                self.client.close()
                self.policy_version, self.export_dir = live.policy_version, str(live.export_dir)
                self.client = self.new_client()
            return self
        if alive and self.policy_version == live.policy_version:
            return self
        self.stop()
        return self.start(svc)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.export_dir)
        return self._tokenizer

    def stats(self) -> dict:
        return httpx.get(f"{self.recorder_url}/stats", headers=self.auth, timeout=10).json()["counters"]

    def feedback(self, rewards: list[tuple[str, float]], source: str = SOURCE, pool=None) -> None:
        """POST each ``(trajectory_id, reward)`` to ``/v1/feedback`` (concurrently); 200 = durable."""
        def one(http: httpx.Client, tid: str, reward: float) -> None:
            r = http.post("/v1/feedback", json={"trajectory_id": tid, "reward": float(reward), "source": source})
            if r.status_code != 200:
                raise RuntimeError(f"/v1/feedback {tid} -> HTTP {r.status_code}: {r.text[:300]}")

        with httpx.Client(base_url=self.recorder_url, headers=self.auth, timeout=60,
                          limits=httpx.Limits(max_connections=32)) as http:
            for f in [(pool or self.client._pool).submit(one, http, t, r) for t, r in rewards]:
                f.result()

    def wait_flushed(self, timeout_s: float = 120.0) -> dict:
        """Block until every call and reward the recorder acknowledged is flushed to the store."""
        deadline = time.monotonic() + timeout_s
        while True:
            c = self.stats()
            if (c.get("flushed_calls", 0) >= c.get("recorded_calls", 0)
                    and c.get("flushed_rewards", 0) >= c.get("rewards_recorded", 0)):
                return c
            if time.monotonic() > deadline:
                raise RuntimeError(f"the recorder did not flush within {timeout_s}s: {c}")
            time.sleep(0.05)

    def __enter__(self) -> LabDeployment:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def served_deployment(svc, log_dir: str | os.PathLike | None = None, **kw):
    """Serve + record the live policy for the ``with`` block; yields the running ``LabDeployment``."""
    dep = LabDeployment(Path(log_dir) if log_dir else _default_log_dir(svc), **kw)
    try:
        yield dep.start(svc)
    finally:
        dep.stop()



def simulate_traffic_http(svc, n_episodes: int, deployment: LabDeployment | None = None, seeded: bool = False) -> dict:
    """``simulate_traffic`` over HTTP (recorder -> server); same stats dict. Without ``deployment``
    the servers run just for this call."""
    if deployment is None:
        with served_deployment(svc) as dep:
            return simulate_traffic_http(svc, n_episodes, dep, seeded)
    dep = deployment.ensure(svc)
    live = svc.live()
    blobs = svc.blobs
    key = keys.TRAFFIC_BATCHES
    batches = json.loads(blobs.get_bytes(key)) if blobs.exists(key) else []
    seed = svc.settings.lab.seed * 7_919 + 104_729 * (len(batches) + 1)
    tok = dep.tokenizer
    params = svc.settings.deploy.sampling(stop_token_ids=stop_token_ids(tok))
    env = get_task(svc.settings.lab.task)
    tasks = env.generate_tasks(n_episodes, seed)
    ids = trajectory_ids(live.policy_version, seed, len(tasks))  # the ids run_episodes draws
    before = dep.stats()
    with dep.new_client() as client:
        engine = _EpisodeEngine(client, tok, tasks, ids, live.policy_version, seeded, env)
        eps = run_episodes(engine, tok, tasks, params, live.policy_version, seed, env=env)
        if [e.trajectory_id for e in eps.episodes] != ids:
            raise RuntimeError("run_episodes no longer draws evaluation.episodes.trajectory_ids")
        dep.feedback([(e.trajectory_id, e.reward) for e in eps.episodes], source=env.reward_source, pool=client._pool)
    n_calls = sum(len(e.calls) for e in eps.episodes)
    counters = dep.wait_flushed()
    if (counters.get("unrecordable_calls", 0) != before.get("unrecordable_calls", 0)
            or counters.get("recorded_calls", 0) - before.get("recorded_calls", 0) != n_calls):
        raise RuntimeError(f"the recorder did not record every lab call ({n_calls} sent): {counters}")
    stats = {"policy_version": live.policy_version, "episodes": len(eps), "reward_mean": eps.mean_reward,
             "calls": n_calls, "seed": seed}
    batches.append(stats)
    blobs.put_bytes(key, json.dumps(batches).encode())
    return stats
