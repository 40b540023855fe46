"""A streamed call relayed whatever the pieces the upstream's stream arrives in, and the lean parse of
chat chunks whose logprobs the client does not get (their ``bytes`` cut before the parse)."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from prodrl_pipelines.engines.openai_protocol import chat_logprobs
from prodrl_pipelines.recorder.streaming import _without_logprob_bytes
from tests.test_recorder import serving, start_recorder, upstream  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHAT = {"messages": [{"role": "user", "content": "9+1="}], "max_tokens": 7, "seed": 4, "temperature": 1.0,
        "stream": True, "stream_options": {"include_usage": True}}
# what the recorder adds to a chat request (``Recorder.force``), so the replayed stream is what it gets
FORCED = {"return_token_ids": True, "return_tokens_as_token_ids": True, "logprobs": True, "top_logprobs": 20,
          "return_prompt_text": True, "top_p": 1.0, "top_k": -1}


class Replay:
    """An upstream that answers every chat call with one recorded stream, cut into pieces by ``split``."""

    def __init__(self, raw: bytes) -> None:
        self.raw, self.split = raw, "events"
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    def pieces(self) -> list[bytes]:
        if self.split == "events":
            return [e + b"\n\n" for e in self.raw.split(b"\n\n") if e]
        if self.split == "whole":
            return [self.raw]
        rng, out, i = random.Random(self.split), [], 0
        while i < len(self.raw):  # pieces of 1-700 bytes: lines and UTF-8 characters cut anywhere
            n = rng.randint(1, 700)
            out.append(self.raw[i:i + n])
            i += n
        return out

    async def chat(self, request: Request):
        await request.body()

        async def gen():
            for p in self.pieces():
                yield p

        return StreamingResponse(gen(), media_type="text/event-stream")


def _stream(rec, body: dict, tid: str) -> bytes:
    with rec.http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Trajectory-Id": tid}) as r:
        assert r.status_code == 200
        return r.read()


@pytest.fixture
def replay(upstream):
    raw = httpx.post(upstream.url + "/v1/chat/completions", json={**CHAT, **FORCED}, timeout=60).content
    assert raw.endswith(b"data: [DONE]\n\n") and b'"bytes":[' in raw
    # a content delta of multi-byte characters (pieces cut inside them) and a last line without a newline
    extra = json.dumps({"choices": [{"index": 0, "delta": {"content": "é€😀"}}]}, ensure_ascii=False).encode()
    raw = raw.replace(b"data: [DONE]\n\n", b"data: " + extra + b"\r\n\r\n: a comment\n\ndata: [DONE]")
    yield from serving(Replay(raw))


RECORDED = ("prompt_token_ids", "output_token_ids", "output_logprobs", "top_token_ids", "top_logprobs",
            "support_complete", "prompt_text", "output_text")


def test_a_stream_in_any_pieces_is_relayed_and_recorded_the_same(replay, start_recorder):
    rec = start_recorder(replay.url)
    splits = ["events", "whole", "a", "b", "c"]
    for body in (CHAT, {**CHAT, "logprobs": True, "top_logprobs": 2}):
        answers = {}
        for s in splits:
            replay.split = s
            answers[s] = _stream(rec, body, f"t-{s}")
        first = answers["events"]
        assert json.dumps("é€😀") in first.decode()  # re-encoded as the chunks are
        assert (b'"bytes":[' in first) == ("logprobs" in body)  # relayed only when asked for
        for s in splits:  # the same bytes, up to the trajectory id in the closing comment
            assert answers[s].replace(f"t-{s}".encode(), b"t") == first.replace(b"t-events", b"t"), s
    rows = rec.store().read_calls().to_pylist()
    assert len(rows) == 2 * len(splits)
    assert all({k: r[k] for k in RECORDED} == {k: rows[0][k] for k in RECORDED} for r in rows)
    assert rows[0]["output_text"].endswith("é€😀") and len(rows[0]["output_token_ids"]) == 7


def _strip_bytes(obj):
    if isinstance(obj, dict):
        return {k: _strip_bytes(v) for k, v in obj.items() if k != "bytes"}
    if isinstance(obj, list):
        return [_strip_bytes(v) for v in obj]
    return obj


def test_the_lean_parse_is_the_chunk_less_its_logprob_bytes():
    odd = ',"bytes":[1,2]},"top_logprobs":[{"bytes":[3]}'  # a token string that looks like the members cut
    strs = {7: "token_id:7", 8: odd, 9: "é"}
    lp = chat_logprobs([7, 9, 8], [[(7, -0.5), (8, -1.0), (9, -2.0)], [(9, -0.1)], [(8, -0.2), (7, -3.0)]], 3,
                       lambda t: strs[t], lambda t: strs[t])
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": odd}, "logprobs": lp, "finish_reason": None,
                                     "token_ids": [7, 9, 8]}], "usage": None, "prompt_text": odd}
    for ensure_ascii in (True, False):
        payload = json.dumps(chunk, separators=(",", ":"), ensure_ascii=ensure_ascii)
        lean = json.loads(_without_logprob_bytes(payload))
        assert lean == _strip_bytes(chunk) and lean != chunk
        assert lean["choices"][0]["delta"]["content"] == odd and lean["prompt_text"] == odd
    # no logprobs, or not vLLM's layout (spaces, a bytes member elsewhere): the text is left as it is
    for text in (json.dumps({"choices": [{"delta": {"content": odd}}], "bytes": [1]}, separators=(",", ":")),
                 json.dumps(chunk)):
        assert _without_logprob_bytes(text) == text
