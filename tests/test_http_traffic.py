"""Lab traffic over loopback HTTP (episodes -> prodrl record -> prodrl serve) records the same rows
the round uses from the in-process path."""

import numpy as np
import pytest

from prodrl_pipelines.loop import bootstrap
from prodrl_pipelines.loop import data
from prodrl_pipelines.loop import train
from prodrl_pipelines.engines.local import LocalEngine
from prodrl_pipelines.engines.vllm_client import request_seed
from prodrl_pipelines.lab.arithmetic import generate_tasks
from prodrl_pipelines.lab.episodes import run_episodes, stop_token_ids
from prodrl_pipelines.lab.http_traffic import served_deployment, simulate_traffic_http
from prodrl_pipelines.lab.traffic import simulate_traffic
from prodrl_pipelines.resources.settings import make_resources, open_services

TINY = {"lab_size": "tiny", "lab_sft_steps": 5, "steps_per_round": 2, "batch_size": 4, "heldout_size": 4,
        "max_tokens": 6}
EXACT = ("trajectory_id", "call_index", "task_id", "policy_version", "prompt_token_ids", "output_token_ids",
         "top_token_ids", "support_complete", "temperature", "top_p", "top_k", "prompt_text", "output_text")


class PerPromptEngine:
    """In-process reference for seeded HTTP traffic: the server generates each seeded prompt alone
    with ``request_seed(seed, i)``, as ``VLLMClient`` sends it."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine

    def generate(self, prompts, params, seed=None):
        return [self.engine.generate([p], params, seed=request_seed(seed, i))[0] for i, p in enumerate(prompts)]


def _by_key(rows):
    return {(r["trajectory_id"], r["call_index"]): r for r in rows}


def test_http_traffic_records_what_the_engine_generates(tmp_path):
    res = make_resources({**TINY, "home": str(tmp_path / "home")})
    svc = open_services(res["settings"], res["store"])
    bootstrap.bootstrap_base_policy(svc, progress=False)
    live = svc.live()

    with served_deployment(svc, log_dir=tmp_path / "logs") as dep:
        stats = simulate_traffic_http(svc, 8, dep, seeded=True)
        assert stats["episodes"] == 8 and stats["policy_version"] == live.policy_version
        # the servers stay up across calls; the default (unseeded) path through simulate_traffic
        url = dep.recorder_url
        more = simulate_traffic(svc, 8, via="http", deployment=dep)
        assert dep.recorder_url == url and more["seed"] != stats["seed"]
    calls = svc.store.read_calls().to_pylist()
    assert len(calls) == stats["calls"] + more["calls"]
    rewards = svc.store.read_rewards()
    assert rewards.num_rows == 16 and set(rewards["source"].to_pylist()) == {"lab/arithmetic"}

    # 1. the seeded batch equals the in-process episodes run with the served seeds (same ids, tasks,
    # tokens; logprobs and top-K within 1e-5)
    engine = LocalEngine.from_pretrained(live.export_dir)
    params = svc.settings.deploy.sampling(stop_token_ids=stop_token_ids(engine.tokenizer))
    ref = run_episodes(PerPromptEngine(engine), engine.tokenizer, generate_tasks(8, stats["seed"]), params,
                       live.policy_version, stats["seed"])
    got, want = _by_key(calls), _by_key(ref.call_rows())
    assert set(want) <= set(got) and len(want) == stats["calls"]
    for k, w in want.items():
        g = got[k]
        for f in EXACT:
            assert g[f] == w[f], (k, f, g[f], w[f])
        np.testing.assert_allclose(g["output_logprobs"], w["output_logprobs"], atol=1e-5)
        np.testing.assert_allclose(np.asarray(g["top_logprobs"]), np.asarray(w["top_logprobs"]), atol=1e-5)
    rw = dict(zip(rewards["trajectory_id"].to_pylist(), rewards["reward"].to_pylist()))
    assert all(rw[e.trajectory_id] == e.reward for e in ref.episodes)

    # the in-process path for the same seed plays the same tasks under the same trajectory ids
    inproc = run_episodes(engine, engine.tokenizer, generate_tasks(8, stats["seed"]), params, live.policy_version,
                          stats["seed"])
    assert [e.trajectory_id for e in inproc.episodes] == [e.trajectory_id for e in ref.episodes]
    assert [e.calls[0]["prompt_token_ids"] for e in inproc.episodes] == [e.calls[0]["prompt_token_ids"]
                                                                          for e in ref.episodes]

    # 2. every recorded call (seeded and batched) re-scores to its recorded logprobs with the served weights
    scored = engine.score([c["prompt_token_ids"] for c in calls], [c["output_token_ids"] for c in calls], params)
    for c, s in zip(calls, scored):
        np.testing.assert_allclose(c["output_logprobs"], s, atol=1e-4)
        assert c["task_id"] and c["policy_version"] == live.policy_version

    # 3. the round selects the recorded data
    sel = data.select_data(svc, "round-000001")
    assert sel["num_trajectories"] == 8 and sel["quarantined"] == 0
    assert sel["data_versions"] == [live.policy_version]


def test_http_traffic_needs_a_store_the_recorder_can_write():
    class Svc:
        blobs = object()

    with pytest.raises(RuntimeError, match="local or S3 trajectory store"):
        with served_deployment(Svc()):
            pass


def test_http_traffic_lands_in_an_s3_store(tmp_path, s3_endpoint, bucket):
    """An S3-backed ``svc``: the recorder writes its Parquet parts to the bucket (WAL on local disk)."""
    res = make_resources({**TINY, "home": str(tmp_path / "home")},
                         s3={"s3_bucket": bucket, "s3_prefix": "prodrl", "s3_endpoint_url": s3_endpoint,
                             "s3_region": "us-east-1"})
    svc = open_services(res["settings"], res["store"])
    assert type(svc.blobs).__name__ == "S3BlobStore"
    bootstrap.bootstrap_base_policy(svc, progress=False)
    live = svc.live()

    with served_deployment(svc, log_dir=tmp_path / "logs") as dep:
        stats = simulate_traffic(svc, 8, via="http", deployment=dep)
    assert stats["episodes"] == 8 and stats["policy_version"] == live.policy_version
    assert not any((tmp_path / "home").rglob("*.parquet"))  # nothing written to local disk ...
    assert (tmp_path / "logs" / "recorder_wal").is_dir()  # ... but the WAL
    assert [k for k in svc.blobs.list("") if k.endswith(".parquet")]
    calls = svc.store.read_calls().to_pylist()
    assert len(calls) == stats["calls"] and {c["policy_version"] for c in calls} == {live.policy_version}
    assert all(c["task_id"] for c in calls)
    rewards = svc.store.read_rewards()
    assert rewards.num_rows == 8 and set(rewards["source"].to_pylist()) == {"lab/arithmetic"}
    sel = data.select_data(svc, "round-000001")
    assert sel["num_trajectories"] == 8 and sel["quarantined"] == 0


def test_http_traffic_records_the_extra_draw_for_sampled_score_centering(tmp_path):
    """``record_extra_draw`` over HTTP: the recorder asks `prodrl serve` for its extra draw, stores it,
    and the sampled score-centering round trains on it."""
    settings = {**TINY, "home": str(tmp_path / "home"), "record_extra_draw": True,
                "correction": "score_centering_sampled"}
    res = make_resources(settings)
    svc = open_services(res["settings"], res["store"])
    bootstrap.bootstrap_base_policy(svc, progress=False)
    with served_deployment(svc, log_dir=tmp_path / "logs") as dep:
        simulate_traffic(svc, 8, via="http", deployment=dep)
        stats = dep.stats()
    calls = svc.store.read_calls().to_pylist()
    assert calls and all(c["extra_token_ids"] is not None for c in calls)
    assert all(len(c["extra_token_ids"]) == len(c["output_token_ids"]) for c in calls)
    assert any(c["extra_token_ids"] != c["output_token_ids"] for c in calls)  # an independent draw
    assert stats.get("extra_draw_missing", 0) == 0
    data.select_data(svc, "round-000001")
    data.build_batch(svc, "round-000001")
    out = train.train(svc, "round-000001", progress=False)
    assert out["steps_taken"] + out["steps_skipped"] == TINY["steps_per_round"]
