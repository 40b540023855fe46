"""``vllm-reload``: new weights into a running vLLM in dev mode, in place.

``POST /pause?mode=wait`` (requests in flight finish on the old weights, new ones wait) ->
``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": export}}`` ->
``POST /reset_prefix_cache`` (cached KV of the old weights) -> endpoint file rewritten with the new
policy version -> ``POST /resume``: a clean cut, and no request fails (DESIGN.md s.10, ~0.15 s on CPU).
The served model name does not change, so the recorder tags calls from the endpoint file.

On vLLM's CPU backend (0.32) an in-place reload is unreliable: its GEMMs run on weights prepacked at
start-up, which ``reload_weights`` does not refresh (measured on the lab's dense model: after
reloading other weights the server matched neither, 0.17 nats mean off the new ones; the parity
probe catches it and rolls back). MoE models are worse (8.5 nats after reloading identical weights).

The server is ``target_endpoint`` when set (a vLLM started by the operator with
``VLLM_SERVER_DEV_MODE=1``), else one this target manages: the first deploy starts it (as
``vllm-restart`` does, in dev mode) and every later one reloads it. The same architecture and export
scheme are required. On a CPU host a managed server therefore always restarts (the switch's
``detail["mode"]`` says so); an external server is reloaded as asked (the probe judges it), except a
MoE export, which is refused with that reason.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from prodrl_pipelines.deploy_targets.base import DeployError, Endpoint, Switch, is_moe, served_models
from prodrl_pipelines.deploy_targets.endpoint_store import endpoint_file
from prodrl_pipelines.deploy_targets.servers import VLLMRestartTarget, cuda_available



class VLLMReloadTarget:
    name = "vllm-reload"

    def __init__(self, settings, home: str | os.PathLike) -> None:
        self.settings = settings
        self.deploy = settings.deploy
        self.home = Path(home)
        self.external = settings.deploy.target_endpoint.rstrip("/") or None
        self.restart = VLLMRestartTarget(settings, home, state_name=self.name, dev_mode=True)
        self.endpoints = endpoint_file(home, settings.deploy)
        from prodrl_pipelines.config import environment

        self.api_key = environment.deploy_api_key()

    def _post(self, url: str, path: str, body: dict | None = None, timeout: float = 600.0) -> dict:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url + path, data=data or b"", headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            hint = " (is the server in dev mode, VLLM_SERVER_DEV_MODE=1?)" if e.code == 404 else ""
            raise DeployError(f"POST {url}{path} -> HTTP {e.code}: {e.read()[:300]!r}{hint}") from None
        except OSError as e:
            raise DeployError(f"POST {url}{path} failed: {e}") from None
        return json.loads(raw) if raw.strip() else {}

    def _reload(self, url: str, served_name: str, export_dir: Path, policy_version: str) -> float:
        t0 = time.monotonic()
        self._post(url, "/pause?mode=wait")
        try:
            self._post(url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(export_dir)}})
            self._post(url, "/reset_prefix_cache")
            self.endpoints.write(Endpoint(url, served_name, policy_version, self.name, str(export_dir)))
        finally:
            self._post(url, "/resume")
        return time.monotonic() - t0

    def _serving(self) -> tuple[str, str] | None:
        """(url, served model name) of the server to reload, or None when none runs yet."""
        if self.external:
            ep = self.endpoints.read()
            if ep is not None and ep.url.rstrip("/") == self.external:
                return self.external, ep.served_model_name
            names = served_models(self.external, self.api_key)
            if not names:
                raise DeployError(f"{self.external} serves no model")
            return self.external, names[0]
        cur = self.restart.current()
        if cur is None:
            return None
        ep = self.endpoints.read()
        return cur.url, (ep.served_model_name if ep is not None and ep.url == cur.url else cur.policy_version)

    def switch(self, export_dir: Path, policy_version: str) -> Switch:
        if self.external and is_moe(export_dir) and not cuda_available():
            raise DeployError(f"vllm-reload refuses the MoE export {export_dir} on CPU: vLLM's in-place "
                              "reload corrupts MoE expert weights there; use deploy target 'vllm-restart'")
        serving = self._serving()
        if serving is None or (not self.external and not cuda_available()):
            sw = self.restart.switch(export_dir, policy_version)
            sw.detail["mode"] = "restart" if serving is None else "restart (CPU: no reliable in-place reload)"
            return sw
        url, served = serving
        previous = self.endpoints.read()
        seconds = self._reload(url, served, Path(export_dir), policy_version)  # health: checked by the rollout
        prev = {"policy_version": previous.policy_version, "export_dir": previous.export_dir} if previous else None
        return Switch(self.name, policy_version, str(export_dir), url, served, seconds=seconds, previous=prev,
                      detail={"mode": "reload", "reload_seconds": seconds})

    def commit(self, switch: Switch) -> None:
        if switch.detail.get("mode", "").startswith("restart"):
            self.restart.commit(switch)

    def rollback(self, switch: Switch) -> str:
        if switch.detail.get("mode", "").startswith("restart"):
            return self.restart.rollback(switch)
        prev = switch.previous
        if not prev or not prev["export_dir"] or not (Path(prev["export_dir"]) / "config.json").exists():
            return "no previous export to reload: the new weights stay loaded"
        self._reload(switch.endpoint, switch.served_model_name, Path(prev["export_dir"]), prev["policy_version"])
        return f"reloaded {prev['policy_version']} in place"

    def stop(self) -> None:
        if not self.external:
            self.restart.stop()
