"""Someone else's model through the production path, with no lab import anywhere in this test.

A Qwen3 of the user's (own tokenizer, own chat template, own end token), a held-out JSONL graded by
a reward function of the user's package, two rounds through Dagster on PostgreSQL: bootstrap from
``base_model``, traffic with the official `openai` client through ``prodrl record`` in front of
``prodrl serve``, the data-volume sensor, select, train, NVFP4 export, evaluation on that suite,
gate and deploy; then ``prodrl eval`` on a multi-turn, tool-calling suite class of the same package.
"""

import json
import os
import secrets
import subprocess
import sys
import time

import httpx
import pytest
from dagster import build_sensor_context
from openai import OpenAI

from prodrl_pipelines.loop import monitoring
from prodrl_pipelines.loop import services
from prodrl_pipelines.definitions import build_definitions
from prodrl_pipelines.resources.settings import ProdRLSettings, make_resources, open_services
from prodrl_pipelines.sensors import data_volume_sensor
from prodrl_pipelines.deploy_targets import endpoint_file
from prodrl_pipelines.deploy_targets.processes import pick_port, pick_port_range
from prodrl_pipelines.stack.serving import LiveServing

from own_model import build_model, write_user_package

ROUND = {"steps_per_round": 2, "batch_size": 4, "heldout_size": 10, "max_tokens": 6, "gate_tolerance": 1.0,
         "learning_rate": 1e-3}


def _traffic(recorder: str, token: str, n: int, seed: int) -> int:
    """``n`` two-call conversations through the recorder (openai client), a reward for each."""
    client = OpenAI(base_url=f"{recorder}/v1", api_key=token, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    calls = 0
    with httpx.Client(base_url=recorder, headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
        for i in range(n):
            tid = f"own-{seed}-{i}"
            messages = [{"role": "user", "content": f"{i % 9}+{seed % 7}="}]
            for _ in range(2):
                r = client.chat.completions.create(model=model, messages=messages, max_tokens=6, seed=seed * 100 + i,
                                                   extra_headers={"X-Trajectory-Id": tid})
                messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                             {"role": "user", "content": "and again"}]
                calls += 1
            reward = float(len(messages[1]["content"]) % 3) / 2
            assert http.post("/v1/feedback", json={"trajectory_id": tid, "reward": reward}).status_code == 200
        deadline = time.monotonic() + 180  # a ceiling: flushes are slower on a loaded machine
        while True:  # every acknowledged call and reward in the store before the sensor looks
            c = http.get("/stats").json()["counters"]
            if (c.get("flushed_calls", 0) >= c.get("recorded_calls", 0) >= calls
                    and c.get("flushed_rewards", 0) >= c.get("rewards_recorded", 0) >= n):
                return model
            assert time.monotonic() < deadline, c
            time.sleep(0.1)


@pytest.mark.long(seconds=80)
def test_two_rounds_of_someone_elses_model(tmp_path, pg_instance, monkeypatch):
    model_dir = build_model(tmp_path / "their_qwen3")
    user = write_user_package(tmp_path / "user", n_tasks=10, explode=(3,))
    monkeypatch.syspath_prepend(str(tmp_path / "user"))
    home = tmp_path / "home"
    # served as a deployment would be: a managed prodrl-serve replica, redeployed by each round
    fields = {"home": str(home), "base_model": str(model_dir), **user, **ROUND, "target": "prodrl-serve",
              "target_port": pick_port_range(4)}
    res = make_resources(fields)
    defs = build_definitions(res)
    boot = defs.resolve_job_def("bootstrap").execute_in_process(instance=pg_instance)
    assert boot.success
    meta = boot.asset_materializations_for_node("base_policy")[0].metadata
    assert meta["source"].value == "directory" and meta["reward_errors"].value == 1
    svc = open_services(res["settings"], res["store"])
    base_eval = svc.ledger.eval("round-000000")
    assert base_eval["num_tasks"] == 10 and "grader cannot parse q3" in base_eval["first_reward_error"]
    assert base_eval["task_ids"] == [f"q{i}" for i in range(10)]
    assert json.loads((home / "checkpoints" / "round-000000" / "config.json").read_text())["model_type"] == "qwen3"

    token = secrets.token_hex(8)
    serving = LiveServing(env=dict(os.environ), home=home, record_port=pick_port(), token=token,
                          services=lambda: svc)
    served = []
    try:
        for k in (1, 2):
            serving.sync()  # the recorder in front of the live version (the round's deployment switched it)
            served.append(_traffic(serving.record_url, token, 8, seed=k))
            result = data_volume_sensor(build_sensor_context(instance=pg_instance, definitions=defs, resources=res))
            assert not hasattr(result, "skip_message"), result.skip_message
            for req in result.dynamic_partitions_requests:
                pg_instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
            key = result.run_requests[0].partition_key
            assert key == f"round-{k:06d}"
            out = defs.resolve_job_def("prod_rl_round").execute_in_process(instance=pg_instance, partition_key=key)
            assert out.success
            assert svc.ledger.decision(key)["deployed"]
            ev = out.asset_materializations_for_node("heldout_eval")[0].metadata
            assert ev["suite"].value.endswith("heldout.jsonl") and ev["reward_errors"].value == 1
        # live monitoring through the serving endpoint: what is really served, checked to be the live version
        serving.sync()
        serve_url = endpoint_file(home).read().url
        via = open_services(ProdRLSettings(**{**fields, "eval_live_endpoint": serve_url}), res["store"])
        live = monitoring.evaluate_live(via, 0)
        assert (live["policy_version"], live["engine"], live["num_tasks"]) == ("round-000002", serve_url, 10)
        assert live["reward_errors"] == 1
        stale = open_services(ProdRLSettings(**{**fields, "eval_live_endpoint": serve_url}), res["store"])
        stale.ledger.deploy(svc.ledger.live().__class__(**{**vars(svc.ledger.live()), "policy_version": "round-000001"}))
        with pytest.raises(services.RoundError, match="serves 'round-000002', but the live version is 'round-000001'"):
            monitoring.evaluate_live(stale, 1)
        stale.ledger.deploy(svc.ledger.live().__class__(**{**vars(svc.ledger.live()), "policy_version": "round-000002"}))
    finally:
        serving.stop()
    assert served == ["round-000000", "round-000001"]  # round 2 trained on traffic from round 1's export
    assert svc.ledger.live().policy_version == "round-000002"
    calls = svc.store.read_calls(columns=["policy_version", "prompt_text"])
    assert set(calls.column("policy_version").to_pylist()) == {"round-000000", "round-000001"}
    assert all(t.startswith("<|user|>") for t in calls.column("prompt_text").to_pylist())  # their template
    assert json.loads((home / "exports" / "round-000002" / "config.json").read_text())["quantization_config"]

    # the same policy on a multi-turn, tool-calling suite class, from the command line
    settings_file = tmp_path / "tool_suite.json"
    settings_file.write_text(json.dumps({**fields, "home": "home", "eval_suite": "mygrader:ToolSuite"}))
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "user")}
    out = subprocess.run([sys.executable, "-m", "prodrl_pipelines.cli", "eval", "--settings", str(settings_file)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    ev = json.loads(out.stdout)
    assert ev["policy_version"] == "round-000002" and ev["num_tasks"] == 10 and ev["reward_errors"] == 0
    assert 0.0 <= ev["mean"] <= 1.0
