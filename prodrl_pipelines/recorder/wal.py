"""The recorder's write-ahead log: framed JSON entries in numbered segment files, fsynced in groups.

Layout: ``<dir>/wal-<seq 16 digits>.log``. Each entry is framed as
``<payload length, 8 hex> <crc32 of payload, 8 hex> <payload>\\n``, so a torn or corrupted tail (a
crash in the middle of a write) is detected and ignored on replay: an entry counts only when its
whole frame is on disk with a matching checksum. The payload is compact JSON, except for recorded
calls: ``B`` + a JSON header line (the scalar fields and list lengths) + the token ids (int64; the
optional extra draw ``extra_token_ids`` last) and logprobs (float64, exact) as little-endian binary
arrays, then the optional MoE routing blob (``routed_experts``, its length in the header) -- encoding
a call's lists as JSON text
cost ~0.17 ms per call, the arrays ~0.02 ms. ``append`` writes a group of
entries with one ``write`` and one ``fdatasync``; an entry is acknowledged only after that returns.

Segments are sealed by ``rotate`` (the ingest side flushes a sealed segment's entries to Parquet,
then ``delete``s it). A new segment file and every deletion are made durable by fsyncing the
directory.
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys
import zlib
from array import array
from itertools import chain
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from prodrl_pipelines.storage.atomic import fsync_dir, write_text_atomic

__all__ = ["WriteAheadLog", "SegmentRead", "encode_entry", "decode_payload", "seq_of"]

_NAME = re.compile(r"^wal-(\d{16})\.log$")
WRITER_ID_FILE = "writer-id"
HIGH_WATER_FILE = "last-segment"


def seq_of(path: Path) -> int:
    """The segment number of a segment file."""
    return int(_NAME.match(Path(path).name).group(1))


def _write_durably(path: Path, text: str) -> None:
    write_text_atomic(path, text, mode=0o600)  # private, as the log
_HEADER = 18  # 8 hex + space + 8 hex + space


_ID_LISTS = ("prompt_token_ids", "output_token_ids")
_ROUTING = "routed_experts"  # bytes (the stored blob): after the logprobs, or base64 in a JSON entry
_B64 = "base64"
_HEAD_FIELDS = ("top_token_ids", "top_logprobs")


def _encode_call(row: dict, supersedes: int | None = None) -> bytes | None:
    """Binary payload of a call entry; None when the row does not have the usual shape."""
    try:
        out = row["output_token_ids"]
        n_out = len(out)
        heads_ids, heads_lps = row["top_token_ids"], row["top_logprobs"]
        k = len(heads_ids[0]) if heads_ids else 0
        if len(heads_ids) != n_out or len(heads_lps) != n_out or len(row["output_logprobs"]) != n_out:
            return None
        if any(len(h) != k for h in heads_ids) or any(len(h) != k for h in heads_lps):
            return None
        extra = row.get("extra_token_ids")
        routing = row.get(_ROUTING)
        header = {key: v for key, v in row.items()
                  if key not in _ID_LISTS and key not in _HEAD_FIELDS and key not in ("output_logprobs", _ROUTING)
                  and not (key == "extra_token_ids" and extra is not None)}
        if routing is not None:
            header["_r"] = len(routing)  # the routing blob follows the logprobs
        header["_n"] = [len(row["prompt_token_ids"]), n_out, k]
        if supersedes is not None:  # the entry's, not the row's: a retry's earlier row
            header["_s"] = supersedes
        ids = array("q", row["prompt_token_ids"])
        ids.extend(out)
        ids.extend(chain.from_iterable(heads_ids))
        if extra is not None:
            header["_n"].append(len(extra))  # a 4th length: the extra ids follow the heads
            ids.extend(extra)
        lps = array("d", row["output_logprobs"])
        lps.extend(chain.from_iterable(heads_lps))
    except (KeyError, TypeError, OverflowError):
        return None
    if sys.byteorder != "little":
        ids.byteswap()
        lps.byteswap()
    return (b"B" + json.dumps(header, separators=(",", ":")).encode() + b"\n" + ids.tobytes() + lps.tobytes()
            + (bytes(routing) if routing is not None else b""))


def _decode_call(payload: bytes) -> dict:
    nl = payload.index(b"\n")
    row = json.loads(payload[1:nl])
    lengths = row.pop("_n")
    supersedes = row.pop("_s", None)
    n_routing = row.pop("_r", None)
    n_prompt, n_out, k = lengths[:3]
    n_extra = lengths[3] if len(lengths) > 3 else None  # older entries: no extra ids in the arrays
    n_ids = n_prompt + n_out + n_out * k + (n_extra or 0)
    ids, lps = array("q"), array("d")
    ids.frombytes(payload[nl + 1 : nl + 1 + 8 * n_ids])
    lps_end = len(payload) - (n_routing or 0)
    lps.frombytes(payload[nl + 1 + 8 * n_ids : lps_end])
    if n_routing is not None:
        row[_ROUTING] = payload[lps_end:]
    if sys.byteorder != "little":
        ids.byteswap()
        lps.byteswap()
    if len(ids) != n_ids or len(lps) != n_out + n_out * k:
        raise ValueError("call entry arrays have the wrong length")
    ids_l, lps_l = ids.tolist(), lps.tolist()
    row["prompt_token_ids"] = ids_l[:n_prompt]
    row["output_token_ids"] = ids_l[n_prompt : n_prompt + n_out]
    base = n_prompt + n_out
    row["top_token_ids"] = [ids_l[base + i * k : base + (i + 1) * k] for i in range(n_out)]
    if n_extra is not None:
        row["extra_token_ids"] = ids_l[base + n_out * k :]
    row["output_logprobs"] = lps_l[:n_out]
    row["top_logprobs"] = [lps_l[n_out + i * k : n_out + (i + 1) * k] for i in range(n_out)]
    entry = {"kind": "call", "row": row}
    if supersedes is not None:
        entry["supersedes"] = supersedes
    return entry


def encode_entry(entry: dict) -> bytes:
    """One framed entry (see the module docstring)."""
    payload = _encode_call(entry["row"], entry.get("supersedes")) if entry.get("kind") == "call" else None
    if payload is None:
        row = entry.get("row")
        if isinstance(row, dict) and isinstance(row.get(_ROUTING), bytes):  # JSON has no bytes
            entry = {**entry, "row": {**row, _ROUTING: {_B64: base64.b64encode(row[_ROUTING]).decode()}}}
        payload = json.dumps(entry, separators=(",", ":"), allow_nan=True).encode()
    return b"%08x %08x " % (len(payload), zlib.crc32(payload)) + payload + b"\n"


def decode_payload(payload: bytes) -> dict:
    if payload[:1] == b"B":
        return _decode_call(payload)
    entry = json.loads(payload)
    row = entry.get("row") if isinstance(entry, dict) else None
    if isinstance(row, dict) and isinstance(row.get(_ROUTING), dict) and _B64 in row[_ROUTING]:
        row[_ROUTING] = base64.b64decode(row[_ROUTING][_B64])
    return entry


@dataclass
class SegmentRead:
    path: Path
    entries: list[dict]
    valid_bytes: int  # length of the prefix made of whole, valid frames
    torn: bool  # bytes after the valid prefix (a torn or corrupt tail)




class WriteAheadLog:
    """Append-only segments in ``directory``; not thread-safe (one writer thread owns it)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = None
        self._seq: int | None = None
        self.bytes_written = 0

    # ------------------------------------------------------------------ reading

    def segments(self) -> list[Path]:
        """Existing segment files, oldest first."""
        found = []
        for p in self.dir.iterdir():
            m = _NAME.match(p.name)
            if m:
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    @staticmethod
    def read_segment(path: Path) -> SegmentRead:
        data = path.read_bytes()
        entries, at = [], 0
        while at < len(data):
            head = data[at : at + _HEADER]
            try:
                if len(head) < _HEADER or head[8:9] != b" " or head[17:18] != b" ":
                    raise ValueError
                length, crc = int(head[:8], 16), int(head[9:17], 16)
            except ValueError:
                break
            start, end = at + _HEADER, at + _HEADER + length
            if end + 1 > len(data) or data[end : end + 1] != b"\n":
                break
            payload = data[start:end]
            if zlib.crc32(payload) != crc:
                break
            try:
                entries.append(decode_payload(payload))
            except (ValueError, KeyError, TypeError):
                break
            at = end + 1
        return SegmentRead(path, entries, at, at < len(data))

    # ------------------------------------------------------------------ writing

    def _path(self, seq: int) -> Path:
        return self.dir / f"wal-{seq:016d}.log"

    def open(self) -> Path:
        """Start a new segment after every segment this log ever had; returns its path. Numbers never
        repeat, even after every segment was flushed and deleted: the store's application
        transactions key commits by (``writer_id``, segment number)."""
        existing = self.segments()
        seq = max(seq_of(existing[-1]) if existing else 0, self._high_water()) + 1
        return self._open(seq)

    def writer_id(self) -> str:
        """This log's stable identity (created once, kept in the directory): whoever replays it is the
        same writer to the store, whichever process or replica it is."""
        path = self.dir / WRITER_ID_FILE
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            import uuid

            _write_durably(path, f"recorder-{uuid.uuid4().hex}")
            return path.read_text().strip()

    def _high_water(self) -> int:
        try:
            return int((self.dir / HIGH_WATER_FILE).read_text().strip() or 0)
        except FileNotFoundError:
            return 0

    def _set_high_water(self, seq: int) -> None:
        _write_durably(self.dir / HIGH_WATER_FILE, str(seq))

    def _open(self, seq: int) -> Path:
        path = self._path(seq)
        self._set_high_water(seq)  # before the segment exists: a number is never handed out twice
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # as private as the parts
        self._seq = seq
        fsync_dir(self.dir)
        return path

    @property
    def current(self) -> Path | None:
        return None if self._seq is None else self._path(self._seq)

    def append(self, frames: Iterable[bytes]) -> None:
        """Write the framed entries and make them durable (one write, one fdatasync)."""
        if self._fd is None:
            raise RuntimeError("the write-ahead log is not open")
        buf = b"".join(frames)
        view = memoryview(buf)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        os.fdatasync(self._fd)
        self.bytes_written += len(buf)

    def rotate(self) -> Path:
        """Seal the current segment and open the next; returns the sealed segment's path."""
        sealed = self.current
        if sealed is None or self._seq is None:
            raise RuntimeError("the write-ahead log is not open")
        self.close()
        self._open(self._seq + 1 if self._seq is not None else 1)
        return sealed

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def delete(self, path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        fsync_dir(self.dir)
