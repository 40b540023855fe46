"""The verifiers side of the ``verifiers`` suite and reward source, run by the verifiers
environment's Python (verifiers pins ``openai<3``; this project's tests use openai 3), so it imports
nothing of prodrl_pipelines: only the standard library, ``verifiers.v1`` and ``openai``.

    python verifiers_bridge.py suite TASKSET   # the first PRODRL_NUM_TASKS tasks against PRODRL_BASE_URL
    python verifiers_bridge.py score TASKSET   # trajectories (JSON lines on stdin) scored, one reward each
    python verifiers_bridge.py version [TASKSET]  # the verifiers version (+ the taskset's code hash)

``TASKSET`` is a verifiers taskset id (its module must be importable, as ``vf-eval`` needs it).
Both modes score through the taskset's own ``Task.score`` on a ``vf.Trace`` of the conversation:
``suite`` plays each task's prompt as one chat call (the deployment's sampling settings from the
environment, ``command_suite.endpoint_env``); ``score`` builds the trace from the task's prompt and
the trajectory's recorded assistant texts, matched to the task by ``task_id``. Output: JSON lines
on stdout (``harnesses.command`` reads them); diagnostics on stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor


def _vf():
    import verifiers.v1 as vf

    return vf


def load_tasks(taskset_id: str) -> list:
    vf = _vf()
    return list(vf.load_taskset(vf.TasksetConfig(id=taskset_id)))


def task_id(task) -> str:
    d = task.data
    return str(d.id) if d.id is not None else f"idx-{d.idx}"


def prompt_messages(task) -> list[dict]:
    d = task.data
    msgs = [{"role": "system", "content": d.system_prompt}] if d.system_prompt else []
    if isinstance(d.prompt, str):
        return msgs + [{"role": "user", "content": d.prompt}]
    return msgs + [m.model_dump(mode="json", exclude_none=True) for m in d.prompt or []]


def trace_of(task, messages: list[dict]):
    """A ``vf.Trace`` of ``messages`` for ``task``: a linear message graph, the assistant turns
    marked sampled (a trace's reply is read from sampled messages only)."""
    vf = _vf()
    from verifiers.v1.dialects.chat import parse_message

    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig(), trainable=False))
    for i, raw in enumerate(messages):
        msg = parse_message(raw)
        trace.nodes.append(vf.MessageNode(parent=i - 1 if i else None, message=msg, sampled=msg.role == "assistant"))
    trace.ok = True
    return trace


async def _score(task, messages: list[dict]) -> float:
    trace = trace_of(task, messages)
    await task.score(trace)
    return float(trace.reward)


def _env(name: str, cast=str, default=None):
    v = os.environ.get(name)
    if v is None:
        if default is None:
            raise SystemExit(f"verifiers bridge: {name} is not set")
        return default
    return cast(v)


def play(taskset_id: str) -> int:
    from openai import OpenAI

    tasks = load_tasks(taskset_id)[:_env("PRODRL_NUM_TASKS", int)]
    client = OpenAI(base_url=_env("PRODRL_BASE_URL"), api_key=_env("PRODRL_API_KEY", str, "EMPTY"), max_retries=2)
    model, seed = _env("PRODRL_MODEL"), _env("PRODRL_SEED", int)
    sampling = {"temperature": _env("PRODRL_TEMPERATURE", float), "top_p": _env("PRODRL_TOP_P", float),
                "max_tokens": _env("PRODRL_MAX_TOKENS", int)}
    top_k = _env("PRODRL_TOP_K", int, 0)

    def call(i_task):
        i, task = i_task
        # one seed per task: a rerun plays the same episodes, whatever else the server answers
        resp = client.chat.completions.create(model=model, messages=prompt_messages(task), seed=seed + i,
                                              extra_body={"top_k": top_k} if top_k else None, **sampling)
        return resp.choices[0].message.content or "", resp.usage.completion_tokens if resp.usage else None

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(call, enumerate(tasks)))
    for task, (text, gen) in zip(tasks, replies):
        line = {"task_id": task_id(task), "outputs": [text], "gen_tokens": gen}
        try:
            line["reward"] = asyncio.run(_score(task, prompt_messages(task) + [{"role": "assistant", "content": text}]))
        except Exception as e:  # noqa: BLE001 - the task's scorer failed: that task is scored 0, with why
            line.update(reward=0.0, error=f"{type(e).__name__}: {e}")
        print(json.dumps(line), flush=True)
    return 0


def score(taskset_id: str) -> int:
    by_id = {task_id(t): t for t in load_tasks(taskset_id)}
    for n, raw in enumerate(sys.stdin, start=1):
        if not raw.strip():
            continue
        traj = json.loads(raw)
        task = by_id.get(traj.get("task_id") or "")
        line = {"trajectory_id": traj["trajectory_id"]}
        if task is None:
            line["error"] = f"task_id {traj.get('task_id')!r} is not a task of taskset {taskset_id!r}"
        else:
            msgs = prompt_messages(task) + [{"role": "assistant", "content": o} for o in traj.get("outputs") or []]
            try:
                line["reward"] = asyncio.run(_score(task, msgs))
            except Exception as e:  # noqa: BLE001 - reported for this trajectory, which stays unscored
                line["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(line), flush=True)
    return 0


def taskset_code_hash(taskset_id: str) -> str:
    """A hash of the files of the package the taskset was loaded from (its rubric, prompts and data):
    an edit there is a new scorer version. Empty when its module cannot be told."""
    import hashlib
    import importlib
    from pathlib import Path

    vf = _vf()
    taskset = vf.load_taskset(vf.TasksetConfig(id=taskset_id))
    names = [type(taskset).__module__, *(type(t).__module__ for t in list(taskset)[:1]),
             taskset_id.replace("-", "_")]
    files = []
    for name in dict.fromkeys(n.split(".")[0] for n in names):
        if name in ("verifiers", "builtins"):
            continue
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        file = getattr(mod, "__file__", None)
        if file:
            p = Path(file)
            files += sorted(f for f in p.parent.rglob("*") if f.is_file() and "__pycache__" not in f.parts) \
                if p.name == "__init__.py" else [p]
    h = hashlib.sha256()
    for f in files:
        h.update(f"\0{f.name}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12] if files else ""


def main(argv: list[str]) -> int:
    if argv[:1] == ["version"]:
        import verifiers

        code = taskset_code_hash(argv[1]) if len(argv) > 1 else ""
        print(verifiers.__version__ + (f"+{code}" if code else ""))
        return 0
    if len(argv) != 2 or argv[0] not in ("suite", "score"):
        print(__doc__, file=sys.stderr)
        return 2
    return play(argv[1]) if argv[0] == "suite" else score(argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
