"""The code location loads with every asset, check, sensor and job (what `dagster dev` shows)."""

import subprocess
from pathlib import Path
import sys

from dagster import AssetCheckKey, AssetKey

from prodrl_pipelines.definitions import defs


def test_code_location_contents():
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert keys == {"base_policy", "scored_rewards", "recorded_trajectories", "training_batch", "trained_checkpoint",
                    "exported_policy", "heldout_eval", "deployment", "live_heldout_eval", "store_compaction"}
    assert defs.resolve_schedule_def("live_eval_schedule").cron_schedule == "0 */6 * * *"
    assert defs.resolve_schedule_def("store_maintenance_schedule").cron_schedule == "17 * * * *"
    check = AssetCheckKey(AssetKey("heldout_eval"), "deployment_gate")
    assert check in graph.asset_check_keys
    assert graph.get_check_spec(check).blocking
    monitors = {AssetCheckKey(AssetKey("heldout_eval"), f"monitor_{n}")
                for n in ("format_errors", "length_drift", "refusal_rate", "kl", "slices")}
    assert monitors <= graph.asset_check_keys  # shown beside the gate; the gate counts the blocking ones
    assert {j.name for j in defs.resolve_all_job_defs()} >= {"prod_rl_round", "bootstrap", "lab_traffic_job",
                                                             "store_maintenance", "rescore_rewards_job"}
    assert defs.resolve_sensor_def("data_volume_sensor") is not None
    # no job starts a process per step (the lab's plugin job included)
    assert {j.executor_def.name for j in defs.resolve_all_job_defs()} == {"in_process"}
    # the round chain, in order
    chain = ["scored_rewards", "recorded_trajectories", "training_batch", "trained_checkpoint", "exported_policy", "heldout_eval",
             "deployment"]
    for up, down in zip(chain, chain[1:]):
        assert AssetKey(up) in graph.get(AssetKey(down)).parent_keys


def test_core_never_imports_dagster():
    """The wings below the Dagster layer, and the processes that get Services without it (the CLI's
    commands, a torchrun rank, the stack), import no Dagster module."""
    pkg = Path(__file__).resolve().parents[1] / "prodrl_pipelines"
    mods = [f"prodrl_pipelines.{w}.{p.stem}" for w in ("config", "storage", "loop") for p in sorted((pkg / w).glob("[a-z]*.py"))]
    mods += ["prodrl_pipelines.rl.trainer", "prodrl_pipelines.lab.traffic", "prodrl_pipelines.trajectories.selection",
             "prodrl_pipelines.engines.local", "prodrl_pipelines.quant.export", "prodrl_pipelines.trajectories.maintenance",
             "prodrl_pipelines.trajectories.eligibility", "prodrl_pipelines.trajectories.migrate",
             "prodrl_pipelines.cli.data", "prodrl_pipelines.cli.review", "prodrl_pipelines.cli.services",
             "prodrl_pipelines.ops.train_worker", "prodrl_pipelines.stack.stack"]
    code = f"import sys, {', '.join(mods)}; print('dagster' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
