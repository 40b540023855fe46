"""A scorer's version follows the code it runs: editing a rubric (in the grader's module, a module it
imports, the command's script or a file its command line names, a verifiers taskset's package) makes
a new version, so ``rescore`` finds the grades of the old one stale. Editing what the scorer does not
run (another module, the standard library) changes nothing."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from helpers import make_trajectory
from prodrl_pipelines.rewards.code_version import code_files, files_hash
from prodrl_pipelines.harnesses.command import CommandSource
from prodrl_pipelines.rewards.config import RewardSettings
from prodrl_pipelines.rewards.scoring import RewardPlan, rescore, score_missing
from prodrl_pipelines.rewards.sources import GraderSource
from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.store import TrajectoryStore


def _fresh(*names: str) -> None:
    for n in names:
        sys.modules.pop(n, None)
    importlib.invalidate_caches()


@pytest.fixture
def code(tmp_path, monkeypatch):
    """A grader package on sys.path: ``rubrics.grade:grade`` reads its rule from ``rubrics.rule``."""
    pkg = tmp_path / "rubrics"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "grade.py").write_text("import json\nfrom .rule import WANT\n\n\ndef grade(t):\n"
                                  "    return float(t.outputs[-1].strip() == WANT)\n")
    (pkg / "rule.py").write_text('WANT = "4"\n')
    (pkg / "unrelated.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _fresh("rubrics", "rubrics.grade", "rubrics.rule", "rubrics.unrelated")
    yield pkg
    _fresh("rubrics", "rubrics.grade", "rubrics.rule", "rubrics.unrelated")


def test_a_graders_version_covers_the_modules_it_imports_and_nothing_else(code):
    rs = RewardSettings(sources=("grader",), grader="rubrics.grade:grade")
    first = GraderSource(rs).version
    names = [n for n, _ in code_files(code / "grade.py", code.parent)]
    assert names == ["rubrics", "rubrics.grade", "rubrics.rule"]  # json (stdlib) and unrelated.py are not in it
    (code / "unrelated.py").write_text("X = 2\n")
    _fresh("rubrics", "rubrics.grade", "rubrics.rule")
    assert GraderSource(rs).version == first
    (code / "rule.py").write_text('WANT = "5"\n')  # the rubric edited, the grader's own file unchanged
    _fresh("rubrics", "rubrics.grade", "rubrics.rule")
    assert GraderSource(rs).version != first


SCRIPT = textwrap.dedent('''
    import json, sys
    from rule import WANT
    rubric = open(sys.argv[1].split("=", 1)[1]).read().strip()
    for line in sys.stdin:
        t = json.loads(line)
        ok = t["outputs"][-1].strip() in (WANT, rubric)
        print(json.dumps({"trajectory_id": t["trajectory_id"], "reward": float(ok)}))
''')


def test_a_commands_version_covers_its_script_what_it_imports_beside_it_and_the_files_it_names(tmp_path):
    (tmp_path / "score.py").write_text(SCRIPT)
    (tmp_path / "rule.py").write_text('WANT = "4"\n')
    (tmp_path / "rubric.txt").write_text("7\n")
    (tmp_path / "other.py").write_text("X = 1\n")
    argv = [sys.executable, str(tmp_path / "score.py"), f"--rubric={tmp_path / 'rubric.txt'}"]
    versions = [CommandSource(None, argv=argv).version]
    (tmp_path / "other.py").write_text("X = 2\n")  # not imported by the script
    assert CommandSource(None, argv=argv).version == versions[0]
    for path, text in (("rule.py", 'WANT = "5"\n'), ("rubric.txt", "8\n"), ("score.py", SCRIPT + "\n# edited\n")):
        (tmp_path / path).write_text(text)
        versions.append(CommandSource(None, argv=argv).version)
    assert len(set(versions)) == 4, versions
    assert files_hash(["--flag", "not-a-file"]) == files_hash([])  # words alone: the command line's hash says them


def test_after_a_rubric_edit_rescore_grades_again(tmp_path):
    """The defect: the command's script edited, the same command line; rescore found nothing to do."""
    (tmp_path / "score.py").write_text(SCRIPT)
    (tmp_path / "rule.py").write_text('WANT = "4"\n')
    (tmp_path / "rubric.txt").write_text("7\n")
    store = TrajectoryStore(LocalBlobStore(tmp_path / "store"))
    rows = []
    for i, out in enumerate(["4", "5", "7"]):
        calls = make_trajectory(f"t{i}", 1, minutes=i)
        calls[0]["output_text"] = out
        rows += calls
    store.write_calls(rows)
    command = f"{sys.executable} {tmp_path / 'score.py'} --rubric={tmp_path / 'rubric.txt'}"
    old = RewardPlan(RewardSettings(sources=("command",), command=command))
    score_missing(store, old, store.read_calls())
    (tmp_path / "rule.py").write_text('WANT = "5"\n')
    new = RewardPlan(RewardSettings(sources=("command",), command=command))
    assert new.current_version("command") != old.current_version("command")
    rep = rescore(store, new, "command")
    assert (rep.trajectories, rep.scored, rep.changed) == (3, 3, 2)  # "4" 1 -> 0, "5" 0 -> 1, "7" stays 1
