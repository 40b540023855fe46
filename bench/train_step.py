"""Cost of one training step with each mismatch correction vs a plain next-token cross-entropy step
of the same model on the same tokens, measured interleaved in one run (target ratio <= 1.15).

The round-start policy pi_k (and pi_ref for ref_is) is computed once per round, not per step; its
cost is reported separately as "round-start forward".

Last line: ``train_step: vocab=V; worst/ce=X; worst=CORRECTION; forward/ce=X`` (the last vocabulary's run).

Usage: ``python bench/train_step.py [--vocabs 512 151936] [--repeats 9] [--smoke]``

Smoke size (``--smoke``, bench/_smoke.py): vocabulary 512 only, 4 trajectories, one timed repeat.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _smoke import parse_args  # noqa: E402

from prodrl_pipelines.rl.trajectory import Call, Trajectory
from prodrl_pipelines.rl.batch import pack_minibatch
from prodrl_pipelines.rl.config import Recipe
from prodrl_pipelines.rl.logprobs import policy_logprobs
from prodrl_pipelines.rl.losses import POLICY_CORRECTIONS
from prodrl_pipelines.rl.trainer import train_step

B, K, REPS = 32, 8, 9
HIDDEN = {512: 64, 151_936: 128}  # a real vocabulary with a wider model


def make_model(vocab: int, hidden: int):
    from prodrl_pipelines.lab.model import build_model, lab_model_config

    cfg = lab_model_config("demo", vocab_size=vocab, pad_token_id=0, eos_token_id=1, hidden_size=hidden)
    return build_model(cfg, seed=0).float()


def make_batch(vocab: int, n: int = B):
    rng = np.random.default_rng(0)
    trajs = []
    for i in range(n):
        calls = []
        for _ in range(2):
            outs = rng.integers(3, vocab, 8).tolist()
            heads = [[a] + rng.integers(3, vocab, K - 1).tolist() for a in outs]
            lps = [np.sort(np.log(rng.dirichlet(np.ones(K)) * 0.95))[::-1].tolist() for _ in outs]
            calls.append(Call(rng.integers(3, vocab, 40).tolist(), outs, [r[0] for r in lps], 1.0, heads, lps,
                              True, K, 1.0))
        trajs.append(Trajectory(f"t{i}", "x", "v", float(i % 2), calls))
    return pack_minibatch(trajs, np.where(np.arange(n) % 2, 0.5, -0.5), pad_id=0)


def ce_step(model, opt, b):
    labels = torch.full_like(b.input_ids, -100)
    # labels[p] is the token predicted at position p-1 in HF's shifted loss: put targets one to the right
    full = torch.cat([b.input_ids, torch.zeros_like(b.input_ids[:, :1])], 1)
    labels = torch.full_like(full, -100)
    labels[b.gen_row, b.gen_pos + 1] = b.targets
    full[b.gen_row, b.gen_pos + 1] = b.targets
    mask = torch.cat([b.attention_mask, torch.zeros_like(b.attention_mask[:, :1])], 1)
    mask[b.gen_row, b.gen_pos + 1] = 1
    loss = model(input_ids=full, attention_mask=mask, labels=labels).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", type=int, nargs="+", default=list(HIDDEN), choices=list(HIDDEN))
    ap.add_argument("--repeats", type=int, default=REPS, help="timed rounds (after one warm-up round)")
    ap.add_argument("--batch", type=int, default=B, help="trajectories of two calls")
    args = parse_args(ap, vocabs=[512], repeats=1, batch=4)
    torch.set_num_threads(1)  # one core: less sensitive to a shared, noisy machine
    for vocab in args.vocabs:
        last = run(vocab, HIDDEN[vocab], args.repeats, args.batch)
    worst = max(last["ratios"], key=last["ratios"].get)
    print(f"train_step: vocab={last['vocab']}; worst/ce={last['ratios'][worst]:.2f}; worst={worst}; "
          f"forward/ce={last['forward/ce']:.2f}")


def run(vocab: int, hidden: int, reps: int = REPS, n: int = B) -> dict:
    torch.manual_seed(0)
    model = make_model(vocab, hidden)
    vocab = model.config.vocab_size
    b = make_batch(vocab, n)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    with torch.no_grad():
        t0 = time.perf_counter()
        old = policy_logprobs(model, b)
        t_old = time.perf_counter() - t0
    variants = ["ce"] + [c for c in POLICY_CORRECTIONS if c != "score_centering_sampled"]
    times = {v: [] for v in variants}
    for rep in range(reps + 1):
        order = variants if rep % 2 else variants[::-1]  # alternate order: drift hits all variants alike
        for v in order:
            t0 = time.perf_counter()
            if v == "ce":
                ce_step(model, opt, b)
            else:
                recipe = Recipe(steps_per_round=1, batch_size=2, correction=v, kl_beta=0.05)
                train_step(model, opt, [b], [old], [old] if v == "ref_is" else None, recipe,  # one micro-batch
                           recipe.correction_params())
            if rep:  # first round is warm-up
                times[v].append(time.perf_counter() - t0)
    ce = statistics.median(times["ce"])
    print(f"train step, lab 'demo' MoE model (vocab {vocab}, hidden {hidden}), B={n} trajectories ({b.num_tokens} generated tokens, "
          f"{int(b.attention_mask.sum())} tokens in), head K={K}, KL on; median of {reps}")
    print(f"  {'ce (HF labels)':24s} {ce * 1e3:7.1f} ms   ratio 1.00")
    ratios = {}
    for v in variants[1:]:
        m = statistics.median(times[v])
        ratios[v] = m / ce
        print(f"  {v:24s} {m * 1e3:7.1f} ms   ratio {m / ce:.2f} (target <= 1.15)")
    print(f"  round-start forward (pi_k, once per minibatch per round): {t_old * 1e3:.1f} ms = {t_old / ce:.2f} x ce step")
    return {"vocab": vocab, "ratios": ratios, "forward/ce": t_old / ce}


if __name__ == "__main__":
    main()
