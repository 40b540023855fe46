"""The stack's deployment: the live policy on a fleet of managed servers, ``prodrl record`` in front.

The recorder starts with the stack and follows the deployment's endpoint file (``--follow``): before
any policy is live it answers 503 naming the next step (launch ``bootstrap``); once the Dagster runs
deploy through the settings' deploy target (``deploy.replicas`` managed ``prodrl serve`` replicas,
updated in waves: no call fails during a redeploy), it balances calls over the replicas and tags each
with the version that served it. After a restart of the stack the servers are gone: a thread of
``prodrl up`` polls the round ledger (``deploy/live.json`` in the store) and brings the live policy
back on the fleet.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from pathlib import Path

from prodrl_pipelines.config.environment import RECORDER_TOKEN
from prodrl_pipelines.deploy_targets.processes import ManagedProcess



def recorder_store_args(svc, wal_dir: Path) -> list[str]:
    """The ``prodrl record`` flags naming ``svc``'s trajectory store: ``--store DIR`` for a local
    store, the ``--s3-*`` flags (and a local ``--wal-dir``) for an S3 one."""
    from prodrl_pipelines.storage.blobstore import LocalBlobStore
    from prodrl_pipelines.storage.s3 import S3BlobStore

    blobs = svc.blobs
    if isinstance(blobs, LocalBlobStore):
        return ["--store", str(blobs.root)]
    if isinstance(blobs, S3BlobStore):
        return ["--s3-bucket", blobs.bucket, "--s3-prefix", blobs.prefix,
                "--s3-endpoint-url", blobs.endpoint_url or "", "--s3-region", blobs.region or "",
                "--wal-dir", str(wal_dir)]
    raise RuntimeError(f"`prodrl record` writes to a local or S3 trajectory store; got {blobs!r}")


def recorder_args(deploy, endpoint_path: str, store_args: list[str], port: int) -> list[str]:
    """``prodrl record``'s arguments in front of the deployment: it follows the endpoint file and
    records what the deploy settings ask (top-K, the extra draw, how chat calls are rendered)."""
    k = deploy.num_top_logprobs
    return ["record", "--follow", endpoint_path, *store_args, "--port", str(port),
            "--top-logprobs", str(k), "--upstream-max-logprobs", str(max(k, 20)),
            *(["--record-extra-draw"] if deploy.record_extra_draw else []),
            "--chat-history", deploy.chat_history, "--reply-parser", deploy.reply_parser]


class LiveServing:
    """``services``: a callable returning the round ``Services`` (their ledger says what is live)."""

    def __init__(self, *, env: dict, home: Path, record_port: int, token: str, services, poll_s: float = 2.0,
                 log=print) -> None:
        self.env = {**env, RECORDER_TOKEN: token}
        self.env.pop("VLLM_API_KEY", None)
        self.home, self.record_port, self.token = home, record_port, token
        self._services_factory, self.poll_s, self.log = services, poll_s, log
        self.record: ManagedProcess | None = None
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._svc = None

    @property
    def record_url(self) -> str:
        return f"http://127.0.0.1:{self.record_port}"

    def _services(self):
        if self._svc is None:
            self._svc = self._services_factory()
        return self._svc

    def target(self):
        from prodrl_pipelines.deploy_targets import make_target

        return make_target(self._services().settings)

    @property
    def version(self) -> str | None:
        """The version every replica serves (None while nothing is live, or mid-update)."""
        from prodrl_pipelines.deploy_targets import endpoint_file

        ep = endpoint_file(self.home, self._services().settings.deploy).read()
        reps = self.target().currents() if ep is not None else []
        if ep is None or not reps or any(r is None or r.policy_version != ep.policy_version for r in reps):
            return None
        return ep.policy_version

    def processes(self) -> list[ManagedProcess]:
        return [self.record] if self.record is not None else []

    def server_pids(self) -> dict[str, int]:
        """The replicas' servers (each leads its own session), named for stack.json."""
        out = {}
        for i, r in enumerate(self.target().currents()):
            if r is not None:
                out["prodrl serve" if i == 0 else f"prodrl serve {i + 1}"] = r.pid
        return out

    def start(self) -> "LiveServing":
        self._start_recorder()
        self._thread = threading.Thread(target=self._run, name="prodrl-live-serving", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
                self.error = None
            except Exception as exc:  # noqa: BLE001 - keep polling; the next tick may succeed
                if self._stop.is_set():
                    break
                msg = f"{type(exc).__name__}: {exc}"
                if msg != self.error:
                    self.log(f"deployment: {msg}")
                    traceback.print_exc(file=sys.stderr)
                self.error = msg
            self._stop.wait(self.poll_s)

    def sync(self) -> None:
        """One poll: the recorder runs, and a live policy whose servers are all gone (the stack was
        restarted) is served again through the deploy target."""
        from prodrl_pipelines.deploy_targets.rollout import roll_out

        if self.record is None or not self.record.alive():
            self._start_recorder()
        svc = self._services()
        self._publish_scrape_targets(svc)
        if svc.ledger.live() is None:
            return
        target = self.target()
        if any(r is not None for r in target.currents()):
            return  # serving, or a deploy of a Dagster run is under way
        live = svc.live()  # fetches the export from the store if this machine lacks it
        t0 = time.monotonic()
        roll_out(svc.settings, target, Path(live.export_dir), live.policy_version, prompts=[])
        self.log(f"deployment: {live.policy_version} serving again on {target.replicas} replica(s) "
                 f"({time.monotonic() - t0:.1f}s)")

    def _publish_scrape_targets(self, svc) -> None:
        """What Prometheus scrapes (``stack.prometheus_config``): the recorder, the replicas the
        endpoint file lists now, and a training round's rank 0 where its port is set."""
        from prodrl_pipelines.deploy_targets import endpoint_file
        from prodrl_pipelines.stack.prometheus_config import serving_targets, write_targets

        obs = svc.settings.observability
        write_targets(self.home, "prodrl-recorder", [f"127.0.0.1:{self.record_port}"])
        write_targets(self.home, "prodrl-serve", serving_targets(endpoint_file(self.home, svc.settings.deploy).read()))
        trainer = [f"{obs.trainer_metrics_host.replace('0.0.0.0', '127.0.0.1')}:{obs.trainer_metrics_port}"]
        write_targets(self.home, "prodrl-trainer", trainer if obs.trainer_metrics_port else [])

    def _start_recorder(self) -> None:
        from prodrl_pipelines.deploy_targets.endpoint_store import endpoint_location

        svc = self._services()
        exe = [sys.executable, "-m", "prodrl_pipelines.cli"]
        store = recorder_store_args(svc, self.home / "recorder_wal")
        record = ManagedProcess("prodrl record", exe + recorder_args(
            svc.settings.deploy, endpoint_location(self.home, svc.settings.deploy), store, self.record_port)
            + ["--request-log", str(self.home / "logs" / "requests.jsonl")],
            self.env, self.home / "logs" / "record.log")
        try:
            record.wait_http(f"{self.record_url}/health", timeout_s=120,
                             headers={"Authorization": f"Bearer {self.token}"}, cancel=self._stop)
        except BaseException:
            record.stop()
            raise
        self.record = record  # listed (stack.json) once it answers
        self.log(f"recorder: {self.record_url}/v1 in front of the deployment (follows its endpoint file)")

    def stop(self) -> None:
        """Stop polling, then the recorder (it flushes its WAL to the store), then the replicas."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.record is not None:
            self.record.stop(timeout_s=60)
        self.target().stop()
