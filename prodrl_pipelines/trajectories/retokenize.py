"""The retokenized baseline (DESIGN.md s.5, lab only): rebuild each call's token ids from its texts.

A naive pipeline does not keep the ids the engine consumed and sampled; it keeps the conversation as
text and re-renders it for training. ``retokenize_calls`` does exactly that for every call of a
round's dataset, so a round can be trained both ways and the difference measured:

* prompt: the conversation is reconstructed from the recorded texts -- the messages are read off the
  call's ``prompt_text`` (ChatML, the format of Qwen and the lab: ``<|im_start|>role\\ncontent<|im_end|>\\n``),
  each earlier assistant message taking the recorded ``output_text`` of the trajectory's earlier calls
  (what the naive pipeline got back and stored) -- then re-rendered with the tokenizer's chat template
  (``add_generation_prompt`` when the prompt ended with one) and tokenized;
* output: ``tokenizer.encode(output_text) + [eos]`` -- the naive pipeline appends eos even where the
  engine stopped on another token or was cut off by ``max_tokens``.

With a ``parse_reply`` (``engines.reply_parsers``: the deployment's reasoning and tool-call parsers)
the naive pipeline keeps what the API returned, not the text: every assistant message, earlier ones
in the prompt and the call's own output, is the parsed message (reasoning, content, tool calls with
server-serialised arguments), and the output is that message rendered by the chat template as the
conversation's last turn -- the structured-JSON trace run through the chat processor.

Wherever the recorded ids were not the canonical tokenization of their text (the model sampled
``t`` ``hen`` instead of ``then``, the server fed the sampled ids back rather than re-rendered text,
the template rewrites history, a different stop token...) the rebuilt ids differ.

**Behaviour logprobs.** A naive pipeline has no valid log mu for retokenized tokens: mu was recorded
for the sampled ids. Where a call's rebuilt output has the same length as the recorded one, the
recorded logprob (and top-K head, extra draw) at the same position is used, as a naive pipeline that
stored per-position logprobs would. Otherwise every position gets log mu = the mean recorded
logprob of the call, the head becomes the token itself with that value (``support_complete`` false),
the extra draw is dropped, and the call is flagged in the boolean column ``FILLED_COLUMN``. When
such a call was sampled from a restricted support (top-k below the vocabulary, or top-p < 1), it is
not trained on (``UNTRAINED_COLUMN``, counted as ``untrained``): its support is unknown, and the
one-token head would make S = {a}, pi_S(a) = 1, so every IS correction gave it an exactly zero
gradient without saying so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa

from prodrl_pipelines.engines.reply_parsers import ReplyParser
from prodrl_pipelines.trajectories.schema import UNTRAINED_COLUMN

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
FILLED_COLUMN = "retokenized_logprobs_filled"

# (prompt_text, earlier assistant texts) -> (messages, ends with the generation prompt) or None
MessageParser = Callable[[str, Sequence[str]], "tuple[list[dict], bool] | None"]


@dataclass
class RetokenizeStats:
    """How far the naive rebuild is from the recorded ids (counts of calls unless named otherwise)."""

    calls: int = 0
    prompt_ids_differ: int = 0
    output_ids_differ: int = 0
    calls_differ: int = 0  # prompt or output
    multi_turn_calls: int = 0  # calls after the first of their trajectory (their prompt holds history)
    multi_turn_calls_differ: int = 0
    tokens_differ: int = 0  # summed over calls: ``differing_tokens`` of prompt and of output
    trajectories_differ: int = 0
    logprobs_filled: int = 0  # output length changed: no per-position log mu (filled with the call's mean)
    untrained: int = 0  # ... of those, sampled from a restricted support: left out of the objective
    prompt_unparsed: int = 0  # prompt text not in the parser's format: tokenized as plain text
    generated_tokens_recorded: int = 0
    generated_tokens_retokenized: int = 0

    def as_dict(self, prefix: str = "retokenized_") -> dict[str, int]:
        return {f"{prefix}{k}": int(v) for k, v in asdict(self).items()}

    @property
    def tokens_per_differing_call(self) -> float:
        """Mean number of differing tokens (prompt and output) per call whose ids differ."""
        return self.tokens_differ / self.calls_differ if self.calls_differ else 0.0


def differing_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens differ between two id sequences: what is left of the longer one once their
    common prefix and common suffix are taken away (0 when equal)."""
    n = min(len(a), len(b))
    head = 0
    while head < n and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < n - head and a[len(a) - 1 - tail] == b[len(b) - 1 - tail]:
        tail += 1
    return max(len(a), len(b)) - head - tail


def parse_chatml(prompt_text: str, assistant_texts: Sequence[str] = ()) -> tuple[list[dict], bool] | None:
    """Messages of a ChatML prompt, and whether it ends with the generation prompt ``<|im_start|>assistant\\n``.

    The j-th assistant message takes ``assistant_texts[j]`` when given (the naive pipeline's stored
    reply); where the rendered text holds exactly that reply, its end is found by length, so replies
    that themselves contain ChatML markers are read correctly. Returns ``None`` when the text is not
    ChatML.
    """
    messages: list[dict] = []
    pos, n_assistant, n = 0, 0, len(prompt_text)
    while pos < n:
        if not prompt_text.startswith(IM_START, pos):
            return None
        eol = prompt_text.find("\n", pos)
        if eol < 0:
            return None
        role = prompt_text[pos + len(IM_START):eol]
        start = eol + 1
        if role == "assistant" and start == n:
            return messages, True
        known = assistant_texts[n_assistant] if role == "assistant" and n_assistant < len(assistant_texts) else None
        if known is not None and prompt_text.startswith(known + IM_END, start):
            end = start + len(known)
        else:
            end = prompt_text.find(IM_END, start)
            if end < 0:
                return None
        content = prompt_text[start:end]
        if role == "assistant":
            content = known if known is not None else content
            n_assistant += 1
        messages.append({"role": role, "content": content})
        pos = end + len(IM_END)
        if prompt_text.startswith("\n", pos):
            pos += 1
    return messages, False


def _column(table: pa.Table, name: str) -> list | None:
    return table.column(name).to_pylist() if name in table.column_names else None


def _set_column(table: pa.Table, name: str, values: list, dtype: pa.DataType) -> pa.Table:
    arr = pa.array(values, type=dtype)
    if name in table.column_names:
        i = table.column_names.index(name)
        return table.set_column(i, table.schema.field(i).with_type(dtype), arr)
    return table.append_column(pa.field(name, dtype), arr)


def render_reply(tokenizer, messages: list[dict], reply: dict) -> str | None:
    """The text the chat template gives ``reply`` as the turn after ``messages``: what follows the
    generation prompt, without the closing ``<|im_end|>``. None when rendering the reply changes the
    text before it (a template that is not prefix-stable there)."""
    head = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(messages + [reply], tokenize=False)
    if not full.startswith(head):
        return None
    body = full[len(head):]
    end = body.rfind(IM_END)
    return body[:end] if end >= 0 else body


def retokenize_calls(
    table: pa.Table, tokenizer, *, parse_messages: MessageParser = parse_chatml,
    parse_reply: ReplyParser | None = None,
) -> tuple[pa.Table, RetokenizeStats]:
    """The table with every call's ids rebuilt from its texts (module docstring), and the counts.

    Needs the columns trajectory_id, call_index, prompt_text, output_text, prompt_token_ids,
    output_token_ids, output_logprobs; top_token_ids/top_logprobs/support_complete/extra_token_ids
    are adjusted when present. Row order and column types are kept; ``FILLED_COLUMN`` and
    ``UNTRAINED_COLUMN`` are added (top_k / top_p read when present, else unrestricted).
    Raises ``ValueError`` naming the call when its prompt or output text is missing.
    """
    need = ["trajectory_id", "call_index", "prompt_text", "output_text", "prompt_token_ids",
            "output_token_ids", "output_logprobs"]
    missing = [c for c in need if c not in table.column_names]
    if missing:
        raise ValueError(f"retokenize_calls: the table lacks column(s) {missing}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("retokenize_calls: the tokenizer has no eos token")
    cols = {c: _column(table, c) for c in need}
    top_ids, top_lps = _column(table, "top_token_ids"), _column(table, "top_logprobs")
    complete, extra = _column(table, "support_complete"), _column(table, "extra_token_ids")
    cols["top_k"] = _column(table, "top_k") or [0] * table.num_rows
    cols["top_p"] = _column(table, "top_p") or [1.0] * table.num_rows
    vocab_size = len(tokenizer)

    n = table.num_rows
    new_prompt: list = list(cols["prompt_token_ids"])
    new_out: list = list(cols["output_token_ids"])
    new_lps: list = list(cols["output_logprobs"])
    filled = [False] * n
    untrained = [False] * n
    stats = RetokenizeStats(calls=n)
    differs_by_traj: dict[str, bool] = {}

    def encode(text: str) -> list[int]:
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

    by_traj: dict[str, list[int]] = {}
    for r in range(n):
        by_traj.setdefault(cols["trajectory_id"][r], []).append(r)
    for tid, rows in by_traj.items():
        rows.sort(key=lambda r: cols["call_index"][r])
        earlier: list[str] = []
        for r in rows:
            ptext, otext = cols["prompt_text"][r], cols["output_text"][r]
            if ptext is None or otext is None:
                raise ValueError(f"retokenize_calls: call {tid}#{cols['call_index'][r]} has no prompt_text/output_text; "
                                 "the retokenized baseline rebuilds ids from the texts")
            parsed = parse_messages(ptext, earlier)
            messages = None
            if parsed is None:
                stats.prompt_unparsed += 1
                prompt_ids = encode(ptext)
            else:
                messages, gen = parsed
                if parse_reply is not None:
                    messages = [parse_reply(m["content"]) if m["role"] == "assistant" else m for m in messages]
                rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
                prompt_ids = encode(rendered)
            body = otext
            if parse_reply is not None and messages is not None:
                body = render_reply(tokenizer, messages, parse_reply(otext))
                body = otext if body is None else body
            out_ids = encode(body) + [int(eos)]
            earlier.append(otext)

            rec_prompt = [int(t) for t in (cols["prompt_token_ids"][r] or [])]
            rec_out = [int(t) for t in (cols["output_token_ids"][r] or [])]
            rec_lps = [float(x) for x in (cols["output_logprobs"][r] or [])]
            p_diff, o_diff = prompt_ids != rec_prompt, out_ids != rec_out
            stats.prompt_ids_differ += p_diff
            stats.output_ids_differ += o_diff
            stats.calls_differ += p_diff or o_diff
            stats.tokens_differ += differing_tokens(prompt_ids, rec_prompt) + differing_tokens(out_ids, rec_out)
            if len(earlier) > 1:  # the call's own output was appended above: an earlier call exists
                stats.multi_turn_calls += 1
                stats.multi_turn_calls_differ += p_diff or o_diff
            differs_by_traj[tid] = differs_by_traj.get(tid, False) or p_diff or o_diff
            stats.generated_tokens_recorded += len(rec_out)
            stats.generated_tokens_retokenized += len(out_ids)
            new_prompt[r], new_out[r] = prompt_ids, out_ids
            if len(out_ids) != len(rec_out):
                fill = float(np.mean(rec_lps)) if rec_lps else 0.0
                new_lps[r] = [fill] * len(out_ids)
                filled[r] = True
                stats.logprobs_filled += 1
                if top_ids is not None:
                    top_ids[r] = [[t] for t in out_ids]
                if top_lps is not None:
                    top_lps[r] = [[fill] for _ in out_ids]
                if complete is not None:
                    complete[r] = False
                if extra is not None:
                    extra[r] = None
                top_k, top_p = int(cols["top_k"][r] or 0), float(cols["top_p"][r] or 1.0)
                if 0 < top_k < vocab_size or top_p < 1.0:
                    untrained[r] = True
                    stats.untrained += 1
    stats.trajectories_differ = sum(differs_by_traj.values())

    out = table
    sch = table.schema
    out = _set_column(out, "prompt_token_ids", new_prompt, sch.field("prompt_token_ids").type)
    out = _set_column(out, "output_token_ids", new_out, sch.field("output_token_ids").type)
    out = _set_column(out, "output_logprobs", new_lps, sch.field("output_logprobs").type)
    for name, values in (("top_token_ids", top_ids), ("top_logprobs", top_lps), ("support_complete", complete),
                         ("extra_token_ids", extra)):
        if values is not None:
            out = _set_column(out, name, values, sch.field(name).type)
    out = _set_column(out, FILLED_COLUMN, filled, pa.bool_())
    out = _set_column(out, UNTRAINED_COLUMN, untrained, pa.bool_())
    return out, stats
