"""Held-out evaluation sharded over Ray workers (the session's two-node local cluster): the same
episodes as in-process for the same seed, batch by batch; a worker that cannot load the policy
fails naming the shard; the default (one batch) is the unbatched evaluation unchanged."""

from __future__ import annotations

import os

import pytest

from prodrl_pipelines.config.settings import settings_from_flat
from prodrl_pipelines.evaluation import evaluate_policy, load_suite, play_episodes, stop_token_ids
from prodrl_pipelines.evaluation.heldout import heldout_tasks
from prodrl_pipelines.evaluation.batches import batch_seed
from prodrl_pipelines.evaluation.runners import (EpisodeWork, EvalShardError, InProcessRunner,
                                                 make_runner, runner_for)


def _settings(tmp_path, **over):
    return settings_from_flat({"home": str(tmp_path), "heldout_size": 8, "max_tokens": 6, "eval_seed": 77, **over})


def _work(settings, suite, export_dir, version="v-test") -> EpisodeWork:
    return EpisodeWork(str(export_dir), version, suite, heldout_tasks(settings, suite), settings.deploy.sampling(),
                       settings.eval.eval_seed, settings.eval.episode_batch)


def _facts(eps) -> list:
    """Everything an episode sampled and scored (not the wall-clock stamps)."""
    return [(e.trajectory_id, e.task_id, e.reward, e.reward_error, e.assistant_texts,
             [(c.prompt_token_ids, c.record.output_token_ids, c.record.output_logprobs, c.record.top_token_ids,
               c.record.top_logprobs, c.record.finish_reason) for c in e.calls]) for e in eps]


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return load_suite("lab", "", _settings(tmp_path_factory.mktemp("s")))


@pytest.fixture(scope="module")
def ray_runner(ray_cluster, tiny_policy_dir, one_torch_thread):
    from prodrl_pipelines.cluster.local import LOOPBACK_ENV

    os.environ.update(LOOPBACK_ENV)  # before Ray reads it (at import): 127.0.0.1 stays 127.0.0.1
    import ray
    from ray._private import ray_constants

    from prodrl_pipelines.evaluation.ray_runner import RayEpisodeRunner

    ray_constants.ENABLE_RAY_CLUSTER = False  # the same, when another module imported Ray first
    # the head's GCS listens on loopback; the address Ray reports may name the machine's primary one
    ray.init(address="127.0.0.1:" + ray_cluster.gcs_address.rpartition(":")[2], log_to_driver=False)
    runner = RayEpisodeRunner(workers=2, cpus_per_worker=1)
    try:
        runner.prepare(str(tiny_policy_dir))  # both actors load the engine before any shard is timed
        yield runner
    finally:
        runner.close()
        ray.shutdown()


def test_one_batch_is_the_unbatched_evaluation(tmp_path, suite, tiny_policy_dir, one_torch_thread):
    """episode_batch 0 (the default) or >= the tasks: batch 0 keeps eval_seed and the ids, so the
    evaluation is exactly the one played before batches existed; smaller batches draw other samples."""
    from prodrl_pipelines.engines.local import LocalEngine

    s = _settings(tmp_path)
    eng = LocalEngine.from_pretrained(tiny_policy_dir)
    stops = stop_token_ids(eng.tokenizer, tiny_policy_dir)
    tasks = heldout_tasks(s, suite)
    direct = play_episodes(eng, eng.tokenizer, suite, tasks, s.deploy.sampling(), "v-test", 77, stops=stops)
    runner = InProcessRunner()
    for batch in (0, 8, 100):
        work = _work(_settings(tmp_path, eval_episode_batch=batch), suite, tiny_policy_dir)
        assert len(work.batches()) == 1
        assert _facts(runner.play(work, engine=eng, stops=stops)) == _facts(direct)
    work = _work(_settings(tmp_path, eval_episode_batch=3), suite, tiny_policy_dir)
    assert [(r.start, r.stop) for r in work.batches()] == [(0, 3), (3, 6), (6, 8)]
    assert batch_seed(77, 0) == 77 and len({batch_seed(77, b) for b in range(3)}) == 3
    split = runner.play(work, engine=eng, stops=stops)
    assert [e.trajectory_id for e in split] == [e.trajectory_id for e in direct]  # ids do not depend on batches


def test_runner_choice_from_the_cluster_settings():
    from prodrl_pipelines.cluster.config import ClusterSettings

    assert runner_for(None) == "in_process"
    assert runner_for(ClusterSettings()) == "in_process"
    addr = "http://127.0.0.1:8265"
    assert runner_for(ClusterSettings(cluster="ray", cluster_address=addr)) == "in_process"  # 0 eval workers
    assert runner_for(ClusterSettings(cluster="ray", cluster_address=addr, cluster_eval_workers=2)) == "ray"
    assert isinstance(make_runner(None), InProcessRunner)
    with pytest.raises(ValueError, match="unknown episode runner 'slurm'; known: in_process, ray"):
        make_runner(None, "slurm")


def test_two_ray_workers_give_the_in_process_evaluation(tmp_path, suite, tiny_policy_dir, ray_runner):
    s = _settings(tmp_path, eval_episode_batch=2)  # 4 batches over 2 workers
    work = _work(s, suite, tiny_policy_dir)
    local = InProcessRunner()
    on_ray = ray_runner.play(work)
    assert {w for _, w in ray_runner.placement} == {0, 1}  # both workers played shards
    assert sorted(b for b, _ in ray_runner.placement) == [0, 1, 2, 3]
    assert _facts(on_ray) == _facts(local.play(work))
    # the whole held-out evaluation (rewards, per-episode facts the monitors compare, every call)
    ev_local = evaluate_policy(s, suite, tiny_policy_dir, "v-test", keep_calls=True, runner=local)
    ev_ray = evaluate_policy(s, suite, tiny_policy_dir, "v-test", keep_calls=True, runner=ray_runner)
    assert ev_ray == ev_local
    assert ev_ray["num_tasks"] == 8 and len(ev_ray["calls"]) >= 8


def test_a_worker_that_cannot_load_the_policy_names_the_shard(tmp_path, suite, tiny_policy_dir, ray_runner):
    broken = tmp_path / "broken-export"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    work = _work(_settings(tmp_path, eval_episode_batch=4), suite, broken, version="round-000003")
    with pytest.raises(EvalShardError, match=r"shard [12]/2 \(episodes \d-\d\) of round-000003 at .*broken-export "
                                             r"failed on Ray evaluation worker [01] \(node [0-9a-f]{12}\): "
                                             r"RuntimeError: cannot load the policy at .*broken-export"):
        ray_runner.play(work)
    # the pool survives a failed evaluation
    ok = _work(_settings(tmp_path, eval_episode_batch=4), suite, tiny_policy_dir)
    assert _facts(ray_runner.play(ok)) == _facts(InProcessRunner().play(ok))
