"""The docs' measured tables are what their commands printed: ``scripts/docs_numbers.py --check``
against the stored results, the generator's own behaviour, and the reward-hacking walkthrough's
claims on a real run."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "docs_numbers.py"


def _docs_numbers():
    spec = importlib.util.spec_from_file_location("docs_numbers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_docs_say_what_the_stored_results_say():
    out = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def _tree(tmp_path: Path, body: str) -> Path:
    """A copy of the stored results and a README with every block, ``body`` in the walkthrough's."""
    shutil.copytree(REPO / "docs" / "results", tmp_path / "docs" / "results")
    others = "".join(f"<!-- docs-numbers:{n} -->\n<!-- /docs-numbers:{n} -->\n" for n in _docs_numbers().BLOCKS
                     if n != "reward_hacking")
    (tmp_path / "README.md").write_text(f"intro\n<!-- docs-numbers:reward_hacking -->\n{body}<!-- /docs-numbers:reward_hacking -->\n"
                                        f"{others}end\n")
    return tmp_path


def test_check_fails_on_a_stale_table_and_the_rewrite_fixes_it(tmp_path):
    dn = _docs_numbers()
    root = _tree(tmp_path, "| round | ... |\n| 3 | passed, deployed |\n")
    assert dn.main(["--check", "--root", str(root)]) == 1
    problems = dn.update(root, check=True)
    assert any("block 'reward_hacking' differs from docs/results/reward_hacking.json" in p for p in problems)
    assert dn.main(["--root", str(root)]) == 0  # rewrites every block
    assert dn.main(["--check", "--root", str(root)]) == 0
    text = (root / "README.md").read_text()
    assert text.startswith("intro\n") and text.endswith("end\n") and "| 3 | passed, deployed |" not in text
    r = json.loads((root / "docs" / "results" / "reward_hacking.json").read_text())
    assert f"`{r['command']}` at commit `{r['commit']}`" in text  # command, commit and machine beside it


def test_unknown_blocks_and_missing_results_are_named(tmp_path):
    dn = _docs_numbers()
    root = _tree(tmp_path, "")
    with (root / "README.md").open("a") as f:
        f.write("<!-- docs-numbers:nonesuch -->\n<!-- /docs-numbers:nonesuch -->\n")
    (root / "docs" / "results" / "slow_drift.json").unlink()
    problems = dn.update(root, check=True)
    assert any("unknown docs-numbers block 'nonesuch'" in p for p in problems)
    assert any("needs docs/results/slow_drift.json" in p for p in problems)


@pytest.mark.long(seconds=70)
def test_reward_hacking_walkthrough_claims_on_a_real_run(tmp_path, monkeypatch):
    """The walkthrough the README's table comes from, at its own size: the hole pays, the hack rounds
    are blocked by named checks, and after the fix the policy that serves at the end (the last fixed
    round deployed) has a held-out reward above the base. On the machine the stored result came from
    the run reproduces it exactly (whatever the directory).

    Asserted is what held on AVX512 and AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``), seeds 0 and 1,
    one and two torch threads, a core kept busy (docs/rewards.md): every hack round from the second on
    is blocked. The first is blocked on three of those four runs; on AVX2 seed 0 its drift stayed under
    every threshold and it deployed. A fixed round other than the first may be blocked (AVX2 seed 1,
    round 6, by ``slices``), so "the last round deploys" is not asserted."""
    from prodrl_pipelines.lab.provenance import provenance
    from prodrl_pipelines.lab.reward_hacking import walkthrough, walkthrough_settings

    monkeypatch.delenv("PRODRL_DAGSTER_HOME", raising=False)
    monkeypatch.delenv("DAGSTER_PG_URL", raising=False)
    settings, hack_rounds, fixed_rounds = walkthrough_settings()
    out = walkthrough(tmp_path / "elsewhere" / "home", settings, hack_rounds, fixed_rounds, log=lambda *_: None)
    rounds = out["rounds"]
    hack, fixed = rounds[:hack_rounds], rounds[hack_rounds:]
    assert len(fixed) == fixed_rounds
    for i, r in enumerate(hack):
        assert r["holey_reward"] > r["exact_reward"]  # the hole pays
        blockers = [k for k, v in [*r["monitors"].items(), *r["cumulative_monitors"].items()]
                    if not v["passed"] and v["blocking"]]
        if i or not r["deployed"]:  # a blocked round names its monitors; the first may deploy (docstring)
            assert not r["gate_passed"] and not r["deployed"] and blockers, r
    deployed = [r for r in fixed if r["deployed"]]  # a fixed round may be blocked (AVX2, seed 1: round 6)
    seen = [(r["round"], r["heldout_reward"], r["deployed"], r["gate_reasons"]) for r in fixed]
    assert deployed and deployed[-1]["heldout_reward"] > out["base_heldout_reward"], \
        (out["base_heldout_reward"], provenance([])["machine"], seen)  # what serves at the end
    assert out["rescore"]["changed"] > 0 and out["rescore"]["new_mean"] < out["rescore"]["old_mean"]
    _walkthrough_bookkeeping(tmp_path / "elsewhere" / "home", settings, out, hack, fixed)

    stored = json.loads((REPO / "docs" / "results" / "reward_hacking.json").read_text())
    if stored["machine"] != provenance([])["machine"]:
        pytest.skip(f"stored result from {stored['machine']}: exact reproduction checked only there")
    dn = _docs_numbers()
    here = {**stored, "rounds": rounds, "rescore": out["rescore"], "base_heldout_reward": out["base_heldout_reward"]}
    assert dn.render_reward_hacking(here, "x") == dn.render_reward_hacking(stored, "x")


def _walkthrough_bookkeeping(home, settings, out, hack, fixed) -> None:
    """What the walkthrough's story rests on, whatever the learning curve: each round trained on its
    grader's rewards, every monitor recorded and the gate decided, the rescore's provenance, and the
    decided hack rounds keeping the rewards they trained on after the rescore."""
    from prodrl_pipelines.lab.reward_hacking import EXACT, HOLEY, round_row
    from prodrl_pipelines.evaluation.monitors import MONITORS
    from prodrl_pipelines.resources.settings import make_resources, open_services

    for r in hack:
        assert r["grader"] == HOLEY.split(":")[1] and r["trained_reward"] == pytest.approx(r["holey_reward"])
        assert r["hedge_rate"] > 0  # hedges pay only with the hole
    for r in fixed:
        assert r["grader"] == EXACT.split(":")[1] and r["trained_reward"] == pytest.approx(r["exact_reward"])
    for r in (*hack, *fixed):
        assert set(r["monitors"]) == set(MONITORS) and r["gate_passed"] in (True, False)
        assert r["heldout_holey"] >= r["heldout_reward"] - 1e-9
    rep = out["rescore"]
    assert rep["trajectories"] == rep["scored"] >= 16
    assert rep["from_versions"] == [f"{HOLEY}@" + rep["version"].rsplit("@", 1)[1]]
    res = make_resources({**settings, "home": str(home)})
    svc = open_services(res["settings"], res["store"])
    for r in hack:
        assert round_row(svc, r["round"])["trained_reward"] == pytest.approx(r["holey_reward"])
