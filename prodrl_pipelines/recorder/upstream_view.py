"""What the recorder knows of its upstream besides its answers: the token strings of its tokenizer, and
the deployment's endpoint file it follows."""

from __future__ import annotations

import json
import os
from pathlib import Path


class TokenStrings:
    """Token id -> vLLM's token string (``tokenizer.decode([id])``), and text of id lists."""

    def __init__(self, tokenizer_dir: str | os.PathLike) -> None:
        path = Path(tokenizer_dir)
        self._cache: dict[int, str] = {}
        cfg = {}
        if (path / "tokenizer_config.json").is_file():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        self._cleanup = bool(cfg.get("clean_up_tokenization_spaces", False))
        if (path / "tokenizer.json").is_file():  # light: no transformers import
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(path / "tokenizer.json"))
            self._decode = lambda ids: tok.decode(list(ids), skip_special_tokens=False)
        else:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(path))
            self._decode = lambda ids: hf.decode(list(ids), skip_special_tokens=False)

    def text(self, ids) -> str:
        s = self._decode(ids)
        if self._cleanup:  # transformers' clean_up_tokenization
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                s = s.replace(a, b)
        return s

    def piece(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            s = self._cache[tid] = self.text([tid])
        return s


class FollowedEndpoint:
    """The deployment's endpoint record, as fresh as a call needs it and read without blocking the
    event loop. A file (one host): re-read when it changes (one ``stat`` per call; the deploy target
    replaces it atomically, so a changed inode or mtime means a new switch). A PostgreSQL row
    (``URL#NAME``, ``deploy_targets.endpoint_store``: the deploy step on another host): a thread polls
    its version every ``poll_s`` and ``current()`` returns the last record read; while the database
    cannot be reached the recorder keeps the last one (``error`` says why)."""

    def __init__(self, where: str | os.PathLike, poll_s: float = 0.5) -> None:
        import threading

        from prodrl_pipelines.deploy_targets.endpoint_store import is_database_url, open_endpoint

        self.location = str(where)
        self.file = open_endpoint(self.location)
        self._key = None
        self._ep = None
        self.error = ""
        self._stop = None
        if is_database_url(self.location):
            self.poll_s = poll_s
            self._poll_once()
            self._stop = threading.Event()
            threading.Thread(target=self._poll, daemon=True, name="endpoint-poll").start()

    def _poll_once(self) -> None:
        try:
            version, ep = self.file.read_versioned()
            if version != self._key:
                self._ep, self._key = ep, version
            self.error = ""
        except Exception as e:  # noqa: BLE001 - a database restart: keep serving the last record
            self.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._poll_once()

    def close(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def current(self):
        if self._stop is not None:
            return self._ep
        try:
            st = os.stat(self.file.path)
        except FileNotFoundError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._key:
            self._ep, self._key = self.file.read(), key
        return self._ep
