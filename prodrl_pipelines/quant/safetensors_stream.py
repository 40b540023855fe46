"""Safetensors read and written a slice at a time, so an export's memory follows a chunk, not the model.

The format is an 8-byte little-endian header length, a JSON header (per tensor: dtype, shape and
byte offsets into the data section that follows; ``__metadata__``), then the raw bytes. The reader
takes row ranges with plain file reads (no mmap: touched pages of a mapping count in the process's
resident memory until it is unmapped); the writer appends each tensor's bytes, chunk by chunk, to a
data file and writes the header in front when the shard closes, splitting shards at a byte budget.
Files are exactly what ``safetensors.torch.save_file`` writes (readable by it, vLLM and transformers).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from os import PathLike
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}
CHUNK_BYTES = 32 * 1024**2  # a slice read or written at once


class SafetensorsError(ValueError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in ``file``

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def meta(self) -> Tensor:
        """A shape-and-dtype stand-in (no storage)."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


def _header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise SafetensorsError(f"{path}: unreadable safetensors header: {e}") from e
    return header, 8 + n


class CheckpointReader(Mapping):
    """Every tensor of a (possibly sharded) safetensors directory, by name, read when asked for (a
    read-only mapping: ``reader[name]`` reads that tensor alone), or a row range at a time."""

    def __init__(self, path: str | PathLike) -> None:
        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (path / f).exists()]
            if missing:
                raise SafetensorsError(f"{path}: shard(s) {missing} listed in {index.name} are missing")
        else:
            files, weight_map = sorted(f.name for f in path.glob("*.safetensors")), None
        if not files:
            raise SafetensorsError(f"{path}: no *.safetensors weights")
        self.tensors: dict[str, TensorInfo] = {}
        for fname in files:
            header, base = _header(path / fname)
            for name, spec in header.items():
                if name == "__metadata__":
                    continue
                if spec["dtype"] not in DTYPES:
                    raise SafetensorsError(f"{path / fname}: tensor {name} has unsupported dtype {spec['dtype']}")
                self.tensors[name] = TensorInfo(path / fname, DTYPES[spec["dtype"]], tuple(spec["shape"]),
                                                base + spec["data_offsets"][0])
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(self.tensors))
            if absent:
                raise SafetensorsError(f"{path}: tensors listed in the index are missing from the shards: {absent[:5]}")

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.tensors:
            raise KeyError(name)
        info = self.tensors[name]
        return self.rows(name, 0, info.shape[0] if len(info.shape) >= 2 else 1)

    def rows(self, name: str, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` of the tensor's first dimension (a 0-d or 1-d tensor: all of it)."""
        info = self.tensors[name]
        shape = info.shape
        if len(shape) < 2:
            start, stop, row_bytes, out_shape = 0, 1, info.nbytes, shape
        else:
            row_bytes = info.nbytes // shape[0]
            out_shape = (stop - start, *shape[1:])
        buf = bytearray((stop - start) * row_bytes)
        with open(info.file, "rb") as f:
            f.seek(info.start + start * row_bytes)
            if f.readinto(buf) != len(buf):
                raise SafetensorsError(f"{info.file}: tensor {name} is truncated")
        flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        return flat.view(info.dtype).reshape(out_shape)

    def chunks(self, name: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Tensor]:
        """The tensor in row slices of about ``chunk_bytes`` (one slice below 2 dimensions)."""
        info = self.tensors[name]
        if len(info.shape) < 2 or info.shape[0] == 0:
            yield self.rows(name, 0, 1)
            return
        step = max(1, chunk_bytes // max(1, info.nbytes // info.shape[0]))
        for s in range(0, info.shape[0], step):
            yield self.rows(name, s, min(s + step, info.shape[0]))


class ShardedWriter:
    """Tensors appended one at a time (each from row chunks), written as safetensors shards of at most
    ``max_shard_bytes`` (a tensor larger than that gets a shard of its own) plus an index when there
    are several; ``model.safetensors`` when one."""

    def __init__(self, out: Path, max_shard_bytes: int) -> None:
        self.out, self.max_shard_bytes = Path(out), max_shard_bytes
        self.shards: list[tuple[Path, dict]] = []  # (data file, header)
        self._data = None
        self.total = 0

    def _new_shard(self) -> None:
        if self._data is not None:
            self._data.close()
        path = self.out / f".shard-{len(self.shards):05d}.data"
        self._data = open(path, "wb")
        self.shards.append((path, {}))
        self._size = 0

    def add(self, name: str, chunks: Iterable[Tensor], nbytes: int | None = None) -> None:
        """Append tensor ``name`` from its row chunks (concatenated along dim 0). ``nbytes``: its size,
        when known, to start a new shard before it rather than after."""
        if self._data is None or (nbytes is not None and self._size and self._size + nbytes > self.max_shard_bytes):
            self._new_shard()
        header = self.shards[-1][1]
        begin, rows, rest, dtype = self._size, 0, None, None
        for c in chunks:
            c = c.contiguous()
            if dtype is None:
                dtype, rest = c.dtype, tuple(c.shape[1:]) if c.dim() else None
            elif c.dtype != dtype or tuple(c.shape[1:]) != rest:
                raise SafetensorsError(f"tensor {name}: chunk {tuple(c.shape)} {c.dtype} does not match the first")
            raw = c.reshape(-1).view(torch.uint8).numpy() if c.numel() else np.zeros(0, np.uint8)
            self._data.write(memoryview(raw))
            self._size += raw.nbytes
            rows += c.shape[0] if c.dim() else 1
        if dtype is None:
            raise SafetensorsError(f"tensor {name}: no data")
        shape = [] if rest is None else [rows, *rest]
        header[name] = {"dtype": NAMES[dtype], "shape": shape, "data_offsets": [begin, self._size]}
        self.total += self._size - begin
        if self._size >= self.max_shard_bytes:
            self._data.close()
            self._data = None

    def close(self) -> int:
        """Write the shards (header + data) and the index; returns the bytes of tensor data."""
        if self._data is not None:
            self._data.close()
            self._data = None
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (data, header), fname in zip(self.shards, names):
            blob = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
            blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
            with open(self.out / fname, "wb") as f, open(data, "rb") as d:
                f.write(struct.pack("<Q", len(blob)))
                f.write(blob)
                shutil.copyfileobj(d, f, CHUNK_BYTES)
            data.unlink()
            weight_map.update({k: fname for k in header})
        if n > 1:
            (self.out / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": self.total}, "weight_map": weight_map}, indent=1))
        return self.total
