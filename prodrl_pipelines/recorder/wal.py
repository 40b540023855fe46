"""The recorder's write-ahead log: framed JSON entries in numbered segment files, fsynced in groups.

Layout: ``<dir>/wal-<seq 16 digits>.log``. Each entry is framed as
``<payload length, 8 hex> <crc32 of payload, 8 hex> <payload>\\n`` with a compact JSON payload, so a
torn or corrupted tail (a crash in the middle of a write) is detected and ignored on replay: an entry
counts only when its whole frame is on disk with a matching checksum. ``append`` writes a group of
entries with one ``write`` and one ``fdatasync``; an entry is acknowledged only after that returns.

Segments are sealed by ``rotate`` (the ingest side flushes a sealed segment's entries to Parquet,
then ``delete``s it). A new segment file and every deletion are made durable by fsyncing the
directory.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["WriteAheadLog", "SegmentRead", "encode_entry"]

_NAME = re.compile(r"^wal-(\d{16})\.log$")
_HEADER = 18  # 8 hex + space + 8 hex + space


def encode_entry(entry: dict) -> bytes:
    payload = json.dumps(entry, separators=(",", ":"), allow_nan=True).encode()
    return b"%08x %08x " % (len(payload), zlib.crc32(payload)) + payload + b"\n"


@dataclass
class SegmentRead:
    path: Path
    entries: list[dict]
    valid_bytes: int  # length of the prefix made of whole, valid frames
    torn: bool  # bytes after the valid prefix (a torn or corrupt tail)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
                entries.append(json.loads(payload))
            except ValueError:
                break
            at = end + 1
        return SegmentRead(path, entries, at, at < len(data))

    # ------------------------------------------------------------------ writing

    def _path(self, seq: int) -> Path:
        return self.dir / f"wal-{seq:016d}.log"

    def open(self) -> Path:
        """Start a new segment after the existing ones; returns its path."""
        existing = self.segments()
        seq = int(_NAME.match(existing[-1].name).group(1)) + 1 if existing else 1
        return self._open(seq)

    def _open(self, seq: int) -> Path:
        path = self._path(seq)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._seq = seq
        _fsync_dir(self.dir)
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
        _fsync_dir(self.dir)
