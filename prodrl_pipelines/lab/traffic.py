"""Simulated production traffic: lab tasks served by the live deployment, rewards posted after.

Calls are written first and rewards separately, as a real feedback channel would deliver them.
"""

from __future__ import annotations

import json

from prodrl_pipelines.storage import keys
from prodrl_pipelines.lab.episodes import run_episodes, stop_token_ids
from prodrl_pipelines.lab.tasks import get_task


def simulate_traffic(svc, n_episodes: int, via: str = "in_process", deployment=None) -> dict:
    """Serve ``n_episodes`` fresh tasks of the lab task (``settings.lab.task``) with the live deployment
    and record them."""
    # via="http": episodes -> prodrl record -> prodrl serve on loopback; "http-seeded": each call
    # carries its own seed, so what is sampled does not depend on how the server batched the calls
    if via in ("http", "http-seeded"):
        from prodrl_pipelines.lab.http_traffic import simulate_traffic_http

        return simulate_traffic_http(svc, n_episodes, deployment=deployment, seeded=via == "http-seeded")
    if via != "in_process":
        raise ValueError(f"via must be 'http', 'http-seeded' or 'in_process', got {via!r}")
    live = svc.live()
    blobs = svc.blobs
    key = keys.TRAFFIC_BATCHES
    batches = json.loads(blobs.get_bytes(key)) if blobs.exists(key) else []
    seed = svc.settings.lab.seed * 7_919 + 104_729 * (len(batches) + 1)
    from prodrl_pipelines.engines.local import LocalEngine  # torch: only where the lab serves in process

    engine = LocalEngine.from_pretrained(live.export_dir)
    params = svc.settings.deploy.sampling(stop_token_ids=stop_token_ids(engine.tokenizer))
    env = get_task(svc.settings.lab.task)
    eps = run_episodes(engine, engine.tokenizer, env.generate_tasks(n_episodes, seed), params, live.policy_version,
                       seed, env=env)
    store = svc.store
    store.write_calls(eps.calls_table())
    store.write_rewards(eps.rewards_table())
    stats = {"policy_version": live.policy_version, "episodes": len(eps), "reward_mean": eps.mean_reward,
             "calls": sum(len(e.calls) for e in eps.episodes), "seed": seed}
    batches.append(stats)
    blobs.put_bytes(key, json.dumps(batches).encode())
    return stats
