"""Supervised warm start of the lab policy and the base-checkpoint builder.

The warm start trains on chat transcripts with the loss on assistant tokens only (the answer digits
and the closing ``<|im_end|>``), tokenized exactly as the serving path renders prompts. The base
policy should succeed often enough for RL to get signal and fail often enough for RL to have room
(held-out reward roughly 0.25-0.55 at temperature 1).

Why a "sloppy demonstrator" for the demo: on this ~130k-parameter model, REINFORCE improves the
arithmetic itself only slowly (the policy gradient is consistent across batches, but the reward is
sharply curved along it, so steps above lr ~1e-4 undo more than they gain). A format habit, by
contrast, is one context-independent decision that RL fixes quickly and reliably. So 40% of the
demonstrated answers are written ``=12`` (rejected by the verifier); the base policy copies the habit
at temperature 1 and RL removes it round after round, while the arithmetic improves a little too.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from prodrl_pipelines.evaluation.episodes import render_prompt
from prodrl_pipelines.lab.model import build_model, lab_model_config
from prodrl_pipelines.lab.tasks import ARITHMETIC, TaskEnv, get_task
from prodrl_pipelines.lab.tokenizer import IM_END, IM_START, build_tokenizer

IGNORE_INDEX = -100

# Tuned defaults per size: SFT steps, batch size, peak lr, number of distinct training tasks, and
# the sloppy-demonstrator rates (see ``arithmetic.noisy_messages``). For "demo", 40% of the
# demonstrated answers are written "=12": the base policy copies that habit at temperature 1, which
# the verifier rejects, so RL has a clean, learnable signal on top of the (slower) arithmetic gains.
SFT_DEFAULTS: dict[str, dict] = {
    "tiny": dict(steps=20, batch_size=16, lr=3e-3, n_tasks=512, answer_noise=0.0, format_noise=0.0),
    "demo": dict(steps=500, batch_size=64, lr=1e-2, n_tasks=20000, answer_noise=0.0, format_noise=0.4),
}
SFT_DEFAULTS.update({f"{k}-dense": v for k, v in list(SFT_DEFAULTS.items())})


class _Encoder:
    """Tokenizes conversations piecewise, identical to rendering the chat template and tokenizing."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.im_start = int(tokenizer.convert_tokens_to_ids(IM_START))
        self.im_end = int(tokenizer.convert_tokens_to_ids(IM_END))
        self.nl = self._enc("\n")
        self._role = {}

    def _enc(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def header(self, role: str) -> list[int]:
        if role not in self._role:
            self._role[role] = [self.im_start] + self._enc(role) + self.nl
        return self._role[role]

    def encode(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """``(input_ids, labels)`` with labels = ids on assistant content + ``<|im_end|>``, else ignored."""
        ids: list[int] = []
        labels: list[int] = []
        for m in messages:
            head = self.header(m["role"])
            body = self._enc(m["content"]) + [self.im_end]
            ids += head + body + self.nl
            if m["role"] == "assistant":
                labels += [IGNORE_INDEX] * len(head) + body + [IGNORE_INDEX] * len(self.nl)
            else:
                labels += [IGNORE_INDEX] * (len(head) + len(body) + len(self.nl))
        return ids, labels


class _CallEncoder:
    """One example per model call, rendered as the server renders it: the chat template applied to
    the history the harness keeps (earlier replies as the server parsed them), then the reply's own
    text and ``<|im_end|>`` as the labels. For templates that rewrite history (production text).
    A demonstrated reply with ``echo_reasoning: False`` stays in the history without its reasoning
    (a client that does not send it back); one with ``extends: True`` is prompted as a recorder in
    ``chat_history: extend`` mode serves it: the previous example's ids, then the messages since
    rendered alone (the bridge; right for templates that render each message from its neighbours
    among them, as the lab's do)."""

    def __init__(self, tokenizer, env: TaskEnv) -> None:
        from prodrl_pipelines.engines.reply_parsers import get_reply_parser

        self.tok, self.env, self.parse = tokenizer, env, get_reply_parser(env.reply_parser)
        self.im_end = int(tokenizer.convert_tokens_to_ids(IM_END))

    def encode_calls(self, messages: list[dict]) -> list[tuple[list[int], list[int]]]:
        out, history, since = [], [], []
        for m in messages:
            if m["role"] == "assistant":
                if m.get("extends") and out:
                    bridge, _ = render_prompt(self.tok, since)
                    prompt = out[-1][0] + list(self.tok.encode("\n" + bridge, add_special_tokens=False))
                else:
                    _, prompt = render_prompt(self.tok, history, self.env.tools)
                since = []
                body = list(self.tok.encode(m["content"], add_special_tokens=False)) + [self.im_end]
                out.append((prompt + body, [IGNORE_INDEX] * len(prompt) + body))
                msg = self.parse(m["content"])
                if m.get("echo_reasoning") is False:
                    msg.pop("reasoning_content", None)
                history.append(msg)
            else:
                history.append(m)
                since.append(m)
        return out


def _transcript_encoder(tokenizer, env: TaskEnv):
    """transcript -> its supervised examples: one per call for a task whose server parses replies
    (its template rewrites history), else the whole transcript as one."""
    if env.reply_parser != "none":
        return _CallEncoder(tokenizer, env).encode_calls
    enc = _Encoder(tokenizer)
    return lambda messages: [enc.encode(messages)]


def sft_example(tokenizer, task, env: TaskEnv = ARITHMETIC) -> tuple[list[int], list[int]]:
    """The supervised example of one task: its correct transcript and the assistant-token labels
    (for a task in production text, the example of its last call)."""
    return _transcript_encoder(tokenizer, env)(env.reference_messages(task))[-1]


def _collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    n = len(examples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    for i, (ids, lab) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attn[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attn}


def _lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def warm_start(
    model: torch.nn.Module,
    tokenizer,
    tasks: list,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    *,
    answer_noise: float = 0.0,
    format_noise: float = 0.0,
    progress: bool = True,
    env: TaskEnv = ARITHMETIC,
    **noise: float,
) -> dict:
    """Supervised fine-tuning on correct transcripts of ``tasks``, loss on assistant tokens only.

    AdamW (weight decay 0.01), linear warmup + cosine decay to 10% of ``lr``, grad-norm clip 1.0;
    each step draws ``batch_size`` tasks from ``tasks`` with an RNG seeded by ``seed``. Transcripts
    come from ``env.noisy_messages`` (exact when the noise rates are 0; ``noise``: the task's own
    further rates). A task in production text trains one example per call (``_CallEncoder``). Returns metrics
    (``loss_first``, ``loss_last`` averaged over the last 10 steps, ``seconds``, ``tokens``).
    """
    rng = random.Random(f"warm_start:{seed}")
    encode = _transcript_encoder(tokenizer, env)
    examples = [ex for t in tasks for ex in encode(env.noisy_messages(t, rng, answer_noise, format_noise, **noise))]
    pad_id = int(tokenizer.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, min(20, steps // 10))
    model.train()
    losses: list[float] = []
    n_tokens = 0
    t0 = time.perf_counter()
    bar = tqdm(range(steps), desc="warm start (SFT)", disable=not progress, leave=False)
    for step in bar:
        batch = _collate([examples[rng.randrange(len(examples))] for _ in range(batch_size)], pad_id)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, steps, lr, warmup)
        out = model(**batch, use_cache=False)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        n_tokens += int(batch["attention_mask"].sum())
        if step % 10 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    tail = losses[-10:] if losses else [float("nan")]
    return {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "loss_first": losses[0] if losses else float("nan"),
        "loss_last": sum(tail) / len(tail),
        "seconds": time.perf_counter() - t0,
        "tokens": n_tokens,
    }


def build_base_policy(
    out_dir: str | Path,
    size: str = "demo",
    seed: int = 0,
    sft_steps: int | None = None,
    *,
    progress: bool = True,
    num_threads: int | None = 1,
    task: str | TaskEnv = "arithmetic",
    hedge_noise: float = 0.0,
    sft: dict | None = None,
) -> Path:
    """Build the lab tokenizer and model of ``task``, warm-start it, save an HF checkpoint directory.

    The task (``tasks.get_task``) supplies the tokenizer corpus, the demonstrations and its own
    overrides of ``SFT_DEFAULTS``; "arithmetic" builds exactly the policy the lab always built.
    ``sft`` overrides the warm start last: any ``SFT_DEFAULTS`` key (``steps``, ``batch_size``, ``lr``,
    ``n_tasks``), the demonstrator's ``*_noise`` rates, and the task's demonstration options
    (``TaskEnv.demo_options``, e.g. ``{"agent_loop": True}`` for ``arithmetic_tools``); ``sft_steps``,
    when given, wins over ``sft["steps"]``.

    The directory holds ``config.json``, ``model.safetensors``, ``generation_config.json``, the
    tokenizer files (with the chat template) and ``warm_start.json`` (the SFT metrics). Deterministic
    given ``seed`` (same seed -> identical weights).

    ``num_threads`` temporarily sets torch's intra-op threads for the build (restored after). One
    thread is the default: this model's ops are tiny, and on a shared 2-core machine two OpenMP
    threads measured 2-7x slower per step than one under contention (and barely faster when idle).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = get_task(task)
    if size not in SFT_DEFAULTS:
        raise ValueError(f"unknown lab size {size!r}; choose one of {sorted(SFT_DEFAULTS)}")
    cfg = {**SFT_DEFAULTS[size], **env.sft.get(size, {}), **(sft or {})}
    unknown = sorted(k for k in (sft or {}) if k not in SFT_DEFAULTS[size] and not k.endswith("_noise")
                     and k not in env.demo_options)
    if unknown:
        raise ValueError(f"unknown sft override(s) {', '.join(unknown)}: valid are {', '.join(SFT_DEFAULTS[size])}, "
                         f"*_noise rates and the task's demonstration options ({', '.join(env.demo_options) or 'none'})")
    options = {k: cfg.pop(k) for k in env.demo_options if k in cfg}
    env = env.with_demo_options(**options)
    if hedge_noise:  # the demonstrator's hedging rate (arithmetic; the reward-hacking walkthrough)
        cfg["hedge_noise"] = float(hedge_noise)
    steps = cfg["steps"] if sft_steps is None else int(sft_steps)
    prev_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(int(num_threads))
    try:
        return _build(out, size, seed, steps, cfg, progress, env, {"sft_overrides": dict(sft)} if sft else {})
    finally:
        torch.set_num_threads(prev_threads)


def _build(out: Path, size: str, seed: int, steps: int, cfg: dict, progress: bool,
           env: TaskEnv = ARITHMETIC, extra_meta: dict | None = None) -> Path:
    t0 = time.perf_counter()
    torch_threads = torch.get_num_threads()
    tok = build_tokenizer(task=env)
    config = lab_model_config(
        size,
        vocab_size=len(tok),
        pad_token_id=int(tok.pad_token_id),
        eos_token_id=int(tok.eos_token_id),
    )
    model = build_model(config, seed=seed)
    tasks = env.generate_tasks(cfg["n_tasks"], seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        metrics = warm_start(
            model, tok, tasks, steps=steps, batch_size=cfg["batch_size"], lr=cfg["lr"], seed=seed,
            progress=progress, env=env, **{k: v for k, v in cfg.items() if k.endswith("_noise")},
        )
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    meta = {
        "task": env.name,
        "size": size,
        "seed": seed,
        "torch_threads": torch_threads,
        "build_seconds": time.perf_counter() - t0,
        **(extra_meta or {}),
        **metrics,
    }
    (out / "warm_start.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out
