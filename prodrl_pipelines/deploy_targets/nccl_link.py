"""The trainer's side of vLLM's NCCL weight transfer: this process as rank 0 of the transfer group.

It sends an export's tensors as stored (names, dtypes and shapes read from the safetensors headers,
in a fixed order that ``update_info`` announces to the server), packed the way vLLM's NCCL engine
unpacks them (``packed_nccl_broadcast_producer``). vLLM is imported only to connect and send: a host
without it can still build the announcement. The HTTP side is ``weight_transfer.WeightTransferClient``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from prodrl_pipelines.deploy_targets.base import DeployError

PACKED_BUFFER_BYTES = 256 << 20  # per packed buffer, both sides (vLLM's default, 2 x 1 GiB, also sits on the server's GPU)
# safetensors dtype -> the torch attribute name vLLM's worker resolves (getattr(torch, name))
DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "U8": "uint8", "I8": "int8",
          "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
          "F8_E5M2": "float8_e5m2"}


def export_tensors(export_dir: Path) -> list[tuple[Path, str, str, list[int]]]:
    """(file, name, torch dtype name, shape) of every stored tensor, in the order they are sent (read
    from the safetensors headers: nothing is loaded)."""
    files = sorted(Path(export_dir).glob("*.safetensors"))
    if not files:
        raise DeployError(f"{export_dir} holds no *.safetensors to send")
    out = []
    for f in files:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name in sorted(k for k in header if k != "__metadata__"):
            dtype = header[name]["dtype"]
            if dtype not in DTYPES:
                raise DeployError(f"{f}: tensor {name} has dtype {dtype}, which the NCCL transfer does not send")
            out.append((f, name, DTYPES[dtype], header[name]["shape"]))
    return out


class NcclTrainerLink:
    """This process as NCCL rank 0 of the transfer group, sending exports from its current CUDA device."""

    def __init__(self, address: str, port: int, workers: int) -> None:
        self.address, self.port, self.world_size = address, port, workers + 1
        self.group = None

    def init_info(self) -> dict:
        return {"master_address": self.address, "master_port": self.port, "rank_offset": 1,
                "world_size": self.world_size, "packed": True, "packed_buffer_size_bytes": PACKED_BUFFER_BYTES}

    def connect(self) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init({"master_address": self.address, "master_port": self.port,
                                   "world_size": self.world_size})

    @staticmethod
    def update_info(export_dir: Path) -> dict:
        tensors = export_tensors(export_dir)
        return {"names": [t[1] for t in tensors], "dtype_names": [t[2] for t in tensors],
                "shapes": [t[3] for t in tensors]}

    def send(self, export_dir: Path) -> None:
        if self.group is None:
            raise DeployError(f"no NCCL group with the server on {self.address}:{self.port}: "
                              "init_weight_transfer_engine has not run in this process")
        import torch
        from safetensors import safe_open
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        device = f"cuda:{torch.cuda.current_device()}"

        def tensors():
            for f, name, _, _ in export_tensors(export_dir):
                with safe_open(str(f), "pt", device=device) as fh:
                    yield name, fh.get_tensor(name)

        packed_nccl_broadcast_producer(iterator=tensors(), group=self.group, src=0, post_iter_func=lambda item: item[1],
                                       buffer_size_bytes=PACKED_BUFFER_BYTES, num_buffers=2)
        torch.cuda.current_stream().synchronize()
