"""A streamed call through the recorder: the upstream's SSE relayed (rewritten) chunk by chunk,
accumulated into the record, committed before the stream ends; a cut or malformed stream ends with an
error event and is a failed call. Chat streams can be re-shaped as Responses events."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
from starlette.responses import Response, StreamingResponse

from prodrl_pipelines.engines.openai_protocol import SSE_DONE, error_body, sse
from prodrl_pipelines.config.preflight import redact
from prodrl_pipelines.recorder.answers import Rewriter, StreamAccumulator
from prodrl_pipelines.recorder.calls import UPSTREAM_SHAPE_ERRORS, Caller, n_up, upstream_error, upstream_unavailable
from prodrl_pipelines.recorder.requests import Unrecordable
from prodrl_pipelines.recorder.service import Recorder

# A chat chunk's logprob entries each carry ``bytes``, the token's UTF-8 as a list of integers: about
# half the chunk, and neither the record nor an answer without logprobs reads it. When the client's
# answer drops the logprobs it is cut from the chunk's text before the parse: the members
# ``"bytes":[<digits and commas>]`` that end an entry or precede its ``top_logprobs`` (vLLM's layout),
# from the chunk's logprobs on. Outside a JSON string a ``,"`` starts a key or an array element, and a
# ``":`` after it makes it a key, so in a well-formed chunk only these members of the logprob entries
# match: the parse is the chunk's, less them.
_CHAT_LOGPROBS = '"logprobs":{"content":['
_LOGPROB_BYTES = re.compile(r',"bytes":\[[0-9,]*\](?=\}|,"top_logprobs":)')


_SSE_JSON = json.JSONEncoder(separators=(",", ":"))  # ``sse``'s encoding, without a new encoder per chunk


def _sse(obj) -> bytes:
    """``openai_protocol.sse(obj)``."""
    return b"data: " + _SSE_JSON.encode(obj).encode() + b"\n\n"


def _without_logprob_bytes(payload: str) -> str:
    at = payload.find(_CHAT_LOGPROBS)
    return payload if at < 0 else payload[:at] + _LOGPROB_BYTES.sub("", payload[at:])


async def proxy_stream(rec: Recorder, kind, path, up, ask, reason, caller: Caller, pv, task_id,
                        shape=None) -> Response:
    stats = rec.stats
    headers = {"X-Trajectory-Id": caller.client_tid}
    commit_args = (caller.attempt, caller.tenant.name)
    assert rec.http is not None
    try:
        resp, replica = await rec.post_upstream(path.lstrip("/"), up, caller.tid, rec.stream_timeout)
    except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
        return upstream_unavailable(exc, stats, headers)
    if resp.status != 200:
        try:
            content = await resp.read()
        finally:
            resp.release()
            rec.finished(replica)
        return upstream_error(resp.status, content, resp.headers.get("content-type"), headers, stats)
    rewriter = Rewriter(kind, ask, rec.tokens, stats, n_up(up, kind)) if reason is None else None
    acc = StreamAccumulator(kind)
    # the client's answer drops the logprobs (not asked for): their bytes need no parsing
    lean = kind == "chat" and rewriter is not None and ask.n is None

    def failed(message: str, code: int) -> list[bytes]:
        """The events that end a failed stream: an error event, then the end of the stream."""
        if shape is not None:  # a Responses stream has no [DONE]
            return [shape.error_event(message, code)]
        return [sse(error_body(message, code)), SSE_DONE]

    async def events():
        done, bad = False, ""
        if shape is not None:
            for ev in shape.start_events():
                yield ev
        try:
            # Whatever the upstream has sent is read at once and relayed as one write: the same bytes as
            # relaying each event on its own, with one send per read instead of one per event (a
            # recorder behind a busy upstream gets several events per read).
            reader, pending, eof = resp.content, [], False  # pending: the start of a line not yet ended
            while not (done or bad or eof):
                data = await reader.readany()
                if data:
                    pending.append(data)
                    if b"\n" not in data:
                        continue
                    lines = b"".join(pending).split(b"\n")
                    last = lines.pop()
                    pending = [last] if last else []
                else:  # the end of the stream: its last line, if it has no newline
                    eof, lines = True, [b"".join(pending)] if pending else []
                out: list[bytes] = []
                for raw in lines:
                    line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        done = True
                        break
                    try:
                        chunk = json.loads(_without_logprob_bytes(payload) if lean else payload)
                    except ValueError:
                        if shape is None:
                            out.append((line + "\n\n").encode())
                        continue
                    try:
                        acc.add(chunk)
                        rewritten = rewriter.rewrite(chunk) if rewriter is not None else chunk
                        pieces = list(shape.chunk_events(rewritten)) if shape is not None else [_sse(rewritten)]
                    except UPSTREAM_SHAPE_ERRORS as exc:
                        bad = f"the upstream server's stream is malformed ({type(exc).__name__}: {exc})"
                        break
                    out.extend(pieces)
                if out:
                    yield b"".join(out)
        except asyncio.TimeoutError:
            stats.inc("upstream_timeouts")
            for piece in failed("the upstream server timed out", 504):
                yield piece
            return
        except aiohttp.ClientError as exc:
            stats.inc("upstream_unreachable")
            for piece in failed(f"the upstream stream failed: {redact(str(exc))}", 502):
                yield piece
            return
        except (asyncio.CancelledError, GeneratorExit):  # the client went away mid-stream: nothing is appended
            stats.inc("client_disconnected")
            raise
        finally:
            resp.close()
            rec.finished(replica)
        if bad or not done or acc.error is not None:  # the upstream failed mid-stream: a failed call
            why = ("upstream_bad_stream" if bad else "upstream_error" if acc.error is not None
                   else "upstream_stream_cut")
            stats.inc("upstream_errors")
            try:  # the client sees a call fail: it takes its index, stored as a failed (skipped) call
                await rec.commit(caller.tid, None, why, *commit_args)
            except Exception:  # noqa: BLE001 - the error event tells the client
                stats.inc("commit_failures")
            message = bad or "the upstream stream ended before [DONE]: the answer is incomplete"
            if acc.error is not None:  # the upstream's own error event: relayed already on a chat stream
                if shape is None:
                    yield SSE_DONE
                    return
                message = str(acc.error.get("message") if isinstance(acc.error, dict) else acc.error)
            for piece in failed(message, 502):
                yield piece
            return
        row, why = None, reason
        if why is None:
            if acc.extra_choices:
                why = "n>1"
            else:
                try:
                    row = rec.build_row(kind, acc.answer(), up, pv, task_id)
                except Unrecordable as u:
                    why = u.reason
        try:
            index = await rec.commit(caller.tid, row, why, *commit_args)
        except Exception as exc:
            stats.inc("commit_failures")
            for piece in failed(f"the call could not be recorded durably: {exc}", 503):
                yield piece
            return
        note = f": prodrl trajectory_id={caller.client_tid} call_index={index} recorded={'true' if row else 'false'}\n\n".encode()
        if shape is not None:
            yield note
            usage = shape.usage(acc.prompt_ids, acc.ids if acc.have_ids else None, None)
            for ev in shape.end_events(acc.finish, usage):
                yield ev
            return
        yield note + SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
