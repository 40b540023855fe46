"""Deploy targets without vLLM: prodrl-serve (blue/green managed servers), command, pointer, the
parity probe's arithmetic and the round's deployment step with a failing probe."""

from __future__ import annotations

import math
import subprocess
import sys

import httpx
import numpy as np
import pytest

from prodrl_pipelines.deploy_targets import TARGETS, endpoint_file, make_target
from prodrl_pipelines.deploy_targets.base import DeployError
from prodrl_pipelines.deploy_targets.probe import compare
from prodrl_pipelines.deploy_targets.rollout import DeployRejected, roll_out
from prodrl_pipelines.deploy_targets.server_records import process_start, record_alive, same_server, stop_record
from prodrl_pipelines.deploy_targets.servers import ProdrlServeTarget
from prodrl_pipelines.engines.server import BackgroundServer
from prodrl_pipelines.engines.vllm_client import VLLMClient
from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app
from prodrl_pipelines.config.settings import Settings, settings_from_flat

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = [[1, 5, 6, 7, 8], [1, 40, 41, 42, 9, 9], [1, 12, 13]]


def test_a_server_record_names_its_process_by_pid_and_start_time():
    """A record whose pid the kernel has since handed to another process is a stopped server:
    stopping it leaves that other process alone."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        start = process_start(other.pid)
        assert start is not None
        recycled = {"pid": other.pid, "pid_start": start - 1}  # the server that had this pid before
        assert not record_alive(recycled) and not same_server(recycled, {"pid": other.pid, "pid_start": start})
        stop_record(recycled, grace_s=1)
        assert other.poll() is None
        assert record_alive({"pid": other.pid, "pid_start": start}) and record_alive({"pid": other.pid})
        stop_record({"pid": other.pid, "pid_start": start}, grace_s=5)
        assert other.poll() is not None and not record_alive({"pid": other.pid, "pid_start": start})
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()


def test_compare_is_the_mean_and_p99_of_absolute_differences():
    rng = np.random.default_rng(0)
    served = [rng.normal(-2, 1, 50), rng.normal(-2, 1, 150)]
    trainer = [s + rng.normal(0, 0.01, s.size) for s in served]
    d = np.abs(np.concatenate(served) - np.concatenate(trainer))
    out = compare(served, trainer, 0.02, 0.05)
    assert out["passed"] and math.isclose(out["mean_abs"], d.mean()) and out["tokens"] == 200
    assert math.isclose(out["p99_abs"], np.quantile(d, 0.99, method="higher"))
    trainer[1][3] = -np.inf  # outside the trainer's support: counted, not averaged
    out = compare(served, trainer, 0.02, 0.05)
    assert out["out_of_support"] == 1 and out["passed"] and math.isfinite(out["mean_abs"])
    bad = compare(served, [t + 0.5 for t in trainer], 0.02, 0.05)
    assert not bad["passed"] and "probe_mean_bound" in bad["reason"] and "probe_p99_bound" in bad["reason"]
    assert not compare([], [], 1, 1)["passed"]


def test_settings_choose_a_known_target_and_fail_early():
    assert set(TARGETS) == {"pointer", "prodrl-serve", "vllm-restart", "vllm-reload", "vllm-weight-transfer", "command",
                            "vllm-lora", "prodrl-serve-lora"}
    with pytest.raises(ValueError, match="^target: unknown deploy target 'k8s'"):
        settings_from_flat({"target": "k8s"})
    with pytest.raises(ValueError, match="needs target_command"):
        settings_from_flat({"target": "command"})
    with pytest.raises(ValueError, match=r"^target_command: .*\{image\}"):
        settings_from_flat({"target": "command", "target_command": "deploy {image}"})
    d = Settings().deploy
    assert d.probe_bounds() == (0.05, 0.5)  # nvfp4-w4a16 default
    assert Settings(deploy={"export_scheme": "nvfp4-w4a4", "probe_mean_bound": 0.3}).deploy.probe_bounds() == (0.3, 5.0)


def test_prodrl_serve_target_switches_blue_green_and_rolls_back(tiny_exports, tmp_path):
    from prodrl_pipelines.deploy_targets.processes import pick_port_range

    s = Settings(home=str(tmp_path / "home"), deploy={"target": "prodrl-serve", "target_port": pick_port_range(2),
                                                      "probe_prompts": 3, "max_tokens": 6, "export_scheme": "bf16"})
    target = make_target(s)
    try:
        a = roll_out(s, target, tiny_exports["bf16"], "v1", PROMPTS)
        assert a.probe.passed and a.probe.mean_abs < 1e-5 and a.switch.endpoint.endswith(str(s.deploy.target_port))
        app = build_recorder_app(RecorderConfig(upstream="", follow=str(endpoint_file(s.home_path).path),
                                                store_dir=str(tmp_path / "store"), token="t", top_logprobs=4))
        recorder = BackgroundServer(app).start()

        def call(tid: str) -> dict:
            r = httpx.post(recorder.url + "/v1/completions", headers={"Authorization": "Bearer t", "X-Trajectory-Id": tid},
                           json={"model": "whatever-the-client-says", "prompt": [1, 5, 6], "max_tokens": 3}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        assert call("before")["model"] == "v1"
        b = roll_out(s, ProdrlServeTarget(s, s.home_path), tiny_exports["bf16"], "v2", PROMPTS)  # a later run
        assert call("after")["model"] == "v2"  # the recorder followed the switch to the new port
        assert app.state.recorder.ingestor.flush(30)
        tags = {r["trajectory_id"]: r["policy_version"] for r in app.state.recorder.store.read_calls().to_pylist()}
        assert tags == {"before": "v1", "after": "v2"}
        recorder.stop()
        assert b.switch.detail["replaces"] == "v1" and b.switch.endpoint.endswith(str(s.deploy.target_port + 1))
        assert not record_alive(a.switch.detail)  # drained and stopped after the switch
        with VLLMClient(b.switch.endpoint) as c:
            assert c.models() == ["v2"]
        assert endpoint_file(s.home_path).read().policy_version == "v2"
        # W4A4 under bf16's bound: the probe fails, the new server is stopped, v2 keeps serving
        strict = Settings(home=s.home, deploy={**s.deploy.model_dump(), "probe_mean_bound": 1e-6})
        with pytest.raises(DeployRejected) as err:
            roll_out(strict, ProdrlServeTarget(strict, strict.home_path), tiny_exports["nvfp4-w4a4"], "v3", PROMPTS)
        assert "probe_mean_bound" in err.value.reason and "v2 kept serving" in err.value.rollback
        assert err.value.probe.mean_abs > 1e-6 and not record_alive(err.value.switch.detail)
        assert target.current().policy_version == "v2" and endpoint_file(s.home_path).read().policy_version == "v2"
        # a server that cannot start: the deploy fails with its log, nothing changes
        with pytest.raises(DeployError, match="exited before it was healthy"):
            roll_out(s, target, tmp_path / "no-such-export", "v4", PROMPTS)
        assert target.current().policy_version == "v2"
    finally:
        target.stop()


def test_command_target_runs_the_template_and_reports_failures(tiny_exports, tmp_path):
    log = tmp_path / "deploys.txt"
    script = (f"{sys.executable} -c \"import sys; open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\" "
              "{export_dir} {policy_version} {port}")
    s = Settings(home=str(tmp_path / "home"), deploy={"target": "command", "target_command": script,
                                                      "target_port": 9123, "probe_prompts": 2, "export_scheme": "bf16"})
    ro = roll_out(s, make_target(s), tiny_exports["bf16"], "v1", PROMPTS)  # no endpoint: probed on the local engine
    assert log.read_text().split() == [str(tiny_exports["bf16"]), "v1", "9123"] and ro.probe.engine == "local"
    failing = Settings(home=s.home, deploy={"target": "command", "target_command":
                                            f"{sys.executable} -c \"import sys; sys.stderr.write('quota exceeded'); sys.exit(3)\""})
    with pytest.raises(DeployError, match="exited 3: quota exceeded"):
        roll_out(failing, make_target(failing), tiny_exports["bf16"], "v2", PROMPTS)
    missing = Settings(home=s.home, deploy={"target": "command", "target_command": "no-such-binary-xyz {export_dir}"})
    with pytest.raises(DeployError, match="not found: 'no-such-binary-xyz'"):
        roll_out(missing, make_target(missing), tiny_exports["bf16"], "v2", PROMPTS)


def test_pointer_target_probes_the_export_as_the_local_engine_serves_it(tiny_exports, tmp_path):
    s = Settings(home=str(tmp_path / "home"), deploy={"probe_prompts": 2, "export_scheme": "nvfp4-w4a4"})
    ro = roll_out(s, make_target(s), tiny_exports["nvfp4-w4a4"], "v1", PROMPTS)
    assert ro.switch.endpoint is None and ro.probe.engine == "local" and ro.probe.passed
    assert 0 < ro.probe.mean_abs < 0.5  # W4A4's activation quantization, which the trainer does not simulate
