"""What a client asked for, and whether its call can be recorded at all."""

from __future__ import annotations

from dataclasses import dataclass

from prodrl_pipelines.engines.openai_protocol import EXTRA_DRAW_FIELD


GREEDY_EPS = 1e-5

# ----------------------------------------------------------------------------- request analysis


@dataclass
class Ask:
    """What the client asked for (so the recorder can strip what it added)."""

    token_ids: bool
    n: int | None  # logprobs / top_logprobs asked for; None: no logprobs
    as_ids: bool
    prompt_text: bool
    extra: bool = False  # the prodrl extension ``extra_draw``


class Unrecordable(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def is_json_int(x) -> bool:
    """An integer from parsed JSON: an int that is not a bool (``true`` parses to ``True``, an int)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_json_number(x) -> bool:
    """A number from parsed JSON: an int or float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def client_ask(body: dict, kind: str) -> Ask:
    if kind == "completion":
        n = body.get("logprobs")
        n = int(n) if is_json_int(n) else None
    elif body.get("logprobs"):
        t = body.get("top_logprobs") or 0
        n = int(t) if is_json_int(t) else 0
    else:
        n = None
    return Ask(bool(body.get("return_token_ids")), n, bool(body.get("return_tokens_as_token_ids")),
               bool(body.get("return_prompt_text")), bool(body.get(EXTRA_DRAW_FIELD)))


_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0}
_UNSUPPORTED = ("logit_bias", "allowed_token_ids", "bad_words", "structured_outputs", "guided_json",
                "guided_regex", "guided_choice", "guided_grammar", "logprob_token_ids", "prompt_embeds",
                "logits_processors", "vllm_xargs")


def unrecordable_reason(body: dict, kind: str) -> str | None:
    """Why a request cannot give a trainable record (None: it can)."""
    for name, typ in (("temperature", is_json_number), ("top_p", is_json_number), ("top_k", is_json_int),
                      ("n", is_json_int)):
        if body.get(name) is not None and not typ(body[name]):
            return "invalid_request"
    if body.get("top_k") is not None and not -1 <= body["top_k"] < 2**31:  # the record's top_k is an int32
        return "invalid_request"
    if kind == "completion":
        if body.get("logprobs") is not None and not is_json_int(body["logprobs"]):
            return "invalid_request"
        p = body.get("prompt")
        if isinstance(p, list) and p and not all(is_json_int(x) for x in p):
            if len(p) != 1:
                return "multiple_prompts"
        elif not isinstance(p, (str, list)):
            return "invalid_request"
        if body.get("echo"):
            return "echo"
        if (body.get("best_of") or 1) != 1:
            return "best_of"
    else:
        if not isinstance(body.get("messages"), list):
            return "invalid_request"
        if body.get("top_logprobs") is not None and not is_json_int(body["top_logprobs"]):
            return "invalid_request"
        rf = body.get("response_format")
        if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
            return "unsupported:response_format"
    if (body.get("n") or 1) != 1:
        return "n>1"
    if body.get("use_beam_search"):
        return "beam_search"
    if body.get("temperature") is not None and body["temperature"] < GREEDY_EPS:
        return "greedy"
    for name, neutral in _NEUTRAL.items():
        v = body.get(name)
        if v is not None and (not is_json_number(v) or float(v) != neutral):
            return f"unsupported:{name}"
    for name in _UNSUPPORTED:
        if body.get(name):
            return f"unsupported:{name}"
    return None
