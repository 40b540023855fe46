"""A real vLLM (CPU build, its own venv from ``make vllm``) for the tests: one server per session.

``PRODRL_SKIP_VLLM=1`` skips the tests that need it, with the reason printed; under ``CI=true`` a
missing or failing vLLM fails them instead (``make test`` builds the venv before pytest).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from prodrl_pipelines.config import environment
from prodrl_pipelines.deploy_targets.base import DeployError, wait_healthy
from prodrl_pipelines.deploy_targets.server_records import stop_process_group
from prodrl_pipelines.engines.vllm_client import vllm_serve_command, vllm_serve_env
from prodrl_pipelines.deploy_targets.processes import pick_port, tail

# small, so start-up and the KV cache stay cheap on 2 cores; eager: no torch.compile warm-up (start-up
# 22 s instead of 42 s measured here)
PROMPTS = [[1, 5, 6, 7, 8], [1, 40, 41, 42, 9, 9], [1, 12, 13], [1, 20, 21, 22, 23, 24, 25]]

# the weight-transfer endpoints answer only with a backend configured (on CPU: a refused init)
WEIGHT_TRANSFER_ARGS = ("--weight-transfer-config", '{"backend": "nccl"}')
SERVER_ARGS = ("--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--enforce-eager")


def vllm_python() -> str:
    """The vLLM venv's interpreter, or skip (fail under CI) with the reason."""
    if os.environ.get("PRODRL_SKIP_VLLM") == "1":
        pytest.skip("PRODRL_SKIP_VLLM=1: the tests against a real vLLM are skipped")
    py = environment.vllm_python()
    if py is None or not Path(py).exists():
        msg = (f"no vLLM environment (PRODRL_VLLM_PYTHON={py or ''}, nor {environment.DEFAULT_VLLM_VENV}): "
               "`make vllm` builds it (or set PRODRL_SKIP_VLLM=1)")
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return py


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` on loopback, in its own session."""

    def __init__(self, python: str, export_dir: Path, name: str, log: Path, dev_mode: bool = True,
                 extra_args: tuple[str, ...] = (), env: dict | None = None) -> None:
        self.port = pick_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name, self.log, self.export_dir = name, log, export_dir
        env = {**vllm_serve_env("127.0.0.1"), **(env or {})}
        if dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        cmd = vllm_serve_command(export_dir, self.port, 20, served_model_name=name, python=python,
                                 extra_args=SERVER_ARGS + tuple(extra_args))
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        self.t0 = time.monotonic()
        self.startup_s: float | None = None

    def wait(self, timeout_s: float = 240.0) -> VLLMServer:
        if self.startup_s is None:
            try:
                wait_healthy(self.url, timeout_s, expect_model=self.name, alive=lambda: self.proc.poll() is None,
                             log_tail=lambda: tail(self.log, 40))
            except DeployError as e:
                msg = f"vLLM did not start: {e}"
                if os.environ.get("CI") == "true":
                    pytest.fail(msg)
                pytest.skip(msg)
            self.startup_s = time.monotonic() - self.t0
        return self

    def stop(self) -> None:
        stop_process_group(self.proc.pid)


def logprob_mismatch(records, export_dir, params) -> dict:
    """|log mu_vllm - log mu_local| over the records' sampled tokens: mean, max, tokens."""
    import numpy as np

    from prodrl_pipelines.engines.local import LocalEngine

    local = LocalEngine.from_pretrained(export_dir)
    ref = local.score([r.prompt_token_ids for r in records], [r.output_token_ids for r in records], params)
    d = np.abs(np.concatenate([np.asarray(r.output_logprobs) - np.asarray(x) for r, x in zip(records, ref)]))
    return {"mean": float(d.mean()), "max": float(d.max()), "tokens": int(d.size)}
