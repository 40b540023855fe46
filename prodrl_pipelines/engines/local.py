"""The embedded local inference engine (DESIGN.md section 7).

A transformers causal LM (Qwen3 / Qwen3-MoE) with a KV cache and batched temperature/top-k/top-p
sampling that records, per call, the section-3 fields: exactly the prompt ids consumed, the sampled
ids, their processed logprobs (vLLM ``processed_logprobs`` semantics) and the processed top-K head.

On CPU the model computes in fp32 whatever dtype the checkpoint stores (bf16 matmuls are ~100x
slower on these AVX2 machines); the deployment still differs from the trainer through its weights
(e.g. a dequantised NVFP4 export) and its incremental KV-cache path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from os import PathLike

import torch
from torch import Tensor

from prodrl_pipelines.engines.sampling import processed_logprobs, top_logprobs
from prodrl_pipelines.rl.routing_replay import capture_routing, set_routing
from prodrl_pipelines.engines.types import CallRecord, SamplingParams

__all__ = ["LocalEngine", "TOP_LOGPROB_FLOOR"]

# Top-K entries outside the processed support (only when the support is smaller than K) carry -inf;
# they are recorded as this floor instead, like vLLM's OpenAI server does, so records stay finite.
TOP_LOGPROB_FLOOR = -9999.0
SCORE_TOKENS = 8192  # positions of one packed micro-batch when re-scoring


def _sample(proc: Tensor, top_ids: Tensor, top_lps: Tensor, complete: Tensor, gen: torch.Generator) -> Tensor:
    """Draw one token per row of the processed distribution ``proc`` [b, V] -> ids [b].

    By inverting the fp64 CDF of each row, taken in vocabulary order: one uniform per row and a
    binary search, much cheaper than ``torch.multinomial`` on a 152k vocabulary (~40-100 ms against
    ~300-450 ms for 64 rows on one core). A token with zero probability cannot be drawn: the uniform
    is kept strictly below the total, and ``searchsorted(right=True)`` only lands where the CDF
    strictly increases.

    The draw must not depend on K (``num_top_logprobs``, i.e. the logprobs a client asked for): a
    seeded request gives the same tokens whatever logprobs it asks, as in vLLM. So when every row's
    support lies in its recorded head ([b, K]), the same CDF is built from the head alone: its ids in
    vocabulary order, the tokens outside it having probability exactly 0 (adding 0.0 is exact, so
    on CPU's sequential cumsum the partial sums, the total and therefore the drawn token are bitwise
    those of the whole-row path), from the same single uniform per row.
    """
    if bool(complete.all()):
        # Vocabulary order. The head's values are proc's own; its padding (vocabulary < K) is -inf.
        ids, order = torch.sort(top_ids, dim=-1, stable=True)
        cdf = torch.cumsum(top_lps.gather(-1, order).exp(), dim=-1, dtype=torch.float64)
    else:
        ids = None
        cdf = torch.cumsum(proc.exp(), dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=torch.float64, device=proc.device, generator=gen) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    at = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)
    return (at if ids is None else ids.gather(-1, at)).squeeze(-1)


def _routing_per_row(cap: capture_routing, steps: list, n: int, width: int, lens: Tensor) -> list:
    """Each row's experts per forwarded position, [len(prompt) + len(output) - 1, layers, k] (uint8
    numpy when they fit): the prefill's positions of the row's prompt (left padding dropped), then one
    per decode forward the row took part in (the last sampled token is never forwarded)."""
    import numpy as np

    prefill = cap.forward_routing(0).reshape(n, width, len(cap.layers), -1).cpu().numpy()
    rows = [[prefill[i, width - int(lens[i]):]] for i in range(n)]
    for f in range(1, len(cap.layers[0])):  # decode forward f fed the tokens of step f-1's active rows
        chosen = cap.forward_routing(f).cpu().numpy()
        for j, row in enumerate(_fed_rows(steps, f)):
            rows[row].append(chosen[j:j + 1])
    out = []
    for parts in rows:
        a = np.concatenate(parts)
        out.append(a.astype(np.uint8) if a.size == 0 or a.max() < 256 else a)
    return out


def _fed_rows(steps: list, f: int) -> list[int]:
    """The rows decode forward ``f`` fed: step f-1's active rows that had not finished."""
    active, finished = steps[f - 1][0], steps[f - 1][6]
    return active[~finished].tolist()


class LocalEngine:
    """Batched sampling from a transformers causal LM, recording what was consumed and sampled."""

    def __init__(self, model, tokenizer, device: str | torch.device | None = None) -> None:
        if device is not None:
            model = model.to(device)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None)
        self.pad_token_id = int(pad) if pad is not None and 0 <= int(pad) < self.vocab_size else 0

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | PathLike,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        simulate_activations: bool = True,
    ) -> LocalEngine:
        """Load an HF checkpoint directory (model + tokenizer), or an NVFP4 (compressed-tensors) export
        with its weights dequantized.

        ``dtype=None`` computes in fp32 on CPU and keeps the stored dtype elsewhere.

        The engine is the deployment: for a W4A4 export (one with ``input_global_scale`` tensors) it also
        simulates the activation quantization the deployment's NVFP4 W4A4 kernels apply to every
        quantized Linear input (``quant.nvfp4.install_activation_quantization``), so the logprobs it
        records are the deployment's. The trainer's ``rl.checkpoint.load_policy`` deliberately loads the
        same export weights-only ("upcast deployment weights", the reference of reference-model IS),
        which therefore differs from the engine. ``simulate_activations=False`` serves weights-only;
        W4A16 exports and plain checkpoints are unaffected by the flag.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from prodrl_pipelines.quant.nvfp4 import is_compressed_tensors_dir, load_nvfp4_model

        if dtype is None:
            dtype = torch.float32 if torch.device(device).type == "cpu" else "auto"
        if is_compressed_tensors_dir(model_dir):
            model, tokenizer = load_nvfp4_model(model_dir, dtype=dtype, simulate_activations=simulate_activations)
            return cls(model, tokenizer, device=device)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        return cls(model, tokenizer, device=device)

    # ------------------------------------------------------------------ validation helpers

    def _check_ids(self, seqs: Sequence[Sequence[int]], what: str, allow_empty: bool) -> list[list[int]]:
        out: list[list[int]] = []
        for i, seq in enumerate(seqs):
            try:
                ids = [int(t) for t in seq]
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{what} {i} is not a sequence of integer token ids") from exc
            if not ids and not allow_empty:
                raise ValueError(f"{what} {i} is empty: a prompt needs at least one token")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"{what} {i} has token id {bad[0]} outside the vocabulary [0, {self.vocab_size})"
                )
            out.append(ids)
        return out

    def _processed(self, logits: Tensor, params: SamplingParams) -> Tensor:
        return processed_logprobs(logits, params.temperature, params.top_k, params.top_p)

    # ------------------------------------------------------------------ generation

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int | None = None,
    ) -> list[CallRecord]:
        """Sample one continuation per prompt; one ``CallRecord`` per prompt, in order.

        The batch is left-padded and prefilled once; decoding then feeds one token per step through
        the KV cache. Rows that sampled a stop token leave the batch (and the cache). Sampling uses a
        ``torch.Generator`` seeded by ``seed``, so the same inputs and seed give the same outputs.
        """
        from transformers import DynamicCache

        if len(prompts) == 0:
            return []
        prompts = self._check_ids(prompts, "prompt", allow_empty=False)
        n = len(prompts)
        dev = self.device
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        width = int(lens.max())
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p) :] = 1
        input_ids, attn = input_ids.to(dev), attn.to(dev)
        position_ids = (attn.cumsum(-1) - 1).clamp_(min=0)

        gen = torch.Generator(device=dev)
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(seed))
        stop = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=dev)
        k = params.num_top_logprobs

        cap = capture_routing(self.model) if params.record_routing else None
        with cap if cap is not None else contextlib.nullcontext():
            cache = DynamicCache(config=self.model.config)
            out = self.model(
                input_ids=input_ids,
                attention_mask=attn,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1, :]
            active = torch.arange(n, device=dev)  # original row of each batch row
            next_pos = lens.to(dev)

            steps: list[tuple[Tensor, ...]] = []
            for step in range(params.max_tokens):
                proc = self._processed(logits, params)
                top_ids, top_lps, complete = top_logprobs(proc, k)
                tok = _sample(proc, top_ids, top_lps, complete, gen)
                extra = _sample(proc, top_ids, top_lps, complete, gen) if params.record_extra_draw else tok
                tok_lp = proc.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
                finished = torch.isin(tok, stop) if stop.numel() else torch.zeros_like(tok, dtype=torch.bool)
                steps.append((active, tok, tok_lp, top_ids, top_lps, complete, finished, extra))
                if step == params.max_tokens - 1:
                    break
                keep = ~finished
                if not bool(keep.any()):
                    break
                if not bool(keep.all()):
                    idx = keep.nonzero().squeeze(-1)
                    cache.batch_select_indices(idx)
                    attn, active, tok, next_pos = attn[idx], active[idx], tok[idx], next_pos[idx]
                attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=-1)
                out = self.model(
                    input_ids=tok.unsqueeze(-1),
                    attention_mask=attn,
                    position_ids=next_pos.unsqueeze(-1),
                    past_key_values=cache,
                    use_cache=True,
                )
                logits = out.logits[:, -1, :]
                next_pos = next_pos + 1
        routing = _routing_per_row(cap, steps, n, width, lens) if cap is not None and cap.layers else [None] * n

        out_ids: list[list[int]] = [[] for _ in range(n)]
        out_lps: list[list[float]] = [[] for _ in range(n)]
        heads_ids: list[list[list[int]]] = [[] for _ in range(n)]
        heads_lps: list[list[list[float]]] = [[] for _ in range(n)]
        extras: list[list[int]] = [[] for _ in range(n)]
        complete_all = [True] * n
        stopped = [False] * n
        for active_s, tok_s, lp_s, tid_s, tlp_s, comp_s, fin_s, ex_s in steps:
            tlp_s = tlp_s.clamp(min=TOP_LOGPROB_FLOOR)
            for row, t, lp, tid, tlp, c, f, x in zip(
                active_s.tolist(), tok_s.tolist(), lp_s.tolist(), tid_s.tolist(), tlp_s.tolist(),
                comp_s.tolist(), fin_s.tolist(), ex_s.tolist(),
            ):
                out_ids[row].append(t)
                extras[row].append(x)
                out_lps[row].append(lp)
                heads_ids[row].append(tid)
                heads_lps[row].append(tlp)
                complete_all[row] = complete_all[row] and c
                stopped[row] = stopped[row] or f

        return [
            CallRecord(
                prompt_token_ids=prompts[i],
                output_token_ids=out_ids[i],
                output_logprobs=out_lps[i],
                top_token_ids=heads_ids[i],
                top_logprobs=heads_lps[i],
                support_complete=complete_all[i],
                extra_token_ids=extras[i] if params.record_extra_draw else None,
                finish_reason="stop" if stopped[i] else "length",
                output_text=self._decode(out_ids[i]),
                routed_experts=routing[i],
            )
            for i in range(n)
        ]

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # ------------------------------------------------------------------ re-scoring

    @torch.inference_mode()
    def score(
        self,
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        params: SamplingParams,
        routings: Sequence | None = None,
    ) -> list[list[float]]:
        """Processed logprobs of each output token given its prompt and the earlier output tokens.

        No KV cache (an independent path to check what ``generate`` recorded): the (prompt, output)
        pairs are packed without padding into micro-batches of ``SCORE_TOKENS`` positions exactly as
        the trainer packs its sequences (``rl.batch.pack_sequences``: restarting position ids,
        attention never crossing a pair), so every log-prob of a round is computed one way.
        ``routings``: per pair, MoE experts recorded by a deployment ([prompt + output - 1, layers,
        k] or None), replayed as the trainer replays them (``rl.routing_replay``).
        """
        from prodrl_pipelines.rl.trajectory import Call
        from prodrl_pipelines.rl.batch import pack_sequences
        from prodrl_pipelines.rl.logprobs import packed_attention_mask, uses_flash_attention
        from prodrl_pipelines.rl.microbatches import plan_microbatches
        from prodrl_pipelines.rl.sequences import Sequence as TokenSequence, Span

        if len(prompts) != len(outputs):
            raise ValueError(f"got {len(prompts)} prompts but {len(outputs)} outputs")
        prompts = self._check_ids(prompts, "prompt", allow_empty=False)
        outputs = self._check_ids(outputs, "output", allow_empty=True)
        result: list[list[float]] = [[] for _ in prompts]
        todo = [i for i, o in enumerate(outputs) if o]
        routed = [None] * len(prompts) if routings is None else list(routings)
        calls = [Call(prompts[i], outputs[i], [0.0] * len(outputs[i]), 1.0, routing=routed[i]) for i in todo]
        seqs = [TokenSequence(prompts[i] + outputs[i], [Span(c, len(prompts[i]), 0.0, 0.0, i)], [c])
                for i, c in zip(todo, calls)]
        config = self.model.config
        for micro in plan_microbatches([q.num_inputs for q in seqs], SCORE_TOKENS).ranks[0]:
            b = pack_sequences([seqs[j] for j in micro], pad_id=0, one_row=uses_flash_attention(config),
                               with_routing=routings is not None).to(self.device)
            set_routing(self.model, b.routing, b.routing_known)
            hidden = self.model.model(input_ids=b.input_ids, position_ids=b.position_ids, use_cache=False,
                                      attention_mask=packed_attention_mask(config, b.segment_ids)).last_hidden_state
            logits = self.model.lm_head(hidden[b.gen_row, b.gen_pos])
            lp = self._processed(logits, params).gather(-1, b.targets[:, None]).squeeze(-1).tolist()
            g = 0
            for j in micro:  # tokens come out sequence by sequence, in the micro-batch's order
                i = seqs[j].spans[0].traj
                result[i] = lp[g:g + len(outputs[i])]
                g += len(outputs[i])
        set_routing(self.model, None)
        return result
