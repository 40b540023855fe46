"""Every export scheme the project writes (bf16 dense and MoE, NVFP4 W4A16 and W4A4) loaded by vLLM's
own loader through the ``vllm-restart`` deploy target: blue/green restarts, probed, one cut-over
under steady traffic. It starts its own servers (not the session's ``vllm_server``). A failed probe's
rollback is the managed targets' shared code (``ManagedServerTarget``), tested with ``prodrl serve``
in test_deploy_targets.py and the fleet tests: not here, where it costs one more vLLM start-up."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from prodrl_pipelines.config.settings import Settings
from prodrl_pipelines.deploy_targets import endpoint_file
from prodrl_pipelines.deploy_targets.rollout import probe_and_commit, roll_out
from prodrl_pipelines.deploy_targets.server_records import pid_alive, process_start
from prodrl_pipelines.deploy_targets.servers import VLLMRestartTarget
from prodrl_pipelines.engines.local import LocalEngine
from prodrl_pipelines.engines.types import SamplingParams
from prodrl_pipelines.engines.vllm_client import VLLMClient
from tests.vllm_support import PROMPTS, SERVER_ARGS, logprob_mismatch, vllm_python

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIGURES: dict[str, dict] = {}  # per scheme |log mu_vllm - log mu_local|, printed at the end


def _scheme_target(tmp_path, port_base: int):
    settings = Settings(home=str(tmp_path / "home"), deploy={
        "target": "vllm-restart", "target_port": port_base, "vllm_python": vllm_python(),
        "server_args": SERVER_ARGS, "num_top_logprobs": 8, "probe_prompts": 4, "max_tokens": 8})
    return settings, VLLMRestartTarget(settings, settings.home_path)


class Traffic:
    """Steady completions through a recorder that follows the deployment's endpoint file."""

    # two clients with a pause: steady, but leaving CPU to the server booting beside the busy one (4
    # unthrottled clients starved its start-up past 300 s on 2 cores; each vLLM call costs CPU that the
    # rest of the suite shares, and what is checked is 0 failed calls and who answered, not throughput)
    def __init__(self, url: str, workers: int = 2, pause_s: float = 0.2) -> None:
        self.pause_s = pause_s
        import httpx

        self.failures, self.stop, self.url = [], threading.Event(), url
        self.served: Counter = Counter()  # answers by the served model name (the policy version)
        self.pool = ThreadPoolExecutor(workers)
        self.futs = [self.pool.submit(self._run, i, httpx) for i in range(workers)]

    def _run(self, i: int, httpx) -> int:
        n = 0
        with httpx.Client(base_url=self.url, headers={"Authorization": "Bearer t"}, timeout=120) as h:
            while not self.stop.is_set():
                try:
                    r = h.post("/v1/completions", json={"model": "whatever-the-client-says",
                                                         "prompt": PROMPTS[(i + n) % 4], "max_tokens": 6,
                                                         "logprobs": 8, "seed": n},
                               headers={"X-Trajectory-Id": f"w{i}-{n}"})
                    if r.status_code != 200:
                        self.failures.append(f"{r.status_code}: {r.text}")
                    else:
                        self.served[r.json().get("model")] += 1
                except Exception as e:  # noqa: BLE001 - counted as a failed call
                    self.failures.append(f"{type(e).__name__}: {e}")
                n += 1
                time.sleep(self.pause_s)
        return n

    def finish(self) -> int:
        self.stop.set()
        sent = sum(f.result() for f in self.futs)
        self.pool.shutdown()
        return sent

    def wait_served(self, version: str, timeout_s: float = 180.0) -> None:
        """Until an answer from ``version`` came back (however slowly the loaded machine serves)."""
        deadline = time.monotonic() + timeout_s
        while not self.served[version]:
            assert time.monotonic() < deadline and not self.failures, (version, self.served, self.failures[:3])
            time.sleep(0.1)


def _explained_by(rows, exports: dict) -> None:
    """Each recorded call's logprobs are those of its tagged version's weights (and only those)."""
    params = SamplingParams(max_tokens=6, num_top_logprobs=8)
    engines = {v: LocalEngine.from_pretrained(d) for v, d in exports.items()}
    for r in rows:
        errs = {v: float(np.abs(np.asarray(e.score([r["prompt_token_ids"]], [r["output_token_ids"]], params)[0])
                                - np.asarray(r["output_logprobs"])).max()) for v, e in engines.items()}
        assert min(errs, key=errs.get) == r["policy_version"] and errs[r["policy_version"]] < 2e-2, (r["policy_version"], errs)


@pytest.mark.long(seconds=210)
def test_every_export_scheme_serves_on_vllm_through_the_restart_target(vllm_exports, tmp_path):
    """bf16 dense and MoE, NVFP4 W4A16 and W4A4 (dense) through vLLM's own loader, each deploy a
    blue/green restart (the old server stops only after the new one serves) probed for parity; the
    cut-over from dense2 to w4a16 happens under steady traffic through ``prodrl record --follow``: no
    call fails and each is tagged with the version that served it (checked against the weights)."""
    from prodrl_pipelines.engines.server import BackgroundServer
    from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app
    from prodrl_pipelines.deploy_targets.processes import pick_port_range

    settings, target = _scheme_target(tmp_path, pick_port_range(2))
    params = SamplingParams(max_tokens=8, num_top_logprobs=8)
    app = build_recorder_app(RecorderConfig(upstream="", follow=str(endpoint_file(settings.home_path).path),
                                            store_dir=str(tmp_path / "store"), token="t", top_logprobs=8))
    pids, traffic = [], None
    try:
        with BackgroundServer(app) as srv:
            for version, export in (("dense2", "dense2-bf16"), ("w4a16", "dense-nvfp4-w4a16"), ("moe-bf16", "moe-bf16"),
                                    ("w4a4", "dense-nvfp4-w4a4")):
                if version == "w4a16":
                    # green boots beside blue, then traffic runs across the probe and the cut-over
                    # (booting under unthrottled load on 2 cores is bench/deploy_switch.py's subject)
                    sw = target.switch(vllm_exports[export], version)
                    traffic = Traffic(srv.url)
                    traffic.wait_served("dense2")  # blue answered under this traffic before the cut-over
                    ro = probe_and_commit(settings, target, sw, PROMPTS)
                else:
                    ro = roll_out(settings, target, vllm_exports[export], version, PROMPTS)
                assert ro.probe is not None and ro.probe.passed, ro.probe
                cur = target.current()
                assert cur.policy_version == version and cur.url == ro.switch.endpoint
                assert endpoint_file(settings.home_path).read().policy_version == version
                pids.append((cur.pid, process_start(cur.pid)))
                assert all(not pid_alive(*p) for p in pids[:-1])  # the old server was stopped after the switch
                with VLLMClient(cur.url) as c:
                    recs = c.generate(PROMPTS, params, seed=3)
                FIGURES[version] = {**logprob_mismatch(recs, vllm_exports[export], params), "switch_s": round(ro.seconds, 1),
                                    "probe_mean": ro.probe.mean_abs}
                bound = {"dense2": 5e-3, "moe-bf16": 5e-3, "w4a16": 5e-3, "w4a4": 5e-2}[version]
                assert FIGURES[version]["mean"] < bound, FIGURES[version]
                if version == "w4a16":
                    traffic.wait_served("w4a16")
                    sent = traffic.finish()
                    assert app.state.recorder.ingestor.flush(30)
                    rows = app.state.recorder.store.read_calls().to_pylist()
            assert not traffic.failures, traffic.failures[:3]
            assert len(rows) == sent
            assert {r["policy_version"] for r in rows} == {"dense2", "w4a16"}
            _explained_by(rows, {"dense2": vllm_exports["dense2-bf16"], "w4a16": vllm_exports["dense-nvfp4-w4a16"]})
        # the next run finds the server again from the state file (a new target object)
        again = VLLMRestartTarget(settings, settings.home_path).current()
        assert again is not None and again.pid == pids[-1][0]
    finally:
        target.stop()  # first: a server left running would starve every later test
        if traffic is not None:
            traffic.finish()
        print("\n|log mu_vllm - log mu_local| per scheme:", json.dumps(FIGURES, indent=1))
