"""Training on production-shaped traffic: a trajectory's calls merged into one sequence where their
prompts extend (split, with the reason, where not), sequences packed without padding, token-budget
micro-batches with accumulated gradients. All of it only partitions the objective's sum over
generated tokens, so the step must equal today's padded per-call step."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from prodrl_pipelines.rl.trajectory import Call, Trajectory
from prodrl_pipelines.rl.batch import pack_minibatch, pack_sequences
from prodrl_pipelines.rl.checkpoint import TrainerState
from prodrl_pipelines.rl.config import Recipe
from prodrl_pipelines.rl.logprobs import policy_logprobs
from prodrl_pipelines.rl.microbatches import filler_batch, plan_microbatches
from prodrl_pipelines.rl.sequences import LayoutStats, minibatch_sequences, trajectory_sequences
from prodrl_pipelines.rl.trainer import build_optimizer, layout_round, train_round, train_step

V = 48


def _model(moe: bool = False, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=256, pad_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    if moe:
        cfg = Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                             num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True)
        return Qwen3MoeForCausalLM(cfg).float()
    return Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=64)).float()


def _call(rng, prompt, n_out, K=0, top_k=0, top_p=1.0, complete=False, temperature=1.0):
    outs = rng.integers(3, V, n_out).tolist()
    top_ids = top_lps = None
    lps = (-rng.random(n_out) * 2).tolist()
    if K:
        top_ids, top_lps = [], []
        for t, a in enumerate(outs):
            others = rng.choice([v for v in range(3, V) if v != a], K - 1, replace=False).tolist()
            head = np.sort(np.log(rng.dirichlet(np.ones(K)) * (1.0 if complete else 0.9)))[::-1]
            top_ids.append([a] + others)
            top_lps.append(head.tolist())
            lps[t] = float(head[0])
    return Call(list(prompt), outs, lps, temperature, top_ids, top_lps, support_complete=complete, top_k=top_k,
                top_p=top_p)


def _agent(rng, tid, turns, reward, *, break_at=(), rewrite_at=(), **head):
    """A multi-turn trajectory: each call's prompt = the previous prompt + output + a tool result,
    except at ``break_at`` (history edited: the first tokens change) and ``rewrite_at`` (the
    previous output re-rendered: its first token replaced)."""
    calls, prompt = [], rng.integers(3, V, int(rng.integers(4, 9))).tolist()
    for j in range(turns):
        c = _call(rng, prompt, int(rng.integers(1, 5)), **head)
        calls.append(c)
        out = list(c.output_ids)
        if j + 1 in rewrite_at:
            out[0] = 3 + (out[0] - 2) % (V - 3)
        prompt = list(c.prompt_ids) + out + rng.integers(3, V, int(rng.integers(1, 4))).tolist()
        if j + 1 in break_at:
            prompt[0] = 3 + (prompt[0] - 2) % (V - 3)
    return Trajectory(tid, tid, "v0", reward, calls)


def _mixed_batch(seed=0):
    """Single-call, merged multi-turn, split multi-turn (both reasons), top-k and top-p heads
    (complete and incomplete), another temperature, and a context-only call."""
    rng = np.random.default_rng(seed)
    trajs = [
        Trajectory("single", "single", "v0", 1.0, [_call(rng, rng.integers(3, V, 6).tolist(), 3)]),
        _agent(rng, "merged", 4, 0.0),
        _agent(rng, "split", 4, 1.0, break_at=(2,), rewrite_at=(3,)),
        _agent(rng, "topk", 3, 0.0, K=4, top_k=4, complete=True),
        _agent(rng, "topp", 3, 1.0, K=4, top_p=0.9, rewrite_at=(1,)),
        _agent(rng, "warm", 2, 0.0, K=4, temperature=0.7),
    ]
    trajs[5].calls[0].trained = False  # context only (a retokenized call of unknown support)
    return trajs


def _padded_per_call(trajs):
    out = []
    for t in trajs:
        seqs = trajectory_sequences(t, 1.0, 1, 0, merge=False)
        out += [list(s.ids) for s in seqs]
    return out


# --- the layout ------------------------------------------------------------------------------------
def test_extending_calls_merge_into_one_sequence_with_every_output_at_its_own_place():
    rng = np.random.default_rng(1)
    t = _agent(rng, "a", 3, 1.0)
    stats = LayoutStats()
    (seq,) = trajectory_sequences(t, 0.5, 4, 2, stats=stats)
    assert seq.ids == t.calls[-1].prompt_ids + t.calls[-1].output_ids
    for sp, c in zip(seq.spans, t.calls):
        assert seq.ids[sp.start:sp.start + len(c.output_ids)] == c.output_ids  # trained at its own positions
        assert sp.weight == pytest.approx(1 / (4 * t.num_generated)) and sp.adv == 0.5 and sp.traj == 2
    assert (stats.calls, stats.merged_calls, sum(stats.split_calls.values()), stats.sequences) == (3, 2, 0, 1)
    assert stats.sequence_tokens == len(seq.ids) - 1
    assert stats.per_call_tokens == sum(len(c.prompt_ids) + len(c.output_ids) - 1 for c in t.calls)


def test_a_broken_extension_starts_a_new_sequence_and_says_why():
    rng = np.random.default_rng(2)
    t = _agent(rng, "s", 4, 1.0, break_at=(2,), rewrite_at=(3,))
    stats = LayoutStats()
    seqs = trajectory_sequences(t, 1.0, 1, 0, stats=stats)
    assert [len(s.spans) for s in seqs] == [2, 1, 1]
    assert stats.split_calls == {"history_edited": 1, "output_rewritten": 1} and stats.merged_calls == 1
    m = stats.as_metrics()
    assert m["layout_split_history_edited"] == 1 and m["layout_split_output_rewritten"] == 1
    for s in seqs:  # never re-tokenised: every sequence is some call's recorded prompt + output
        assert any(s.ids == c.prompt_ids + c.output_ids for c in t.calls)


def test_an_empty_output_carries_the_history_and_a_trajectory_without_tokens_is_refused():
    a = Call([5, 6], [], [], 1.0)
    b = Call([5, 6, 7], [8, 9], [-0.1, -0.2], 1.0)
    (seq,) = trajectory_sequences(Trajectory("t", "", "v0", 1.0, [a, b]), 1.0, 1, 0)
    assert seq.ids == [5, 6, 7, 8, 9] and len(seq.spans) == 1
    with pytest.raises(ValueError, match="no generated tokens"):
        trajectory_sequences(Trajectory("e", "", "v0", 1.0, [a]), 1.0, 1, 0)


def test_packed_rows_restart_positions_and_index_every_target():
    trajs = _mixed_batch()
    seqs = minibatch_sequences(trajs, np.ones(len(trajs)))
    one = pack_sequences(seqs, pad_id=0, one_row=True)
    assert one.input_ids.shape == (1, sum(s.num_inputs for s in seqs)) and one.attention_mask is None
    flat = torch.cat([torch.tensor(s.ids[1:]) for s in seqs])  # what each packed position predicts
    assert torch.equal(flat[one.gen_pos], one.targets)
    assert torch.equal(one.segment_ids[0], torch.repeat_interleave(torch.arange(len(seqs)),
                                                                   torch.tensor([s.num_inputs for s in seqs])))
    assert (one.position_ids[0][torch.nonzero(torch.diff(one.segment_ids[0])) + 1] == 0).all()
    ref = pack_minibatch(trajs, np.ones(len(trajs)), pad_id=0)
    # the same generated tokens with the same recorded data, whatever the layout (order within a call kept)
    key = lambda x: sorted(zip(x.traj_index.tolist(), x.targets.tolist(), x.logp_mu.tolist(), x.weight.tolist()))  # noqa: E731
    assert key(one) == key(ref)


def test_many_short_sequences_fill_short_rows_and_a_few_uneven_ones_one_row():
    # many short sequences: short rows (a few times the longest), filled first-fit, little padding
    rng = np.random.default_rng(5)
    short = minibatch_sequences([_agent(rng, f"s{i}", 1, 1.0) for i in range(40)], np.ones(40))
    b = pack_sequences(short, pad_id=0)
    longest, total = max(s.num_inputs for s in short), sum(s.num_inputs for s in short)
    assert b.input_ids.shape[1] < total / 4 and b.input_ids.shape[1] >= longest and b.input_ids.shape[0] > 4
    assert b.num_inputs <= 1.05 * total
    assert int((b.segment_ids < len(short)).sum()) == total  # every token once
    # a few of unequal length would pad more than that: one row
    uneven = [short[0], minibatch_sequences([_agent(rng, "long", 6, 1.0)], np.ones(1))[0]]
    assert pack_sequences(uneven, pad_id=0).num_inputs == sum(s.num_inputs for s in uneven)
    rows_ids = [torch.tensor(s.ids) for s in short]
    for g in range(b.num_tokens):  # each target is the next token of its own sequence
        r, p = int(b.gen_row[g]), int(b.gen_pos[g])
        seq = int(b.segment_ids[r, p])
        assert int(rows_ids[seq][int(b.position_ids[r, p]) + 1]) == int(b.targets[g])


@pytest.mark.parametrize("moe", [False, True])
def test_a_packed_forward_equals_separate_forwards(moe):
    model = _model(moe).eval()
    trajs = _mixed_batch(seed=3)
    seqs = minibatch_sequences(trajs, np.ones(len(trajs)))
    packed = pack_sequences(seqs, pad_id=0)
    with torch.no_grad():
        got = policy_logprobs(model, packed)
        torch.testing.assert_close(policy_logprobs(model, pack_sequences(seqs, pad_id=0, one_row=True)), got,
                                   atol=1e-5, rtol=1e-5)
        ref = torch.cat([policy_logprobs(model, pack_sequences([s], pad_id=0, layout="padded"))[:, 0] for s in seqs])
        per_call = policy_logprobs(model, pack_minibatch(trajs, np.ones(len(trajs)), pad_id=0))
    torch.testing.assert_close(got[:, 0], ref, atol=1e-5, rtol=1e-5)
    # many short sequences in several rows of several sequences each (with a padding tail)
    rng = np.random.default_rng(5)
    short = minibatch_sequences([_agent(rng, f"s{i}", 2, 1.0) for i in range(24)], np.ones(24))
    rows = pack_sequences(short, pad_id=0)
    assert 1 < rows.input_ids.shape[0] < len(short)
    with torch.no_grad():
        sep = torch.cat([policy_logprobs(model, pack_sequences([s], pad_id=0, layout="padded"))[:, 0] for s in short])
        torch.testing.assert_close(policy_logprobs(model, rows)[:, 0], sep, atol=1e-5, rtol=1e-5)
    # merged, each call's tokens get the log-probs of the call's own padded row (same token order)
    assert torch.equal(packed.targets, pack_minibatch(trajs, np.ones(len(trajs)), 0).targets)
    torch.testing.assert_close(got, per_call, atol=1e-5, rtol=1e-5)


# --- micro-batches ---------------------------------------------------------------------------------
def test_micro_batches_fill_the_budget_balance_the_ranks_and_stay_in_step():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 400, 60).tolist() + [900]  # one longer than the budget
    plan = plan_microbatches(lengths, 512, world_size=2)
    assert plan.oversize == 1
    assert len(plan.ranks[0]) == len(plan.ranks[1])  # the same number of forwards on every rank
    every = sorted(i for r in plan.ranks for m in r for i in m)
    assert every == list(range(len(lengths)))  # each sequence exactly once
    for r in plan.ranks:
        for m in r:
            assert sum(lengths[i] for i in m) <= 512 or m == [len(lengths) - 1]
    loads = [sum(lengths[i] for m in r for i in m) for r in plan.ranks]
    assert abs(loads[0] - loads[1]) <= max(lengths)  # balanced by tokens
    assert plan_microbatches(lengths, 512, 2).ranks == plan.ranks  # deterministic
    # first-fit decreasing: within one rank no two micro-batches could have been one
    single = plan_microbatches(lengths[:-1], 512).ranks[0]
    fill = sorted(sum(lengths[i] for i in m) for m in single)
    assert fill[0] + fill[1] > 512
    one = plan_microbatches([5], 512, world_size=2)
    assert one.ranks == [[[0]], [[]]]  # rank 1 runs a filler
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        plan_microbatches([5], 0)


def test_a_filler_micro_batch_changes_no_gradient():
    model = _model()
    b = filler_batch(pad_id=0)
    assert b.filler and float(b.weight.sum()) == 0.0
    recipe = Recipe(correction="tis", kl_beta=0.1, batch_size=2)
    with torch.no_grad():
        old = policy_logprobs(model, b)
    opt = build_optimizer(model, recipe, TrainerState())
    before = copy.deepcopy(model.state_dict())
    train_step(model, opt, [b], [old], None, recipe, recipe.correction_params())
    assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --- the step ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("correction", ["tis", "score_centering", "cis"])
def test_one_step_with_micro_batches_packing_and_merged_prefixes_equals_the_padded_per_call_step(correction):
    trajs = _mixed_batch()
    adv = np.array([0.9, -0.4, 0.3, -0.7, 0.5, -0.6])
    recipe = Recipe(steps_per_round=1, batch_size=len(trajs), correction=correction, kl_beta=0.1,
                    learning_rate=1e-3, max_tokens_per_microbatch=40)
    # today's step: one right-padded row per call, the whole minibatch at once
    m_old = _model()
    opt_old = build_optimizer(m_old, recipe, TrainerState())
    padded = pack_minibatch(trajs, adv, pad_id=0, vocab_size=V)
    with torch.no_grad():
        old = policy_logprobs(m_old, padded)
    train_step(m_old, opt_old, [padded], [old], None, recipe, recipe.correction_params())
    # the new one: merged, packed, several micro-batches
    m_new = _model()
    st = TrainerState()
    opt_new = build_optimizer(m_new, recipe, st)
    res = train_round(m_new, opt_new, trajs, adv, [list(range(len(trajs)))], recipe, st, 0, 0, progress=False)
    layout = res.layout
    assert res.steps[0]["micro_batches"] > 1 and layout.merged_calls > 0 and sum(layout.split_calls.values()) == 3
    assert res.steps[0]["input_tokens"] < padded.num_inputs
    for (name, a), b in zip(m_old.state_dict().items(), m_new.state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=name)
    for sa, sb in zip(opt_old.state_dict()["state"].values(), opt_new.state_dict()["state"].values()):
        torch.testing.assert_close(sb["exp_avg"], sa["exp_avg"], atol=1e-7, rtol=1e-4)


def test_the_layout_is_the_same_on_every_rank_and_splits_each_minibatch_between_them():
    trajs = _mixed_batch()
    recipe = Recipe(steps_per_round=1, batch_size=6, max_tokens_per_microbatch=40)
    plan = [list(range(6))]
    (seqs0, micro0), = layout_round(trajs, np.ones(6), plan, recipe, rank=0, world_size=2)[0]
    (seqs1, micro1), = layout_round(trajs, np.ones(6), plan, recipe, rank=1, world_size=2)[0]
    assert [s.ids for s in seqs0] == [s.ids for s in seqs1] and len(micro0) == len(micro1)
    assert sorted(i for m in micro0 + micro1 for i in m) == list(range(len(seqs0)))
