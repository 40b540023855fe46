"""The plug points fail early and clearly: evaluation suites, model sources, settings files, the CLI."""

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest
from safetensors.torch import load_file, save_file

from prodrl_pipelines.engines.types import CallRecord
from prodrl_pipelines.evaluation import SuiteError, load_suite, play_episodes, stop_token_ids
from prodrl_pipelines.loop.model_source import ModelSourceError, import_base_model, validate_model_dir
from prodrl_pipelines.config.settings import Settings, SettingsFileError, load_settings_file

from own_model import build_model, write_user_package


@pytest.fixture(scope="module")
def their_model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("their") / "qwen3")


@pytest.fixture
def user_pkg(tmp_path, monkeypatch):
    fields = write_user_package(tmp_path / "user", n_tasks=5, explode=(1,))
    monkeypatch.syspath_prepend(str(tmp_path / "user"))
    sys.modules.pop("mygrader", None)
    yield fields
    sys.modules.pop("mygrader", None)


# ------------------------------------------------------------------------------- suites


def test_a_jsonl_suite_loads_in_order_and_checks_settings(user_pkg):
    suite = load_suite(user_pkg["eval_suite"], user_pkg["eval_reward_fn"], Settings())
    assert [t.task_id for t in suite.heldout_tasks(3)] == ["q0", "q1", "q2"]
    assert len(suite.heldout_tasks(100)) == 5  # heldout_size is an upper bound
    assert suite.initial_messages(suite.heldout_tasks(1)[0]) == [{"role": "user", "content": "0+0="}]
    assert suite.env_reply(suite.heldout_tasks(1)[0], 0, "0") is None  # single turn
    tool = load_suite("mygrader:ToolSuite", "", Settings())
    assert tool.tools[0]["function"]["name"] == "add"
    with pytest.raises(SuiteError, match=r"needs deploy.max_tokens >= 2"):
        load_suite("mygrader:ToolSuite", "", Settings(deploy={"max_tokens": 1}))


@pytest.mark.parametrize("lines, match", [
    (['{"messages": [{"role": "user", "content": "x"}]}', '[1, 2]'], r"heldout.jsonl:2: each line must be a JSON object"),
    (['{"messages": [{"role": "user", "content": "x"}]}', "", '{"messages": []}'], r"heldout.jsonl:3: 'messages'"),
    (['{"task_id": "a", "messages": [{"role": "user"}]}', '{"task_id": "a", "messages": [{"role": "user"}]}'],
     r"heldout.jsonl:2: duplicate task_id 'a' \(first on line 1\)"),
    (['{"messages": [{"role": "user", "content": "x"}]', ], r"heldout.jsonl:1: not JSON"),
    (["", "   "], r"heldout.jsonl: the held-out set is empty"),
])
def test_bad_jsonl_fails_at_load_naming_file_and_line(tmp_path, user_pkg, lines, match):
    p = tmp_path / "heldout.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(SuiteError, match=match):
        load_suite(str(p), "mygrader:reward")


def test_bad_suite_names_fail_naming_the_setting(tmp_path, user_pkg):
    with pytest.raises(SuiteError, match=r"eval.reward_fn='mygrader:nope'.*no attribute 'nope'"):
        load_suite(user_pkg["eval_suite"], "mygrader:nope")
    with pytest.raises(SuiteError, match=r"eval.reward_fn='no_such_pkg.x:f': cannot import module"):
        load_suite(user_pkg["eval_suite"], "no_such_pkg.x:f")
    with pytest.raises(SuiteError, match=r"set eval.reward_fn"):
        load_suite(user_pkg["eval_suite"], "")
    with pytest.raises(SuiteError, match=r"no such file"):
        load_suite(str(tmp_path / "missing.jsonl"), "mygrader:reward")
    with pytest.raises(SuiteError, match=r"Task\(\) failed .*constructible without arguments"):
        load_suite("mygrader:Task", "")
    with pytest.raises(SuiteError, match=r"lacks heldout_tasks, initial_messages, env_reply, reward, name"):
        load_suite("mygrader:reward", "")  # a function, not a suite
    with pytest.raises(SuiteError, match=r"not a registered suite source \(command, inspect, lab, verifiers\)"):
        load_suite("nothing-like-a-suite", "")


def test_the_lab_is_a_suite_source_like_any_other():
    assert load_suite("lab", "", Settings()).name == "arithmetic"
    assert load_suite("lab:chess", "", Settings(deploy={"max_tokens": 64})).name == "chess"
    with pytest.raises(SuiteError, match=r"'chess' needs deploy.max_tokens >= 48"):
        load_suite("lab:chess", "", Settings())


@dataclass(frozen=True)
class _T:
    task_id: str


class _TwoTurns:
    name, tools, min_max_tokens = "two", None, 1

    def heldout_tasks(self, n):
        return [_T(f"t{i}") for i in range(n)]

    def initial_messages(self, task):
        return [{"role": "user", "content": "go"}]

    def env_reply(self, task, turn, content):
        return {"role": "tool", "content": "42"} if turn == 0 else None

    def reward(self, task, texts):
        if task.task_id == "t1":
            raise KeyError("missing rubric")
        return float(len(texts))


class _Scripted:
    """An engine that answers token 7 then the stop token; records prompts."""

    def __init__(self, stop):
        self.stop, self.prompts = stop, []

    def generate(self, prompts, params, seed=None):
        self.prompts.append(prompts)
        assert self.stop in params.stop_token_ids
        return [CallRecord(list(p), [7, self.stop], [-0.1, -0.2], [[7], [self.stop]], [[-0.1], [-0.2]], False,
                           finish_reason="stop") for p in prompts]


def test_episodes_follow_the_environment_and_count_reward_errors(their_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(their_model)
    stops = stop_token_ids(tok, their_model)
    assert stops == (tok.convert_tokens_to_ids("<|end|>"),)  # from the model, not a literal
    eng = _Scripted(stops[0])
    from prodrl_pipelines.engines.types import SamplingParams

    eps = play_episodes(eng, tok, _TwoTurns(), _TwoTurns().heldout_tasks(3), SamplingParams(max_tokens=2), "v", seed=1)
    assert [len(e.calls) for e in eps] == [2, 2, 2] and len(eng.prompts) == 2
    assert "<|tool|>42<|end|>" in tok.decode(eng.prompts[1][0])  # the environment's reply is context
    assert [e.reward for e in eps] == [2.0, 0.0, 2.0]
    assert eps[1].reward_error == "KeyError: 'missing rubric'"
    assert eps[0].calls[0].content == tok.decode([7])  # stop token removed


# ------------------------------------------------------------------------------- model sources


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_base_model_is_imported_validated_and_copied(their_model, tmp_path):
    facts = import_base_model(str(their_model), tmp_path / "ckpt" / "round-000000")
    assert facts["source"] == "directory" and facts["architectures"] == ["Qwen3ForCausalLM"]
    moe = import_base_model(str(build_model(tmp_path / "their_moe", moe=True)), tmp_path / "moe" / "round-000000")
    assert moe["architectures"] == ["Qwen3MoeForCausalLM"] and moe["smoke_text"]
    assert facts["smoke_text"] is not None and facts["tokenizer_size"] <= facts["vocab_size"]
    assert (tmp_path / "ckpt" / "round-000000" / "model.safetensors").exists()
    assert not list((tmp_path / "ckpt").glob(".*"))  # no staging left behind


def test_bad_base_models_fail_before_any_work(their_model, tmp_path):
    dest = tmp_path / "ckpt" / "round-000000"
    with pytest.raises(ModelSourceError, match=r"no such directory"):
        import_base_model(str(tmp_path / "nope"), dest)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelSourceError, match=r"has no config.json"):
        import_base_model(str(empty), dest)

    no_template = _copy(their_model, tmp_path / "no_template")
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((no_template / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelSourceError, match=r"no chat template"):
        import_base_model(str(no_template), dest)

    small = _copy(their_model, tmp_path / "small_vocab")
    cfg = json.loads((small / "config.json").read_text())
    cfg["vocab_size"] = 256
    (small / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelSourceError, match=r"tokenizer has 317 tokens but the model's embeddings hold 256"):
        import_base_model(str(small), dest)

    nan = _copy(their_model, tmp_path / "nan")
    w = load_file(str(nan / "model.safetensors"))
    w["model.layers.1.mlp.down_proj.weight"][0, 3] = float("nan")
    save_file(w, str(nan / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelSourceError, match=r"'model.layers.1.mlp.down_proj.weight' in model.safetensors has 1 non-finite"):
        import_base_model(str(nan), dest)
    assert not dest.exists() and not list((tmp_path / "ckpt").glob(".*"))  # nothing became round 0


def test_a_base_model_on_s3(their_model, tmp_path, s3_endpoint, bucket):
    import boto3

    c = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    for f in their_model.iterdir():
        c.upload_file(str(f), bucket, f"models/theirs/{f.name}")
    facts = import_base_model(f"s3://{bucket}/models/theirs", tmp_path / "r0", s3_endpoint_url=s3_endpoint,
                              generate=False)
    assert facts["source"] == "s3" and validate_model_dir(tmp_path / "r0", "x", generate=False)["vocab_size"] == 320
    with pytest.raises(ModelSourceError, match=r"no objects under that prefix"):
        import_base_model(f"s3://{bucket}/models/none", tmp_path / "r1", s3_endpoint_url=s3_endpoint)


# ------------------------------------------------------------------------------- settings files and CLI


def test_a_relative_home_resolves_against_the_settings_file(tmp_path, monkeypatch):
    (tmp_path / "cfg").mkdir()
    f = tmp_path / "cfg" / "s.yaml"
    f.write_text("home: ../runs/a\nbatch_size: 4\n")
    monkeypatch.chdir("/")
    assert load_settings_file(f) == {"home": str(tmp_path / "runs" / "a"), "batch_size": 4}
    g = tmp_path / "cfg" / "s.json"
    g.write_text('{"batch_size": 4}')
    monkeypatch.setenv("PRODRL_HOME", "/srv/prodrl")
    assert load_settings_file(g)["home"] == "/srv/prodrl"  # the file says nothing: the environment decides
    g.write_text("[1]")
    with pytest.raises(SettingsFileError, match="must hold an object"):
        load_settings_file(g)


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "prodrl_pipelines.cli", *args], capture_output=True, text=True,
                          timeout=300, **kw)


def test_check_settings_prints_the_resolved_settings_or_names_the_field(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"home": "h", "batch_size": 4, "logprob_chunk": 512, "eval_seed": 7}))
    out = _cli("check-settings", str(good))
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)
    assert resolved["home"] == str(tmp_path / "h") and resolved["recipe"]["batch_size"] == 4
    assert resolved["recipe"]["logprob_chunk"] == 512 and resolved["eval"]["eval_seed"] == 7
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"batch_size": 0}))
    out = _cli("check-settings", str(bad))
    assert out.returncode == 1 and "batch_size" in out.stderr and "Traceback" not in out.stderr
    bad.write_text(json.dumps({"no_such_field": 1}))
    out = _cli("check-settings", str(bad))
    assert out.returncode == 1 and "no_such_field" in out.stderr


def test_make_up_runs_the_demo_recipe():
    from prodrl_pipelines.lab.demo import DEMO_SETTINGS

    from conftest import REPO

    assert json.loads((REPO / "examples" / "lab-demo.json").read_text()) == DEMO_SETTINGS
    makefile = (REPO / "Makefile").read_text()
    assert "STACK_SETTINGS ?= examples/lab-demo.json" in makefile and "--settings $(STACK_SETTINGS)" in makefile


def test_python_chess_is_only_needed_for_the_chess_task():
    code = ("import sys; sys.modules['chess'] = None\n"
            "from prodrl_pipelines.lab.tasks import TASKS, get_task\n"
            "assert get_task('arithmetic').name == 'arithmetic' and set(TASKS) == {'arithmetic', 'chess', 'arithmetic_tools'}\n"
            "try:\n    get_task('chess')\nexcept ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "needs python-chess" in out.stdout and "prodrl_pipelines[lab]" in out.stdout


def test_prodrl_bootstrap_then_eval_from_the_command_line(their_model, user_pkg, tmp_path):
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"home": "home", "base_model": str(their_model), **user_pkg, "heldout_size": 5,
                             "max_tokens": 4}))
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path / "user")}
    env.pop("MLFLOW_TRACKING_URI", None)
    out = _cli("bootstrap", "--settings", str(f), env=env)
    assert out.returncode == 0, out.stderr
    boot = json.loads(out.stdout)
    assert boot["source"] == "directory" and boot["reward_errors"] == 1 and boot["model_version"] == "1"
    assert (tmp_path / "home" / "exports" / "round-000000" / "config.json").exists()
    again = _cli("bootstrap", "--settings", str(f), env=env)
    assert again.returncode == 1 and "already live" in again.stderr
    ev = _cli("eval", "--settings", str(f), env=env)
    assert ev.returncode == 0, ev.stderr
    got = json.loads(ev.stdout)
    assert (got["policy_version"], got["num_tasks"], got["reward_errors"]) == ("round-000000", 5, 1)
    assert got["mean"] == boot["heldout_reward"]  # the same seeded evaluation
    missing = _cli("eval", "--settings", str(f), "--policy", "round-000009", env=env)
    assert missing.returncode == 2 and "no export of 'round-000009'" in missing.stderr
    assert "Traceback" not in missing.stderr


@pytest.mark.long(seconds=65)
def test_the_readme_example_works_as_written(tmp_path):
    """README "Use it with your own model": the same commands, on a copy of examples/own_model."""
    from conftest import REPO

    shutil.copytree(REPO / "examples" / "own_model", tmp_path / "examples" / "own_model",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**__import__("os").environ, "PYTHONPATH": "examples/own_model"}
    env.pop("MLFLOW_TRACKING_URI", None)
    settings = "examples/own_model/settings.yaml"

    def run(*cmd):
        out = subprocess.run(list(cmd), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (cmd, out.stderr[-2000:])
        return out.stdout

    run(sys.executable, "examples/own_model/build_model.py", "runs/their-qwen3")
    resolved = json.loads(run(sys.executable, "-m", "prodrl_pipelines.cli", "check-settings", settings))
    assert resolved["base_model"] == str(tmp_path / "runs" / "their-qwen3")
    assert resolved["eval"]["suite"] == str(tmp_path / "examples" / "own_model" / "heldout.jsonl")
    boot = json.loads(run(sys.executable, "-m", "prodrl_pipelines.cli", "bootstrap", "--settings", settings))
    assert boot["source"] == "directory" and boot["reward_errors"] == 0
    ev = json.loads(run(sys.executable, "-m", "prodrl_pipelines.cli", "eval", "--settings", settings))
    assert ev["num_tasks"] == 16 and ev["policy_version"] == "round-000000"
    assert (tmp_path / "runs" / "own-model" / "exports" / "round-000000" / "config.json").exists()
    # docs/evals.md: the same held-out tasks as an inspect task, playing the live export through prodrl
    # serve's app (the verifiers taskset beside it is the same command with --suite verifiers:my-taskset;
    # tests/test_served_suites.py plays verifiers suites)
    suite = "inspect:myevals:heldout"
    got = json.loads(run(sys.executable, "-m", "prodrl_pipelines.cli", "eval", "--settings", settings, "--suite", suite))
    assert (got["suite"], got["task_ids"], got["reward_errors"]) == (suite, [f"q{i}" for i in range(16)], 0)
    assert set(got["rewards"]) <= {0.0, 1.0} and got["mean"] == sum(got["rewards"]) / 16
