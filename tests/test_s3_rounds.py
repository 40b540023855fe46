"""Rounds on an S3 store: trained checkpoints and exports are published to the bucket,
and every step can run on a machine whose local disk holds none of them (another pod, a restarted
worker): it fetches what it needs, verified against the manifest."""

import shutil

import pytest

from prodrl_pipelines.loop import bootstrap
from prodrl_pipelines.loop import promotion
from prodrl_pipelines.loop import data
from prodrl_pipelines.loop import evaluate
from prodrl_pipelines.loop import export
from prodrl_pipelines.loop import gate
from prodrl_pipelines.loop import services
from prodrl_pipelines.loop import train
from prodrl_pipelines.storage.checkpoints import S3CheckpointStore
from prodrl_pipelines.lab.traffic import simulate_traffic
from prodrl_pipelines.resources.settings import make_resources, open_services

TINY = {"lab_size": "tiny", "lab_sft_steps": 30, "steps_per_round": 2, "batch_size": 4,
        "heldout_size": 12, "max_tokens": 6, "gate_tolerance": 1.0}


def _fresh_machine(home):
    """Forget every local checkpoint and export (the trajectory store is on S3 already)."""
    for d in ("checkpoints", "exports"):
        shutil.rmtree(home / d, ignore_errors=True)


def test_round_steps_run_on_fresh_machines_from_the_s3_stores(tmp_path, s3_endpoint, bucket):
    home = tmp_path / "home"
    res = make_resources({**TINY, "home": str(home)},
                         s3={"s3_bucket": bucket, "s3_prefix": "prodrl", "s3_endpoint_url": s3_endpoint,
                             "s3_region": "us-east-1"})
    svc = open_services(res["settings"], res["store"])
    assert isinstance(svc.checkpoints_store, S3CheckpointStore) and svc.checkpoints_store.prefix == "checkpoints"

    boot = bootstrap.bootstrap_base_policy(svc, progress=False)
    services.publish_export(svc, "round-000000", boot["export"]["export_dir"])  # as the base_policy asset does
    assert svc.checkpoints_store.names() == ["round-000000"]
    simulate_traffic(svc, 8)

    rkey = "round-000001"
    _fresh_machine(home)
    data.select_data(svc, rkey)  # needs only the live config (vocab size): fetched
    assert (home / "checkpoints" / "round-000000" / "config.json").is_file()
    data.build_batch(svc, rkey)
    _fresh_machine(home)
    stats = train.train(svc, rkey, progress=False)
    assert svc.checkpoints_store.names() == ["round-000000", rkey]  # published after saving
    manifest = svc.checkpoints_store.manifest(rkey)
    assert {"config.json", "model.safetensors"} <= {f["path"] for f in manifest["files"]}

    _fresh_machine(home)  # the export step runs elsewhere: it fetches the trained checkpoint
    exp = export.export(svc, rkey)
    services.publish_export(svc, rkey, exp["export_dir"])  # as the exported_policy asset does
    _fresh_machine(home)  # evaluation elsewhere: candidate and live exports both fetched
    ev = evaluate.evaluate(svc, rkey)
    assert ev["candidate"] is not None and not ev["smoke_error"]
    _fresh_machine(home)
    assert gate.gate(svc, rkey)[0].passed
    promotion.deploy(svc, rkey)

    _fresh_machine(home)  # the next round's machine finds the new live policy in the stores
    live = svc.live()
    assert live.policy_version == rkey
    assert (home / "checkpoints" / rkey / "config.json").is_file()
    assert (home / "exports" / rkey / "prodrl_export.json").is_file()
    assert stats["global_step"] >= 0

    # a version that was never published is reported where it was expected, naming the store
    svc.blobs.delete(f"checkpoints/{rkey}/checkpoint_manifest.json")
    _fresh_machine(home)
    with pytest.raises(services.RoundError, match=r"live checkpoint round-000001 is missing at .* and in"):
        svc.live()


def test_processes_outside_dagster_rebuild_the_same_stores(monkeypatch, tmp_path):
    from prodrl_pipelines.loop.services import services_from_env
    from prodrl_pipelines.config import environment

    fields = {"root": "", "s3_bucket": "b", "s3_prefix": "team/p", "s3_endpoint_url": "http://127.0.0.1:9",
              "s3_region": "us-east-1"}
    for k, v in environment.write(settings={"home": str(tmp_path / "h")}, store=fields).items():
        monkeypatch.setenv(k, v)
    assert environment.read_store() == fields
    svc = services_from_env()
    assert type(svc.blobs).__name__ == "S3BlobStore" and svc.blobs.bucket == "b" and svc.blobs.prefix == "team/p"
    assert isinstance(svc.checkpoints_store, S3CheckpointStore) and isinstance(svc.exports_store, S3CheckpointStore)
    monkeypatch.setenv("PRODRL_S3_BUCKET", "")
    monkeypatch.setenv("PRODRL_STORE_ROOT", str(tmp_path / "s"))
    local = services_from_env()
    assert local.checkpoints_store is None and str(local.blobs.root) == str(tmp_path / "s")
