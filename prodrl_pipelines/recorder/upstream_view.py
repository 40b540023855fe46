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
    """The deployment's endpoint file, re-read when it changes (one ``stat`` per call; the deploy
    target replaces it atomically, so a changed inode or mtime means a new switch)."""

    def __init__(self, path: str | os.PathLike) -> None:
        from prodrl_pipelines.deploy_targets.base import EndpointFile

        self.path = Path(path)
        self.file = EndpointFile(self.path)
        self._key = None
        self._ep = None

    def current(self):
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._key:
            self._ep, self._key = self.file.read(), key
        return self._ep
