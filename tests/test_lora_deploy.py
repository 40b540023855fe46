"""LoRA adapters deployed into running servers (``deploy_targets.adapters``): a fleet of ``prodrl
serve`` replicas and a real vLLM (CPU build) keep serving while each round's adapter is loaded under
its version's name, probed and routed to; a rollback routes back to an adapter still loaded; a canary
is an adapter on the fleet's own servers; old adapters are unloaded beyond the kept count. Every
call goes through ``prodrl record --follow``, as clients' would."""

from __future__ import annotations

import httpx
import pytest

from prodrl_pipelines.config.settings import Settings, settings_from_flat
from prodrl_pipelines.deploy_targets import endpoint_file, make_target
from prodrl_pipelines.deploy_targets.processes import pick_port_range
from prodrl_pipelines.deploy_targets.rollout import DeployRejected, roll_out, start_canary
from prodrl_pipelines.engines.server import BackgroundServer
from prodrl_pipelines.lab.adapters import random_adapter_exports
from prodrl_pipelines.loop.settings_checks import check_before_work
from prodrl_pipelines.quant.adapter_export import adapter_export
from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app
from tests.test_fleet import PROMPTS, Traffic

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _served_names(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}


def _answers(url: str, name: str) -> int:
    """The status of a completion asked of ``name`` directly, as a call the recorder routed before a
    switch reaches the server after it."""
    return httpx.post(url + "/v1/completions", json={"model": name, "prompt": PROMPTS[0], "max_tokens": 2},
                      timeout=120).status_code


def _moved(url: str, name: str, other: str) -> float:
    """Mean |log p| difference of the same seeded samples served under two names of one server."""
    import numpy as np

    from prodrl_pipelines.engines.types import SamplingParams
    from prodrl_pipelines.engines.vllm_client import VLLMClient

    params = SamplingParams(temperature=1.0, max_tokens=6, num_top_logprobs=4)
    lps = []
    for served in (name, other):
        with VLLMClient(url, model=served) as client:
            lps.append(np.concatenate([r.output_logprobs for r in client.generate(PROMPTS, params, seed=3)]))
    n = min(len(lps[0]), len(lps[1]))
    return float(np.abs(lps[0][:n] - lps[1][:n]).mean())


def _recorded(app) -> dict[str, int]:
    assert app.state.recorder.ingestor.flush(30)
    rows = app.state.recorder.store.read_calls().to_pylist()
    out: dict[str, int] = {}
    for r in rows:
        out[r["policy_version"]] = out.get(r["policy_version"], 0) + 1
    return out


def test_adapter_settings_are_checked_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"lora_rank 32 > deploy.lora_max_rank 16"):
        settings_from_flat({"training": "lora", "lora_rank": 32, "target": "vllm-lora"})
    with pytest.raises(ValueError, match="lora_max_rank 12"):
        settings_from_flat({"lora_max_rank": 12})
    with pytest.raises(ValueError, match="replica_placement 'ray' with the adapter target"):
        Settings(deploy={"target": "prodrl-serve-lora", "replica_placement": "ray"})
    # the lab's default model is a mixture of experts: vLLM's CPU build cannot serve LoRA on it
    s = settings_from_flat({"home": str(tmp_path), "training": "lora", "target": "vllm-lora"})
    with pytest.raises(ValueError, match=r"vllm-lora.*'lab' \(lab size 'demo'\), a mixture of experts.*GPU kernels"):
        check_before_work(s)
    dense = settings_from_flat({"home": str(tmp_path), "training": "lora", "target": "vllm-lora", "lab_size": "demo-dense"})
    check_before_work(dense)
    assert settings_from_flat({"training": "lora", "target": "prodrl-serve-lora"}).deploy.lora_kept_adapters == 2


@pytest.mark.long(seconds=120)
def test_a_fleet_loads_each_adapter_without_a_restart_fails_no_call_and_routes_back_on_rollback(
        tiny_policy_dir, tiny_exports, tmp_path):
    """Three ``prodrl serve --enable-lora`` replicas of the tiny MoE: v1 starts them (base + adapter);
    v2 is loaded into the same processes wave by wave under traffic (0 failed calls, every row filed
    under the adapter that answered); a canary adapter takes its slice on those servers; a rejected
    adapter leaves v2 routed; a rollback to v1, still loaded, only routes; beyond 2 kept adapters the
    oldest is unloaded."""
    exports = random_adapter_exports(tiny_policy_dir, tiny_exports["bf16"], tmp_path / "exports",
                              {"v1": 0.05, "v2": -0.05, "v3": 0.03, "v4": 0.04})
    assert adapter_export(exports["v2"])[1:] == ("base", tiny_exports["bf16"])
    s = Settings(home=str(tmp_path / "home"), deploy={
        "target": "prodrl-serve-lora", "target_port": pick_port_range(8), "replicas": 3, "max_unavailable": 1,
        "probe_prompts": 3, "max_tokens": 6, "export_scheme": "bf16", "lora_kept_adapters": 2})
    target = make_target(s)
    app = build_recorder_app(RecorderConfig(upstream="", follow=str(endpoint_file(s.home_path).path),
                                            store_dir=str(tmp_path / "store"), token="t", top_logprobs=4))
    try:
        first = roll_out(s, target, exports["v1"], "v1", PROMPTS)
        assert first.switch.detail["mode"] == "start" and first.probe.passed
        pids = [r.pid for r in target.currents()]
        urls = [r.url for r in target.currents()]
        assert all(_served_names(u) == {"base", "v1"} for u in urls)
        with BackgroundServer(app) as rec:
            traffic = Traffic(rec.url)
            traffic.wait_served("v1", 10)
            ro = roll_out(s, target, exports["v2"], "v2", PROMPTS)
            traffic.wait_served("v2", 10)
            assert ro.waves == 3 and ro.switch.detail["mode"] == "adapter" and ro.probe.passed
            assert [r.pid for r in target.currents()] == pids  # loaded into the running servers
            assert endpoint_file(s.home_path).read().served_model_name == "v2"
            assert _moved(urls[0], "v2", "base") > 10 * ro.probe.mean_abs  # served with the adapter applied

            # a canary: v3 loaded into the same servers, a sticky slice of trajectories under its name
            can = start_canary(s, target, exports["v3"], "v3", PROMPTS, 0.5)
            assert can.switch.detail["mode"] == "adapter" and can.probe.passed
            traffic.wait_served("v3", 5)
            assert "stopped the canary adapter (v3)" in target.stop_canary()
            # off traffic but still loaded until the next deploy: a call routed to it just before finds it
            assert all(_served_names(u) == {"base", "v1", "v2", "v3"} for u in urls)
            assert _answers(urls[0], "v3") == 200

            # a rejected adapter (a probe bound nothing meets) never served: v2 kept serving
            strict = Settings(**{**s.model_dump(), "deploy": {**s.deploy.model_dump(), "probe_mean_bound": 1e-12}})
            with pytest.raises(DeployRejected, match="parity probe failed") as e:
                roll_out(strict, make_target(strict), exports["v4"], "v4", PROMPTS)
            assert "v2 kept serving on the same servers (no restart); unloaded v4" in e.value.rollback
            assert all(_served_names(u) == {"base", "v1", "v2", "v3"} for u in urls)

            # the rollback to v1: still loaded, so only routed to
            back = roll_out(s, target, exports["v1"], "v1", PROMPTS)
            assert back.switch.detail["loaded"] == [] and [r.pid for r in target.currents()] == pids
            n_v1 = traffic.served["v1"]
            traffic.wait_served("v1", n_v1 + 10)
            sent = traffic.finish()
        assert not traffic.failures, traffic.failures[:5]
        recorded = _recorded(app)
        assert sum(recorded.values()) == sent and recorded == dict(traffic.served), (recorded, traffic.served)
        assert set(recorded) == {"v1", "v2", "v3"}
        # v1 routed again: the stopped canary's v3 unloaded at this deploy; kept 2 (v2, v1): nothing was
        # beyond, so nothing more was unloaded
        assert [r.adapters for r in target.currents()] == [["v2", "v1"]] * 3
        assert all(_served_names(u) == {"base", "v1", "v2"} for u in urls)

        # v4 accepted this time: v2, now the oldest beyond the 2 kept, is unloaded
        roll_out(s, target, exports["v4"], "v4", PROMPTS)
        assert all(_served_names(u) == {"base", "v1", "v4"} for u in urls)
        assert [r.pid for r in target.currents()] == pids
        # an adapter of a higher rank than the servers were started for is refused before it is loaded
        big = random_adapter_exports(tiny_policy_dir, tiny_exports["bf16"], tmp_path / "big", {"v5": 0.01}, rank=32,
                                     alpha=64)["v5"]
        with pytest.raises(DeployRejected, match=r"rank 32 > deploy.lora_max_rank 16"):
            roll_out(s, target, big, "v5", PROMPTS)
        assert all(_served_names(u) == {"base", "v1", "v4"} for u in urls)

        # a canary promoted: rolled out while it runs, its adapter already on every server (nothing loaded
        # twice, nothing unloaded when the canary stops, since the fleet serves it now)
        start_canary(s, target, exports["v3"], "v3", PROMPTS, 0.5)
        promoted = roll_out(s, target, exports["v3"], "v3", PROMPTS)
        assert promoted.switch.detail["mode"] == "adapter" and promoted.switch.detail["loaded"] == []
        assert "stopped the canary adapter (v3)" in target.stop_canary()
        roll_out(s, target, exports["v4"], "v4", PROMPTS)  # the next deploy: nothing of v3 unloaded
        assert all(_served_names(u) == {"base", "v3", "v4"} for u in urls)
        assert [r.pid for r in target.currents()] == pids
    finally:
        target.stop()


@pytest.mark.long(seconds=180)
def test_lora_rounds_are_loaded_into_a_real_vllm_under_traffic_and_rolled_back_by_routing(tmp_path, pg_instance):
    """``training: lora`` with ``vllm-lora`` end to end, vLLM's CPU build on the tiny dense policy:

    - bootstrap starts vLLM on the base export; the round job trains an adapter, exports it beside its
      merged weights, registers it in MLflow with its base, and loads it into that same process under
      the round's name, probed on base export + adapter;
    - under traffic through the recorder: another adapter is loaded (one kept, but round 1's, just
      routed away from, still answers until the next deploy), a rejected one is unloaded while the
      live one keeps serving, the rollback to round 0 routes to the base's name (round 1's unloaded
      now), the rollback to round 1 loads it again: 0 failed calls, every row filed under the
      adapter (or base) that answered, one vLLM process throughout."""
    from prodrl_pipelines.definitions import build_definitions
    from prodrl_pipelines.loop import promotion
    from prodrl_pipelines.resources.settings import make_resources, open_services
    from tests.test_lora import rewarded_traffic
    from tests.test_pipeline_e2e import TINY, request_round
    from tests.vllm_support import SERVER_ARGS, vllm_python

    r0, r1 = "round-000000", "round-000001"
    res = make_resources({**TINY, "lab_size": "tiny-dense", "home": str(tmp_path / "home"), "training": "lora",
                          "lora_rank": 2, "learning_rate": 1e-2, "monitors_enabled": [], "export_scheme": "bf16",
                          "target": "vllm-lora", "target_port": pick_port_range(4), "vllm_python": vllm_python(),
                          "server_args": list(SERVER_ARGS), "lora_max_rank": 8, "lora_kept_adapters": 1,
                          "probe_prompts": 4})
    defs = build_definitions(res)
    svc = open_services(res["settings"], res["store"], res["mlflow"])
    s = svc.settings
    target = make_target(s)
    app = build_recorder_app(RecorderConfig(upstream="", follow=str(endpoint_file(s.home_path).path),
                                            store_dir=str(tmp_path / "recorded"), token="t", top_logprobs=4))
    try:
        assert defs.resolve_job_def("bootstrap").execute_in_process(instance=pg_instance).success
        server = target.current()
        assert (server.base_version, server.adapters) == (r0, [])
        rewarded_traffic(svc)
        req = request_round(pg_instance, defs, res)
        assert defs.resolve_job_def("prod_rl_round").execute_in_process(
            instance=pg_instance, partition_key=req.partition_key, tags=req.tags).success
        assert svc.ledger.live().policy_version == r1
        summary = svc.ledger.round_summary(r1)
        assert summary["mode"] == "adapter" and summary["probe_mean_abs"] < 0.02, summary
        assert target.current().pid == server.pid and _served_names(server.url) == {r0, r1}
        tags = svc.lineage.version_tags(summary["model_version"])
        assert (tags["lora_base_version"], tags["lora_base_model_version"]) == (
            r0, svc.ledger.round_summary(r0)["model_version"])

        exports = random_adapter_exports(s.checkpoints_root / r0, s.exports_root / r0, tmp_path / "exports",
                                         {"v2": -0.05, "v3": 0.03}, base_version=r0)
        with BackgroundServer(app) as rec:
            traffic = Traffic(rec.url)
            traffic.wait_served(r1, 5)
            ro = roll_out(s, target, exports["v2"], "v2", PROMPTS)
            traffic.wait_served("v2", 5)
            assert ro.switch.detail["mode"] == "adapter" and target.current().pid == server.pid
            # vLLM's LoRA kernels against the trainer's base export + adapter in fp32
            assert ro.probe.passed and ro.probe.mean_abs < 2e-2, ro.probe
            assert _moved(server.url, "v2", r0) > 5 * ro.probe.mean_abs  # the adapter is applied
            # one kept, but round 1's adapter, routed until this deploy, is unloaded only at the next one: a
            # call the recorder routed to it just before the switch still finds it (vLLM answers 404 after)
            assert _served_names(server.url) == {r0, r1, "v2"} and _answers(server.url, r1) == 200

            strict = Settings(**{**s.model_dump(), "deploy": {**s.deploy.model_dump(), "probe_mean_bound": 1e-12}})
            with pytest.raises(DeployRejected, match="parity probe failed") as e:
                roll_out(strict, make_target(strict), exports["v3"], "v3", PROMPTS)
            assert "v2 kept serving on the same servers (no restart); unloaded v3" in e.value.rollback
            assert _served_names(server.url) == {r0, r1, "v2"}

            _, base = promotion.make_live(svc, r0, kind="rollback", by="test")  # the base: only routed to
            assert base.switch.detail["mode"] == "adapter" and base.switch.detail["loaded"] == [] and base.probe.passed
            traffic.wait_served(r0, 5)
            assert _served_names(server.url) == {r0, "v2"}  # round 1's unloaded now; v2 just routed away from
            _, back = promotion.make_live(svc, r1, kind="rollback", by="test")  # unloaded: loaded again
            assert back.switch.detail["loaded"] == [server.url] and back.probe.passed
            traffic.wait_served(r1, traffic.served[r1] + 5)
            sent = traffic.finish()
        assert not traffic.failures, traffic.failures[:5]
        recorded = _recorded(app)
        assert sum(recorded.values()) == sent and recorded == dict(traffic.served), (recorded, traffic.served)
        assert set(recorded) == {r0, r1, "v2"} and target.current().pid == server.pid
        print(f"vllm-lora: adapter load + probe {ro.seconds:.2f}s (load {ro.switch.seconds:.2f}s), "
              f"probe mean {ro.probe.mean_abs:.4f}")
    finally:
        target.stop()
