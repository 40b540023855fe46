"""``vllm-weight-transfer``: new weights into a running vLLM over NCCL, no restart (GPU only).

``target_endpoint`` is a vLLM in dev mode (``VLLM_SERVER_DEV_MODE=1`` mounts the RL endpoints)
started with ``--weight-transfer-config '{"backend": "nccl"}'``. This process is NCCL rank 0 of the
transfer group (the trainer's side, on a GPU other than the server's: NCCL refuses two ranks on one
device) and sends the export's tensors as stored; vLLM loads them through its layerwise reload.
``WeightTransferClient.update``, each step an HTTP call, in order:

0. once per server and process, before the pause (a refused init leaves the server untouched):
   ``/shutdown_weight_transfer_engine`` (an earlier process's group), ``/init_weight_transfer_engine``;
1. ``/pause?mode=keep`` (requests in flight are frozen and continue on the new weights);
2. ``/start_weight_update``, ``/update_weights`` while rank 0 broadcasts, ``/finish_weight_update``;
3. ``/update_weight_version`` (``GET /weight_info`` reports it), the endpoint file; 4. ``/resume``.

A failure in 2-3 restores the previous export by the same transfer, or by vLLM's disk reload of its
directory (``/collective_rpc reload_weights``) when that fails too, sets its version back and resumes.
The disk reload matters: after ``/start_weight_update`` the weights sit on the meta device until a
transfer finishes; a request then kills the engine (measured on CPU). vLLM 0.32 has no disk backend
(nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n, modelexpress): quantized exports go as stored tensors.

Refused (``local_refusal``, ``server_refusal``: before any request that changes the server) unless
this process sees a CUDA GPU and imports vLLM, and the server reports a CUDA device and the nccl
backend: vLLM 0.32's CPU build cannot create the group, nor refresh its prepacked GEMM weights in place.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

from prodrl_pipelines.deploy_targets.base import DeployError, Endpoint, Switch, served_models
from prodrl_pipelines.deploy_targets.endpoint_store import endpoint_file
from prodrl_pipelines.deploy_targets.nccl_link import NcclTrainerLink
from prodrl_pipelines.deploy_targets.processes import pick_port
from prodrl_pipelines.deploy_targets.servers import cuda_available

CONTROL_S = 60.0  # pause, resume, version: answered at once by a healthy server
WHY_GPU_ONLY = ("weight transfer is GPU-only: on CPU, vLLM 0.32 cannot create the NCCL transfer group "
                "(/init_weight_transfer_engine answers 'Cannot access accelerator device') and in-place updates do "
                "not refresh its prepacked CPU GEMM weights; use deploy target 'vllm-restart' there")
class Weights(NamedTuple):
    export_dir: Path
    version: str


def together(request, side, timeout_s: float, grace_s: float = 5.0) -> None:
    """``request()`` (an HTTP call the server answers once the collective is done) and ``side()`` (this
    process's half of it) at once. When one fails the other gets ``grace_s`` (a peer left waiting in
    NCCL never returns); every error is raised, the server's first."""
    done: queue.Queue = queue.Queue()

    def run(who, fn):
        try:
            fn()
            done.put((who, None))
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            done.put((who, e))

    for who, fn in (("server", request), ("this process", side)):
        threading.Thread(target=run, args=(who, fn), daemon=True).start()
    errors: dict[str, object] = {}
    deadline = time.monotonic() + timeout_s
    for _ in range(2):
        wait = grace_s if errors else deadline - time.monotonic()
        try:
            who, err = done.get(timeout=max(wait, 0.01))
        except queue.Empty:
            errors["timeout"] = f"the other side did not finish within {grace_s if errors else timeout_s:.0f}s"
            break
        if err is not None:
            errors[who] = err
    if errors:
        raise DeployError("; ".join(f"{who}: {err}" for who, err in sorted(errors.items(), key=lambda kv: kv[0] != "server")))


class WeightTransferClient:
    """The HTTP choreography of one server's weight updates. ``calls``: (path, HTTP status) in order,
    0 when nothing answered."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        self.url, self.api_key, self.timeout_s = url.rstrip("/"), api_key, timeout_s
        self.calls: list[tuple[str, int]] = []
        self.initialized = False  # the transfer group exists (init_weight_transfer_engine answered)

    def request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        data = None if method == "GET" else json.dumps(body).encode() if body is not None else b""
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout_s) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        except OSError as e:
            self.calls.append((path, 0))
            raise DeployError(f"{method} {self.url}{path} failed: {e}") from None
        self.calls.append((path, status))
        if status != 200:
            try:
                msg = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = raw[:300].decode(errors="replace")
            hint = " (is the server in dev mode, VLLM_SERVER_DEV_MODE=1?)" if status == 404 else ""
            raise DeployError(f"{method} {self.url}{path} -> HTTP {status}: {msg[:300]}{hint}")
        return json.loads(raw) if raw.strip() else {}

    def ensure_engine(self, link: NcclTrainerLink) -> None:
        if self.initialized:
            return
        self.request("POST", "/shutdown_weight_transfer_engine", timeout=CONTROL_S)
        together(lambda: self.request("POST", "/init_weight_transfer_engine", {"init_info": link.init_info()}),
                 link.connect, self.timeout_s)
        self.initialized = True

    def transfer(self, link: NcclTrainerLink, export_dir: Path) -> None:
        self.request("POST", "/start_weight_update")
        info = link.update_info(export_dir)
        together(lambda: self.request("POST", "/update_weights", {"update_info": info}),
                 lambda: link.send(export_dir), self.timeout_s)
        self.request("POST", "/finish_weight_update")

    def while_paused(self, step) -> float:
        """``step()`` between ``/pause?mode=keep`` and ``/resume`` (sent whatever failed); seconds from
        pause to resume."""
        t0, error = time.monotonic(), None
        try:
            self.request("POST", "/pause?mode=keep", timeout=CONTROL_S)
            step()
        except Exception as e:  # noqa: BLE001 - resume first, then report
            error = e if isinstance(e, DeployError) else DeployError(f"{type(e).__name__}: {e}")
        try:
            self.request("POST", "/resume", timeout=CONTROL_S)
        except DeployError as e:
            error = DeployError(f"{str(error) + '; then ' if error else ''}{e}: the server may be left paused")
        if error is not None:
            raise error
        return time.monotonic() - t0

    def update(self, link: NcclTrainerLink, new: Weights, previous: Weights | None, before_resume=None) -> float:
        """``new`` live (steps 0-4 above); on failure the previous weights back, resumed, and a
        DeployError saying both. Seconds from pause to resume."""
        self.ensure_engine(link)

        def step():
            try:
                self.transfer(link, new.export_dir)
                self.request("POST", "/update_weight_version", {"new_version": new.version}, timeout=CONTROL_S)
                if before_resume is not None:
                    before_resume()
            except Exception as e:  # noqa: BLE001 - any failure here: restore before resuming
                raise DeployError(f"weight update to {new.version} failed: {e}; rolled back: "
                                  f"{self.restore(link, previous)}") from None

        return self.while_paused(step)

    def revert(self, link: NcclTrainerLink, previous: Weights, before_resume) -> str:
        """The previous weights back on a resumed server (a probe that failed); what was done."""
        done: list[str] = []
        self.while_paused(lambda: (done.append(self.restore(link, previous)), before_resume()))
        return done[0]

    def restore(self, link: NcclTrainerLink, previous: Weights | None) -> str:
        """The previous weights (same transfer, else the disk reload) and version; never raises."""
        if previous is None:
            return "no previous export known: the server may hold partly updated weights"
        try:
            self.transfer(link, previous.export_dir)
            how = f"{previous.version} sent again"
        except Exception as e:  # noqa: BLE001 - the disk reload is the way left
            try:
                self.request("POST", "/collective_rpc", {"method": "reload_weights",
                                                         "kwargs": {"weights_path": str(previous.export_dir)}})
                how = f"{previous.version} reloaded from {previous.export_dir} (its transfer failed too: {e})"
            except DeployError as e2:
                return f"could not restore {previous.version}: transfer: {e}; disk reload: {e2}"
        try:
            self.request("POST", "/update_weight_version", {"new_version": previous.version}, timeout=CONTROL_S)
        except DeployError as e:
            how += f"; its version was not set back: {e}"
        return how


def local_refusal() -> str | None:
    """Why this process cannot be NCCL rank 0 (no server contacted), else None."""
    if not cuda_available():
        return "this process sees no CUDA GPU (it joins the transfer group as NCCL rank 0, the trainer's side)"
    try:
        import vllm.distributed.weight_transfer.nccl_common  # noqa: F401
    except ImportError as e:
        return f"vLLM's NCCL transfer does not import in this process ({e}): install vLLM's CUDA build here"
    return None


def server_refusal(url: str, api_key: str | None = None) -> str | None:
    """Why the server cannot receive (one ``GET /server_info``: its device and backend), else None."""
    try:
        info = WeightTransferClient(url, api_key).request("GET", "/server_info?config_format=json", timeout=CONTROL_S)
    except DeployError as e:
        return f"its configuration could not be read: {e}"
    cfg = info.get("vllm_config") or {}
    device = str((cfg.get("device_config") or {}).get("device"))
    if not device.startswith("cuda"):
        return f"{url} runs vLLM on {device}, not a CUDA GPU"
    backend = (cfg.get("weight_transfer_config") or {}).get("backend")
    if backend != "nccl":
        return f"{url} was started without --weight-transfer-config '{{\"backend\": \"nccl\"}}' (backend: {backend})"
    return None


# one transfer group per server and process (a group lives as long as the process that joined it)
_SESSIONS: dict[str, tuple[WeightTransferClient, NcclTrainerLink]] = {}


class VLLMWeightTransferTarget:
    name = "vllm-weight-transfer"

    def __init__(self, settings, home) -> None:
        from prodrl_pipelines.config import environment

        d = settings.deploy
        self.url = d.target_endpoint.rstrip("/")
        self.address, self.port = d.weight_transfer_address, d.weight_transfer_port
        self.endpoints = endpoint_file(home, d)
        self.api_key = environment.deploy_api_key()

    def session(self) -> tuple[WeightTransferClient, NcclTrainerLink]:
        if self.url not in _SESSIONS:
            client = WeightTransferClient(self.url, self.api_key)
            workers = int(client.request("GET", "/get_world_size", timeout=CONTROL_S)["world_size"])
            _SESSIONS[self.url] = client, NcclTrainerLink(self.address, self.port or pick_port(), workers)
        return _SESSIONS[self.url]

    def _point(self, served: str | None, weights: Weights):
        return lambda: self.endpoints.write(Endpoint(self.url, served or "", weights.version, self.name,
                                                     str(weights.export_dir)))

    def switch(self, export_dir: Path, policy_version: str) -> Switch:
        why = local_refusal() or server_refusal(self.url, self.api_key)
        if why:
            raise DeployError(f"vllm-weight-transfer refuses to run: {why}. {WHY_GPU_ONLY}")
        client, link = self.session()
        ep = self.endpoints.read()
        mine = ep is not None and ep.url.rstrip("/") == self.url
        served = ep.served_model_name if mine else (served_models(self.url, self.api_key) or [None])[0]
        previous = Weights(Path(ep.export_dir), ep.policy_version) if mine and ep.export_dir else None
        new = Weights(Path(export_dir), policy_version)
        try:
            seconds = client.update(link, new, previous, before_resume=self._point(served, new))
        except DeployError:  # the group may be broken, or its port held by an abandoned rendezvous
            _SESSIONS.pop(self.url, None)
            raise
        prev = {"policy_version": previous.version, "export_dir": str(previous.export_dir)} if previous else None
        return Switch(self.name, policy_version, str(export_dir), self.url, served, seconds=seconds, previous=prev,
                      detail={"mode": "weight-transfer", "update_seconds": seconds})

    def commit(self, switch: Switch) -> None:
        pass  # the endpoint file names the new version since the resume

    def rollback(self, switch: Switch) -> str:
        if not switch.previous:
            return "no previous export known: the new weights stay loaded"
        previous = Weights(Path(switch.previous["export_dir"]), switch.previous["policy_version"])
        client, link = self.session()
        return client.revert(link, previous, before_resume=self._point(switch.served_model_name, previous))

    def stop(self) -> None:
        pass  # the server is the operator's
