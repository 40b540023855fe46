"""Reading an OpenAI-compatible server's logprobs back (the vLLM client and the recorder): the
sampled token's processed logprob and the top-K head of each generated position, from the
completion layout (``{token: logprob}`` per position) or the chat layout (``top_logprobs`` entries),
with the token strings as ``token_id:<id>`` (``return_tokens_as_token_ids``). The layouts
themselves, and how the server writes them, are ``openai_protocol``'s."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from prodrl_pipelines.engines.openai_protocol import (
    COMPLETE_MASS_TOL,
    LOGPROB_FLOOR,
    TOKEN_ID_PREFIX,
    ProtocolError,
    token_id_string,
)

_TOKEN_IDS: dict[str, int] = {}  # "token_id:<id>" -> id, filled as met (bounded by the vocabulary)
_TOKEN_IDS_MAX = 1 << 20


def parse_token_id(token: str) -> int:
    """The id in a ``"token_id:<id>"`` string; ``ProtocolError`` for anything else."""
    tid = _TOKEN_IDS.get(token) if type(token) is str else None
    if tid is not None:
        return tid
    if not isinstance(token, str) or not token.startswith(TOKEN_ID_PREFIX):
        raise ProtocolError(f"expected a {TOKEN_ID_PREFIX!r} token string (return_tokens_as_token_ids), got {token!r}",
                            status=502)
    try:
        return int(token[len(TOKEN_ID_PREFIX):])
    except ValueError:
        raise ProtocolError(f"malformed token id string {token!r}", status=502) from None


def reconstruct_head(
    sampled_id: int,
    sampled_lp: float,
    rest: Sequence[tuple[int, float]],
    k: int,
    n_requested: int | None = None,
) -> tuple[list[int], list[float]]:
    """The top-``k`` head (ids, logprobs, descending) of one position from vLLM's entry list.

    ``rest`` is the position's entries after the sampled token, in vLLM's order (the top tokens by
    rank, without the sampled one). For completions, ``n_requested`` (the ``logprobs`` asked for)
    tells whether the sampled token was in the top n: then ``rest`` has n - 1 entries and the
    sampled token goes back to its rank, found by its logprob (after any exactly equal logprobs;
    only the order among exact ties can differ from the engine's). Chat truncates the list at n, so
    its head is exact for k <= n - 1 only (``parse_chat_logprobs``).
    """
    sid = int(sampled_id)
    ids = [int(t) for t, _ in rest]
    lps = [float(lp) for _, lp in rest]
    return _head(sid, float(sampled_lp), ids, lps, k, n_requested)


def _head(sid: int, slp: float, ids: list[int], lps: list[float], k: int,
          n_requested: int | None) -> tuple[list[int], list[float]]:
    if sid in ids:  # not vLLM's layout (the sampled token repeated): drop the repeat
        keep = [i for i, t in enumerate(ids) if t != sid]
        ids, lps = [ids[i] for i in keep], [lps[i] for i in keep]
    if n_requested is None or len(ids) < n_requested:
        pos = sum(1 for lp in lps if lp >= slp)
        ids = ids[:pos] + [sid] + ids[pos:]
        lps = lps[:pos] + [slp] + lps[pos:]
    if len(ids) < k:
        raise ProtocolError(f"logprob head has {len(ids)} entries, fewer than the {k} requested", status=502)
    return ids[:k], lps[:k]


def narrow_entries(entries: Sequence[tuple[Any, float]], n_from: int | None, n_to: int) -> list[tuple[Any, float]]:
    """vLLM's per-position entries for ``logprobs = n_to`` from those returned for ``n_from >= n_to``.

    ``entries`` is the position's list in vLLM's order (sampled token first; keys compared by
    equality, e.g. ``token_id:`` strings). ``n_from`` is the completions request's n (its dict then
    tells whether the sampled token was in the top n); ``None`` for a chat list (cut at n entries).
    The result is ``[sampled] + (top n_to without the sampled token)``: a completions dict for
    n_to is all of it, a chat list its first n_to entries.
    """
    if not entries:
        return list(entries)
    s, rest = entries[0], [e for e in entries[1:] if e[0] != entries[0][0]]
    if n_from is not None and len(rest) >= n_from:
        ranked = rest
    else:
        pos = sum(1 for _, lp in rest if lp >= s[1])
        ranked = rest[:pos] + [s] + rest[pos:]
    return [s] + [e for e in ranked[: max(n_to, 0)] if e[0] != s[0]]


def _ids_of(keys) -> list[int]:
    """Ids of ``token_id:<id>`` strings; ``ProtocolError`` if any key is something else.

    A dict lookup per key (the strings repeat: one vocabulary) instead of parsing each: this was
    the recorder's largest own cost per call (20 top logprobs x every generated position)."""
    cache = _TOKEN_IDS
    try:
        return [cache[key] for key in keys]
    except (KeyError, TypeError):
        pass
    p, n = TOKEN_ID_PREFIX, len(TOKEN_ID_PREFIX)
    try:
        ids = [int(key[n:]) if key.startswith(p) else None for key in keys]
    except (ValueError, AttributeError):
        ids = [None]
    if None in ids:
        bad = next((key for key in keys if not (isinstance(key, str) and key.startswith(p))), keys)
        raise ProtocolError(f"expected {p!r} token strings (return_tokens_as_token_ids), got {bad!r}", status=502)
    if len(cache) > _TOKEN_IDS_MAX:
        cache.clear()
    for key, tid in zip(keys, ids):
        if key == token_id_string(tid):  # canonical spelling only ("token_id:007" is parsed, not cached)
            cache[key] = tid
    return ids


def parse_completion_logprobs(
    logprobs: dict | None, token_ids: Sequence[int], n_requested: int, k: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """(sampled logprobs, head ids, head logprobs) from a completions ``logprobs`` object that was
    requested with ``logprobs=n_requested`` and ``return_tokens_as_token_ids``; heads of size k <= n."""
    if not isinstance(logprobs, dict):
        raise ProtocolError("the upstream answer has no logprobs", status=502)
    tops = logprobs.get("top_logprobs")
    lps = logprobs.get("token_logprobs")
    if not isinstance(tops, list) or not isinstance(lps, list) or len(tops) != len(token_ids) or len(lps) != len(token_ids):
        raise ProtocolError(f"logprobs cover {len(tops) if isinstance(tops, list) else 'no'} positions for "
                            f"{len(token_ids)} generated tokens", status=502)
    sampled, head_ids, head_lps = [], [], []
    for tid, lp, top in zip(token_ids, lps, tops):
        if lp is None or not isinstance(top, dict):
            raise ProtocolError("a generated position has no logprobs", status=502)
        ids = _ids_of(top)
        vals = list(map(float, top.values()))
        tid, lp = int(tid), float(lp)
        if ids and ids[0] == tid:
            ids, vals = ids[1:], vals[1:]
        else:  # not vLLM's order; treat the entries as a ranked list
            order = sorted((i for i, t in enumerate(ids) if t != tid), key=lambda i: -vals[i])
            ids, vals = [ids[i] for i in order], [vals[i] for i in order]
        hi, hl = _head(tid, lp, ids, vals, k, n_requested)
        sampled.append(lp)
        head_ids.append(hi)
        head_lps.append(hl)
    return sampled, head_ids, head_lps


def parse_chat_logprobs(
    logprobs: dict | None, token_ids: Sequence[int], k: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Like ``parse_completion_logprobs`` for a chat ``logprobs.content`` list. The list holds the
    first n entries of vLLM's dict (sampled first), so asking ``top_logprobs = k + 1`` gives an
    exact top-k head."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or len(content) != len(token_ids):
        raise ProtocolError(f"chat logprobs cover {len(content) if isinstance(content, list) else 'no'} positions "
                            f"for {len(token_ids)} generated tokens", status=502)
    sampled, head_ids, head_lps = [], [], []
    cache = _TOKEN_IDS
    for tid, item in zip(token_ids, content):
        if not isinstance(item, dict) or item.get("logprob") is None:
            raise ProtocolError("a generated position has no logprob", status=502)
        lp = float(item["logprob"])
        tops = item.get("top_logprobs") or []
        try:  # the token strings repeat (one vocabulary): a dict lookup each, as in ``_ids_of``
            ids = [cache[e["token"]] for e in tops]
        except (KeyError, TypeError):  # one not met yet, or not a token string: parsed entry by entry
            ids = [t for t, _ in _chat_entries(tops)]
        vals = [float(e["logprob"]) for e in tops]
        tid = int(tid)
        if ids and ids[0] == tid:
            ids, vals = ids[1:], vals[1:]
        else:
            rest = sorted(((t, v) for t, v in zip(ids, vals) if t != tid), key=lambda e: -e[1])
            ids, vals = [t for t, _ in rest], [v for _, v in rest]
        ids, vals = _head(tid, lp, ids, vals, k, None)
        sampled.append(lp)
        head_ids.append(ids)
        head_lps.append(vals)
    return sampled, head_ids, head_lps


def _chat_entries(tops: list) -> list[tuple[int, float]]:
    """(id, logprob) of a chat position's top entries, checked entry by entry (the first bad one
    raises); the canonical ``token_id:<id>`` strings are remembered for ``parse_chat_logprobs``."""
    entries = [(parse_token_id(e["token"]), float(e["logprob"])) for e in tops]
    if len(_TOKEN_IDS) > _TOKEN_IDS_MAX:
        _TOKEN_IDS.clear()
    for e, (t, _) in zip(tops, entries):
        if e["token"] == token_id_string(t):
            _TOKEN_IDS[e["token"]] = t
    return entries


def head_support_complete(top_k: int, k: int, head_lps: Iterable[Sequence[float]]) -> bool:
    """Whether the recorded heads hold the whole sampling support at every position.

    True when top-k sampling is on with ``top_k <= k`` (vLLM keeps exactly the top_k tokens; only
    exact logit ties at the threshold could add more), otherwise position by position: the head
    holds a floored (-9999, i.e. -inf) entry, so the support is smaller than the head, or the head's
    probabilities sum to at least ``1 - 1e-6`` (a tail below that is taken as empty). The local
    engine decides from the full distribution (support size <= k); the two agree except for such
    ties and tails.
    """
    if 0 < int(top_k) <= int(k):
        return True
    for row in head_lps:
        if any(v <= LOGPROB_FLOOR for v in row):
            continue
        if sum(math.exp(v) for v in row) >= 1.0 - COMPLETE_MASS_TOL:
            continue
        return False
    return True


