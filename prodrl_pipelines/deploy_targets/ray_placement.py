"""Replica servers on a Ray cluster: each owned by a detached, named actor in a placement group of its own.

``replica_placement: ray`` (``ManagedServerTarget``): instead of a child process of the deploying
process, a replica's server is a child of a ``ReplicaHost`` actor on whichever node Ray places the
actor's placement group (one bundle of ``replica_cpus`` CPUs and ``replica_gpus`` GPUs). The actor
picks the port on its node (the blue/green port when free there), starts the same command line the
local placement runs (listening on the node's address), and reports (node id, node address, port,
pid). It is detached (it outlives the Dagster run that started it, as a local server outlives it in a
session of its own) and named ``<prefix>-<slot>-<blue/green port>`` in ``NAMESPACE``, so the next run
finds it again from the slot's record (``slot_state``), which carries the name and the GCS address.
The actor (``replica_host``) supervises its server and brings the slot's live version back after the
server, the actor's worker or the node died; ``refresh`` reads a record with the address its actor
reports now.

Ray is imported inside functions only (``cluster: local`` never loads it). The export path must be
readable on the node: the local cluster shares this disk; a real cluster reads it from the store.
"""

from __future__ import annotations

import os
import time
from urllib.parse import urlparse

from prodrl_pipelines.deploy_targets.base import DeployError
from prodrl_pipelines.deploy_targets.replica_host import kv_del, kv_get, kv_put, slot_key, with_address

NAMESPACE = "prodrl-fleet"  # named actors are per namespace: every driver of the fleet uses this one
GCS_PORT = 6379  # `ray start --head`'s default GCS port (a dashboard URL does not say it)
CALL_TIMEOUT_S = 30.0
# an actor's first call waits for a worker process to start on its node (Python and Ray imported):
# seconds on a quiet node, far more on a loaded one; not the health timeout that bounds the placement
ACTOR_START_S = 180.0
# variables Ray sets per worker for the resources it gave: the node's own values win
NODE_OWNED = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
# what travels even when this process has the same value: a node's own environment lacks the deployment's key
ALWAYS_SENT = ("VLLM_API_KEY",)


def gcs_address(cluster_address: str) -> str:
    """Where a driver connects: ``RAY_ADDRESS`` when set, else the dashboard's host on the GCS port."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    host = urlparse(cluster_address).hostname
    if not host:
        raise DeployError(f"replica_placement 'ray': cluster_address {cluster_address!r} names no host")
    return f"{host}:{GCS_PORT}"


CLIENT_PORT = 10001  # `ray start --head`'s default Ray Client port
CLIENT_TRIES = 3  # a Ray Client connection whose server-side process failed to start is made again


def local_raylet(gcs: str) -> bool:
    """Whether a raylet of the cluster whose GCS is ``gcs`` runs on this host (in its process table).
    A plain driver needs one: without it ``ray.init(address=GCS)`` waits for a raylet forever."""
    port = gcs.rsplit(":", 1)[-1]
    try:
        here = os.readlink("/proc/self/ns/net")
    except OSError:
        here = None
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
            # a process table may show other hosts' processes (a parent PID namespace): same network only
            if here is not None and args and args[0].endswith("/raylet") and os.readlink(f"/proc/{pid}/ns/net") != here:
                continue
        except OSError:
            continue
        if args and args[0].endswith("/raylet") and any(
                a.startswith("--gcs-address=") and a.rsplit(":", 1)[-1] == port for a in args):
            return True
    return False


def driver_address(address: str) -> str:
    """Where this process connects: ``address`` (a GCS ``host:port``) when a raylet of that cluster runs
    on this host, else Ray Client on the GCS host (``ray://host:10001``), which needs none: a host that
    runs no raylet (Dagster's, on KubeRay or Slurm) still drives the fleet. ``ray://...`` and "auto" as given."""
    if not address or address == "auto" or address.startswith("ray://") or local_raylet(address):
        return address
    return f"ray://{address.rsplit(':', 1)[0]}:{CLIENT_PORT}"


def connect(address: str = "") -> str:
    """This process's Ray connection (made to ``address`` when there is none yet, through
    ``driver_address``); the address another process of this deployment connects to again."""
    if not _ray_initialized():
        if address.split(":")[0] in ("127.0.0.1", "localhost"):
            from prodrl_pipelines.cluster.local import LOOPBACK_ENV

            for k, v in LOOPBACK_ENV.items():  # read once, when Ray is first imported
                os.environ.setdefault(k, v)
        import ray

        target = driver_address(address)
        tries = CLIENT_TRIES if target.startswith("ray://") else 1
        for attempt in range(1, tries + 1):
            try:
                ray.init(address=target or "auto", namespace=NAMESPACE, log_to_driver=False)
                break
            except Exception as e:  # noqa: BLE001 - any failure to connect: said with the address
                if attempt < tries:  # the head's client server failed to start this client's server
                    time.sleep(2.0 * attempt)
                    continue
                raise DeployError(f"replica_placement 'ray': cannot connect to the Ray cluster at {target or 'auto'} "
                                  f"({type(e).__name__}: {e}); set RAY_ADDRESS to its GCS address") from None
    import ray

    return ray.get_runtime_context().gcs_address


def _ray_initialized() -> bool:
    import sys

    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


class RayPlacement:
    """Starts, finds and stops replica servers through ``ReplicaHost`` actors (one per slot and
    blue/green port, ``prefix`` telling deployments apart on a shared cluster)."""

    def __init__(self, cluster_address: str, prefix: str, cpus: float = 1.0, gpus: float = 0.0,
                 ready_timeout_s: float = 120.0, runtime_env: dict | None = None,
                 fetch_timeout_s: float = 3600.0) -> None:
        self.cluster_address, self.prefix = cluster_address, prefix
        self.runtime_env = runtime_env or {}  # as the jobs get it: credentials, caches
        self.cpus, self.gpus, self.ready_timeout_s = cpus, gpus, ready_timeout_s
        self.fetch_timeout_s = fetch_timeout_s
        self.address = ""

    def connect(self) -> None:
        if not self.address:
            self.address = connect("" if _ray_initialized() else gcs_address(self.cluster_address))

    def name(self, slot, port: int) -> str:
        return f"{self.prefix}-{slot}-{port}"

    def start(self, slot, preferred_port: int, command, env: dict, log: str, version: str = "",
              export: str = "", avoid_nodes: tuple[str, ...] = (), source: dict | None = None) -> dict:
        """A server on the node Ray picks (none of ``avoid_nodes``): ``command(port, host)`` is its
        command line. Returns the record's placement fields (node, host, port, pid, actor, ray_address)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from prodrl_pipelines.deploy_targets.replica_host import ReplicaHost

        self.connect()
        name = self.name(slot, preferred_port)
        stop(name, self.address)  # one left by a crashed deploy (never committed) holds the name
        bundle = {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}
        selector = {"bundle_label_selector": [{"ray.io/node-id": f"!in({','.join(sorted(avoid_nodes))})"}]} \
            if avoid_nodes else {}
        pg = placement_group([bundle], strategy="STRICT_PACK", name=name, lifetime="detached", **selector)
        try:
            ray.get(pg.ready(), timeout=self.ready_timeout_s)
        except Exception as e:  # noqa: BLE001 - a bundle that does not fit: said with what it asked
            ray.util.remove_placement_group(pg)
            where = (f" on a node other than the {len(avoid_nodes)} holding the other replicas (replica_spread)"
                     if avoid_nodes else "")
            raise DeployError(f"replica {slot}: no node of the Ray cluster offered {bundle}{where} within "
                              f"{self.ready_timeout_s:.0f}s ({type(e).__name__}; cluster resources: "
                              f"{ray.available_resources()})") from None
        try:
            # detached: a restartable actor in a placement group is what Ray warns about, and what we want:
            # removing the group on stop is what ends the replica for good
            actor = ray.remote(ReplicaHost).options(
                name=name, namespace=NAMESPACE, lifetime="detached", max_restarts=-1, max_concurrency=4,
                num_cpus=self.cpus, num_gpus=self.gpus,
                **({"runtime_env": self.runtime_env} if self.runtime_env else {}),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)).remote(name)
            start_s = max(self.ready_timeout_s, ACTOR_START_S)
            at = ray.get(actor.where.remote(preferred_port), timeout=start_s)
            if source:  # fetched from the store before the start, under a budget sized for a download
                ray.get(actor.fetch.remote(export, source), timeout=self.fetch_timeout_s)
            pid = ray.get(actor.start.remote(command(at["port"], at["host"]), env, log, at["port"], version, export,
                                             source), timeout=start_s)
        except BaseException as e:  # the actor, its group and its marks go; a Ray error is a failed start
            stop(name, self.address)
            if isinstance(e, Exception) and not isinstance(e, DeployError):
                raise DeployError(f"replica {slot}: its server did not start on the Ray cluster "
                                  f"({type(e).__name__}: {str(e)[:500]})") from e
            raise
        return {**at, "pid": pid, "actor": name, "ray_address": self.address}


def _actor(name: str, address: str):
    import ray

    connect(address)
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:  # no such actor (stopped, or never started)
        return None


def alive(name: str, address: str) -> bool:
    """Whether the actor ``name`` runs and its server process too (False when either is gone)."""
    import ray

    actor = _actor(name, address)
    if actor is None:
        return False
    try:
        return bool(ray.get(actor.alive.remote(), timeout=CALL_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - dead, restarting or unreachable: not serving
        return False


def log_tail(name: str, address: str) -> str:
    import ray

    actor = _actor(name, address)
    try:
        return ray.get(actor.tail.remote(), timeout=CALL_TIMEOUT_S) if actor is not None else ""
    except Exception:  # noqa: BLE001 - only for an error message
        return ""


def stop(name: str, address: str, grace_s: float = 20.0) -> bool:
    """Drain and stop the server of actor ``name``, kill the actor, remove its placement group;
    True when a server was running. Nothing named so: nothing to do."""
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group_table

    actor = _actor(name, address)
    was = False
    if actor is not None:
        try:
            was = bool(ray.get(actor.stop.remote(grace_s), timeout=grace_s + CALL_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - a dead actor's server went with its worker
            pass
        ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while _actor(name, address) is not None and time.monotonic() < deadline:  # the name frees up
            time.sleep(0.1)
    for pg_id, pg in placement_group_table().items():  # by id: a name is looked up in one namespace only
        if pg.get("name") == name and pg.get("state") != "REMOVED":
            ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
    if kv_get(slot_key(name)) == name:
        kv_del(slot_key(name))
    kv_del(f"spec/{name}")
    kv_del(f"rec/{name}")
    return was


def mark_live(raw: dict) -> None:
    """Make the server a record names its slot's live one: the one brought back after a failure."""
    if raw.get("actor"):
        connect(raw.get("ray_address", ""))
        kv_put(slot_key(raw["actor"]), raw["actor"])


def clear_live(raw: dict) -> None:
    if raw.get("actor"):
        connect(raw.get("ray_address", ""))
        if kv_get(slot_key(raw["actor"])) == raw["actor"]:
            kv_del(slot_key(raw["actor"]))


def refresh(raw: dict) -> dict:
    """A record with the address, port and pid its actor reports now (it moves when the server, the
    actor or the node was restarted)."""
    if not raw.get("actor"):
        return raw
    connect(raw.get("ray_address", ""))
    now = kv_get(f"rec/{raw['actor']}")
    if not isinstance(now, dict):
        return raw
    return {**raw, **{k: now[k] for k in ("node", "host", "port", "pid", "url") if k in now}}


def info(name: str, address: str) -> dict:
    """What the actor says of itself (alive, pid, restarts, node); empty when it is gone."""
    import ray

    actor = _actor(name, address)
    try:
        return ray.get(actor.info.remote(), timeout=CALL_TIMEOUT_S) if actor is not None else {}
    except Exception:  # noqa: BLE001 - dead or restarting
        return {}


def prefix_of(target) -> str:
    """What this deployment's actors are named after: the target and a digest of where its slots'
    records live (its state directory, or the database row every deploying host shares)."""
    from prodrl_pipelines.deploy_targets.slot_state import identity_digest

    return f"{target.name}-{identity_digest(target.slots)}"


def placement_for(target) -> RayPlacement:
    """The placement of a managed target's replicas: the cluster of ``target.cluster`` (else of the
    environment's settings, ``PRODRL_SETTINGS_JSON``), actors named after where its slots are recorded."""
    cluster = target.cluster
    if cluster is None:
        from prodrl_pipelines.cluster.config import cluster_settings
        from prodrl_pipelines.config import environment

        cluster = cluster_settings(environment.read_settings())
    if not cluster.on_ray:
        raise DeployError(f"{target.name}: replica_placement 'ray' needs cluster 'ray' and cluster_address "
                          "(the Ray dashboard URL)")
    d = target.deploy
    return RayPlacement(cluster.cluster_address, prefix_of(target), d.replica_cpus, d.replica_gpus,
                        ready_timeout_s=min(float(d.health_timeout_s), 300.0), runtime_env=cluster.runtime_env(),
                        fetch_timeout_s=float(d.export_fetch_timeout_s))


def start_replica(target, export_dir, policy_version: str, port: int, slot, log: str,
                  avoid_nodes: tuple[str, ...] = ()) -> dict:
    """A ``ServerRecord``'s fields for a new server of ``target`` placed on the Ray cluster: the same
    command line as a local one, on the node's address and the port the node gave (``port`` when free
    there). Only the variables the target changes travel; the node's own environment is the base."""
    from prodrl_pipelines.deploy_targets.node_exports import export_source

    placement = target.ray_placement()
    env = {k: v for k, v in target.server_environment(port).items()
           if (os.environ.get(k) != v or k in ALWAYS_SENT) and k not in NODE_OWNED}
    source = export_source(target.settings, export_dir)  # None: the store is this disk, shared with the nodes
    at = placement.start(slot, port, lambda p, host: with_address(target.command(export_dir, p, policy_version),
                                                                   host, p),
                         env, log, version=policy_version, export=str(export_dir), avoid_nodes=avoid_nodes,
                         source=source)
    return {"pid": at["pid"], "port": at["port"], "url": f"http://{at['host']}:{at['port']}",
            "policy_version": policy_version, "export_dir": str(export_dir), "log": log,
            "started_at": time.time(), "node": at["node"], "host": at["host"], "actor": at["actor"],
            "ray_address": at["ray_address"]}
