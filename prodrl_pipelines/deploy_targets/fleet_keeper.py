"""The fleet keeper: one small Ray actor per Ray-placed deployment that keeps the endpoint file's
replica URLs where the servers are.

A replica's actor may bring its server back at another address (the port was taken, or the node died
and Ray restarted the actor elsewhere). Every second the keeper compares each listed replica's URL
with the one its actor last reported (``rec/<actor>`` in the cluster's store) and, once the server at
the new address answers with the model name the file lists for it, moves that one URL, under the
file's lock and with nothing else changed, so it can neither undo a commit nor a canary change. Until
then the recorder's health checks keep the replica out of rotation.

With the endpoint record in a file, the keeper is pinned to the node of the deploy step (which holds
the file), started at the first commit and stopped with the fleet; a deploy step on a host without a
raylet (connected through Ray Client) starts none, since no Ray process can run beside its file, and
a replica brought back at another address stays out of rotation until the next deploy lists it. With
the record in PostgreSQL (``deploy.endpoint_store``) every node reads it: the keeper runs wherever Ray
places it, Ray Client deploys included.
"""

from __future__ import annotations

import json
import threading
import time

PERIOD_S = 1.0


def serves(url: str, model: str, timeout: float = 2.0) -> bool:
    """Whether the server at ``url`` lists ``model``."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=timeout) as r:
            return model in {m.get("id") for m in json.loads(r.read()).get("data", [])}
    except Exception:  # noqa: BLE001 - not serving (yet)
        return False


def moved_replicas(endpoint, current_url) -> dict[str, str]:
    """``{listed url: new url}`` for the Ray-placed replicas (stable and canary) whose actor reports
    another address that already serves the listed model name. ``current_url(actor)`` -> url or None."""
    out = {}
    for r in endpoint.replica_list() + list((endpoint.canary or {}).get("replicas", [])):
        if not r.get("actor"):
            continue
        now = current_url(r["actor"])
        if now and now != r["url"] and serves(now, r["served_model_name"]):
            out[r["url"]] = now
    return out


def move_urls(where: str, moves: dict[str, str]) -> int:
    """Rewrite the listed URLs in ``moves`` (only those still listed as they were) in the endpoint
    record at ``where`` (``endpoint_store.location``); how many moved."""
    from prodrl_pipelines.deploy_targets.endpoint_store import open_endpoint

    done = []

    def change(ep):
        if ep is None:
            return None
        for r in ep.replica_list() + list((ep.canary or {}).get("replicas", [])):
            if r["url"] in moves:
                if ep.url == r["url"]:
                    ep.url = moves[r["url"]]
                r["url"] = moves[r["url"]]
                done.append(r["url"])
        return ep if done else None

    open_endpoint(where).update(change)
    return len(done)


class FleetKeeper:
    """The actor: follows the endpoint record at ``path`` (a location) until killed."""

    def __init__(self, path: str) -> None:
        self.path = str(path)
        self.moves = 0
        self.error = ""
        threading.Thread(target=self._run, daemon=True, name="fleet-keeper").start()

    def _run(self) -> None:
        from prodrl_pipelines.deploy_targets.endpoint_store import open_endpoint
        from prodrl_pipelines.deploy_targets.replica_host import kv_get

        def current_url(actor: str):
            rec = kv_get(f"rec/{actor}")
            return rec.get("url") if isinstance(rec, dict) else None

        while True:
            time.sleep(PERIOD_S)
            try:
                ep = open_endpoint(self.path).read()
                moves = moved_replicas(ep, current_url) if ep is not None else {}
                if moves:
                    self.moves += move_urls(self.path, moves)
            except Exception as e:  # noqa: BLE001 - kept for stats(); the next tick tries again
                self.error = f"{type(e).__name__}: {e}"

    def stats(self) -> dict:
        return {"moves": self.moves, "error": self.error, "path": self.path}


def keeper_name(target) -> str:
    from prodrl_pipelines.deploy_targets.ray_placement import prefix_of

    return f"{prefix_of(target)}-keeper"


def client_mode() -> bool:
    """Whether this process drives the cluster through Ray Client (its host runs no raylet)."""
    from ray.util.client import ray as client

    return client.is_connected()


def ensure_keeper(target):
    """The deployment's keeper (started when it is not running): pinned to this process's node when
    the endpoint record is its file; None through Ray Client then (``client_mode``: this host is no
    node of the cluster). A record in PostgreSQL: anywhere on the cluster."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from prodrl_pipelines.deploy_targets.endpoint_store import endpoint_location
    from prodrl_pipelines.deploy_targets.endpoint_store import is_database_url
    from prodrl_pipelines.deploy_targets.ray_placement import NAMESPACE

    placement = target.ray_placement()
    placement.connect()
    where = endpoint_location(target.home, target.deploy)
    shared = is_database_url(where)
    if client_mode() and not shared:
        return None
    name = keeper_name(target)
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        pass
    pin = {} if shared else {"scheduling_strategy": NodeAffinitySchedulingStrategy(
        ray.get_runtime_context().get_node_id(), soft=False)}
    try:
        return ray.remote(FleetKeeper).options(
            name=name, namespace=NAMESPACE, lifetime="detached", max_restarts=-1, num_cpus=0, **pin,
        ).remote(where)
    except ValueError:  # started meanwhile by another process
        return ray.get_actor(name, namespace=NAMESPACE)


def keeper_stats(target) -> dict:
    import ray

    from prodrl_pipelines.deploy_targets.ray_placement import CALL_TIMEOUT_S, NAMESPACE

    target.ray_placement().connect()
    try:
        return ray.get(ray.get_actor(keeper_name(target), namespace=NAMESPACE).stats.remote(), timeout=CALL_TIMEOUT_S)
    except ValueError:
        return {}


def stop_keeper(target) -> None:
    """Stop the deployment's keeper, found through the cluster its servers' records name (whoever
    stops a fleet, a stack shutting down included, may hold no cluster settings); none recorded: none runs."""
    import ray

    from prodrl_pipelines.deploy_targets.ray_placement import NAMESPACE, connect

    slots = [*range(max(target.replicas, 1)), target.CANARY]
    address = next((raw["ray_address"] for slot in slots for kind in ("current", "pending")
                    if (raw := target.slots.read(slot, kind)) and raw.get("ray_address")), None)
    if address is None:
        return
    connect(address)
    try:
        ray.kill(ray.get_actor(keeper_name(target), namespace=NAMESPACE), no_restart=True)
    except ValueError:  # none running
        pass
