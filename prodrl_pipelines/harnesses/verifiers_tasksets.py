"""verifiers tasksets as a held-out suite (``eval_suite: "verifiers:<taskset>"``) and as a reward
source (``rewards_sources: [verifiers]`` with ``rewards_verifiers_taskset``).

verifiers pins ``openai<3``, so it runs in its own environment (``make verifiers`` builds it, cached
outside the clone like vLLM's; ``PRODRL_VERIFIERS_PYTHON`` names its Python). Both are the generic
command suite and command reward source with ``verifiers_bridge`` as the command: the taskset is
loaded by id in that environment and every task is scored by its own ``Task.score`` on a
``vf.Trace`` (the bridge's doc says how the trace is built). The taskset's module must be importable
there (installed into that environment, or on ``PYTHONPATH``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from prodrl_pipelines.config import environment
from prodrl_pipelines.evaluation.suite import SuiteError
from prodrl_pipelines.harnesses.command import CommandSource, CommandSuite

BRIDGE = Path(__file__).with_name("verifiers_bridge.py")


def verifiers_python() -> str:
    py = environment.verifiers_python()
    if not Path(py).is_file():
        raise SuiteError(f"no verifiers environment at {py}: run `make verifiers` (or set PRODRL_VERIFIERS_PYTHON "
                         "to a Python with verifiers 0.4 installed)")
    return py


def verifiers_version(py: str, taskset: str = "") -> str:
    """The verifiers version, + a hash of ``taskset``'s package when one is named (its rubric's code).
    Asked each time a source is built, not cached: the package may have been edited since."""
    out = subprocess.run([py, str(BRIDGE), "version", *([taskset] if taskset else [])], capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        raise SuiteError(f"{py}: verifiers does not import: {out.stderr.strip().splitlines()[-1:]}")
    return out.stdout.strip()


def bridge_argv(mode: str, taskset: str) -> list[str]:
    return [verifiers_python(), str(BRIDGE), mode, taskset]


def verifiers_suite(arg: str, settings=None) -> CommandSuite:
    """The ``verifiers`` suite source: ``verifiers:<taskset id>``."""
    if not arg.strip():
        raise SuiteError("eval_suite='verifiers:': name the taskset id after 'verifiers:'")
    return CommandSuite(bridge_argv("suite", arg.strip()), f"verifiers:{arg.strip()}")


def verifiers_reward_source(settings):
    """The ``verifiers`` reward source: the taskset's rubric on each recorded trajectory."""
    taskset = settings.verifiers_taskset.strip()
    argv = bridge_argv("score", taskset)
    src = CommandSource(settings, argv=argv, version=f"verifiers:{taskset}@{verifiers_version(argv[0], taskset)}")
    src.name = "verifiers"
    return src


verifiers_reward_source.scores = True  # it scores stored traffic itself (rewards.sources)
