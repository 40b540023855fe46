"""``vllm-weight-transfer``: its refusal on CPU, and its HTTP choreography against a real vLLM CPU server.

The session's shared server (``vllm_server``) runs in dev mode with ``--weight-transfer-config``
(the nccl backend): without it the transfer endpoints only answer "Weight transfer not configured".
This module runs after ``test_vllm.py`` on the same worker (one unit of the schedule). On vLLM's CPU build
the transfer group cannot be created (``/init_weight_transfer_engine`` answers 500), so the happy
path needs a GPU (``scripts/gpu_weight_transfer_check.py``); here the choreography is driven with the
refusal bypassed (the client called directly) through what a CPU server really does: a refused
init, and an update whose transfer fails, which must be rolled back and resumed.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from prodrl_pipelines.config.settings import Settings
from prodrl_pipelines.deploy_targets import TARGETS, make_target
from prodrl_pipelines.deploy_targets.base import DeployError, Switch
from prodrl_pipelines.deploy_targets.endpoint_store import endpoint_file
from prodrl_pipelines.deploy_targets.nccl_link import NcclTrainerLink, export_tensors
from prodrl_pipelines.deploy_targets.processes import pick_port
from prodrl_pipelines.deploy_targets.servers import cuda_available
from prodrl_pipelines.deploy_targets.weight_transfer import (
    _SESSIONS,
    VLLMWeightTransferTarget,
    WeightTransferClient,
    Weights,
    server_refusal,
)

PROMPT = {"prompt": [1, 5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "logprobs": 1, "seed": 0}


def test_refuses_on_cpu_before_touching_the_server(tmp_path):
    """No CUDA here: the switch fails naming why, and no connection reaches the endpoint."""
    if cuda_available():
        pytest.skip("a CUDA GPU is visible: this host does not refuse")
    assert TARGETS["vllm-weight-transfer"] is VLLMWeightTransferTarget
    with pytest.raises(ValueError, match="vllm-weight-transfer' needs target_endpoint"):
        Settings(deploy={"target": "vllm-weight-transfer"})
    with socket.socket() as listener:  # stands where the server would be: any request would connect here
        listener.bind(("127.0.0.1", pick_port()))
        listener.listen()
        listener.setblocking(False)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        settings = Settings(home=str(tmp_path / "home"), deploy={"target": "vllm-weight-transfer", "target_endpoint": url})
        with pytest.raises(DeployError) as err:
            make_target(settings).switch(tmp_path / "export", "v1")
        with pytest.raises(BlockingIOError):
            listener.accept()
    msg = str(err.value)
    assert msg.startswith("vllm-weight-transfer refuses to run: this process sees no CUDA GPU")
    assert "GPU-only" in msg and "Cannot access accelerator device" in msg and "vllm-restart" in msg
    assert endpoint_file(settings.home_path).read() is None


@pytest.fixture(scope="module")
def wt_server(vllm_server, vllm_exports):
    """The session's dev-mode vLLM (the nccl weight-transfer backend configured), serving the dense
    bf16 export: what a failed transfer leaves is restored from that export's directory. The server
    has a history (test_vllm reloads other weights in place, which vLLM's CPU backend applies only in
    part), so the module starts from that export's disk reload, the state a rollback restores."""
    WeightTransferClient(vllm_server.url, timeout_s=60).request(
        "POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(vllm_exports["dense-bf16"])}})
    return vllm_server


def first_logprobs(client: WeightTransferClient) -> list[float]:
    out = client.request("POST", "/v1/completions", {"model": "dense-bf16", **PROMPT})
    return out["choices"][0]["logprobs"]["token_logprobs"]


def state(client: WeightTransferClient) -> tuple[str, bool]:
    return (client.request("GET", "/weight_info")["weight_version"],
            client.request("GET", "/is_paused")["is_paused"])


def test_the_server_reports_its_cpu_device(wt_server):
    assert server_refusal(wt_server.url) == f"{wt_server.url} runs vLLM on cpu, not a CUDA GPU"


def test_a_refused_init_leaves_the_server_untouched(wt_server, vllm_exports):
    """The group is set up before the pause: on CPU vLLM refuses it, and nothing else is sent."""
    client = WeightTransferClient(wt_server.url, timeout_s=60)
    before, ref = state(client), first_logprobs(client)
    client.calls.clear()
    link = NcclTrainerLink("127.0.0.1", pick_port(), workers=1)
    with pytest.raises(DeployError, match="init_weight_transfer_engine -> HTTP 500: .*Cannot access accelerator device"):
        client.update(link, Weights(vllm_exports["dense2-bf16"], "v-new"), Weights(vllm_exports["dense-bf16"], "v-old"))
    assert client.calls == [("/shutdown_weight_transfer_engine", 200), ("/init_weight_transfer_engine", 500)]
    assert state(client) == before and not before[1] and first_logprobs(client) == ref


def test_a_failed_transfer_is_rolled_back_and_resumed(wt_server, vllm_exports):
    """Init bypassed (on CPU the group cannot exist): pause, start, the transfer fails, the previous
    export comes back (its transfer fails the same way, vLLM's disk reload restores it), its version
    is set, resume. Without the restore the next request would kill the engine: start_weight_update
    left the weights on the meta device."""
    client = WeightTransferClient(wt_server.url, timeout_s=60)
    version0, _ = state(client)
    ref = first_logprobs(client)
    client.calls.clear()
    client.initialized = True  # the bypass: skip init_weight_transfer_engine
    link = NcclTrainerLink("127.0.0.1", pick_port(), workers=1)
    pointed = []
    with pytest.raises(DeployError) as err:
        client.update(link, Weights(vllm_exports["dense2-bf16"], "v-new"), Weights(vllm_exports["dense-bf16"], "v-old"),
                      before_resume=lambda: pointed.append(True))
    assert client.calls == [
        ("/pause?mode=keep", 200), ("/start_weight_update", 200), ("/update_weights", 500),  # the update
        ("/start_weight_update", 200), ("/update_weights", 500),  # the previous export by the same transfer
        ("/collective_rpc", 200), ("/update_weight_version", 200),  # ... by the disk reload, its version
        ("/resume", 200)]
    msg = str(err.value)
    assert msg.startswith("weight update to v-new failed: server: POST") and "NCCL weight transfer not initialized" in msg
    assert f"rolled back: v-old reloaded from {vllm_exports['dense-bf16']}" in msg
    assert not pointed  # the endpoint file is pointed only after a transfer that succeeded
    assert version0 != "v-old" and state(client) == ("v-old", False)  # the version the server reports moved
    assert first_logprobs(client) == ref  # the engine lives, on the previous weights


def test_rollback_after_a_failed_probe_restores_the_previous_export(wt_server, vllm_exports, tmp_path):
    """The target's rollback (a probe failed after a switch): pause, previous weights and version back,
    the endpoint file pointed at them before the resume."""
    settings = Settings(home=str(tmp_path / "home"), deploy={"target": "vllm-weight-transfer",
                                                            "target_endpoint": wt_server.url})
    target = make_target(settings)
    sw = Switch("vllm-weight-transfer", "v-bad", str(vllm_exports["dense2-bf16"]), wt_server.url, "dense-bf16",
                previous={"policy_version": "v-good", "export_dir": str(vllm_exports["dense-bf16"])})
    try:
        done = target.rollback(sw)
        client = _SESSIONS[wt_server.url][0]
        assert client.calls == [("/get_world_size", 200), ("/pause?mode=keep", 200), ("/start_weight_update", 200),
                                ("/update_weights", 500), ("/collective_rpc", 200), ("/update_weight_version", 200),
                                ("/resume", 200)]
        assert done.startswith(f"v-good reloaded from {vllm_exports['dense-bf16']}")
        ep = endpoint_file(settings.home_path).read()
        assert (ep.policy_version, ep.export_dir, ep.served_model_name) == ("v-good", str(vllm_exports["dense-bf16"]),
                                                                           "dense-bf16")
        assert state(client) == ("v-good", False)
        assert target.rollback(Switch("vllm-weight-transfer", "v-x", "", wt_server.url)).startswith("no previous")
    finally:
        _SESSIONS.pop(wt_server.url, None)


def test_update_info_lists_the_stored_tensors(vllm_exports):
    """What /update_weights is told to expect: every stored tensor, its torch dtype name and shape."""
    from safetensors import safe_open

    info = NcclTrainerLink.update_info(vllm_exports["dense-bf16"])
    with safe_open(str(Path(vllm_exports["dense-bf16"]) / "model.safetensors"), "pt") as f:
        expect = {k: (str(f.get_tensor(k).dtype).split(".")[-1], list(f.get_tensor(k).shape)) for k in f.keys()}
    assert dict(zip(info["names"], zip(info["dtype_names"], info["shapes"]))) == expect
    assert len(info["names"]) == len(export_tensors(vllm_exports["dense-bf16"]))
    with pytest.raises(DeployError, match="holds no"):
        export_tensors(Path("/nonexistent-export"))
