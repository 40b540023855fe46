"""The chess puzzle task: puzzles verified by an independent search, the tool-call
environment, episodes, the SFT warm start, and play through the HTTP serving path."""

from __future__ import annotations

import json
import random

import chess
import pytest

from prodrl_pipelines.loop import bootstrap
from prodrl_pipelines.engines.types import CallRecord, SamplingParams
from prodrl_pipelines.lab import arithmetic, chess_env, chess_puzzles
from prodrl_pipelines.lab.chess_env import MIN_MAX_TOKENS, MoveError, parse_move, parse_tool_call, tool_call
from prodrl_pipelines.lab.chess_puzzles import ChessPuzzle
from prodrl_pipelines.lab.episodes import assistant_content, render_prompt, run_episodes
from prodrl_pipelines.lab.model import lab_model_config
from prodrl_pipelines.lab.tasks import ARITHMETIC, CHESS, TASKS, get_task
from prodrl_pipelines.lab.tokenizer import IM_END, build_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(task="chess")


@pytest.fixture(scope="module")
def train():
    return chess_puzzles.generate_puzzles(64, seed=0)  # one cached chunk


@pytest.fixture(scope="module")
def heldout():
    return chess_puzzles.heldout_puzzles(64)


def _by_kind(puzzles, mate_in):
    return [p for p in puzzles if p.mate_in == mate_in]


# ------------------------------------------------------------------------- independent verification
# Plain python-chess brute force, sharing nothing with chess_puzzles' pruned search.


def _mates(board: chess.Board) -> list[str]:
    out = []
    for m in list(board.legal_moves):
        board.push(m)
        if board.is_checkmate():
            out.append(m.uci())
        board.pop()
    return out


def _winning_keys(board: chess.Board) -> list[str]:
    keys = []
    for m in list(board.legal_moves):
        board.push(m)
        defences = list(board.legal_moves)
        if defences and all(_mate_after(board, d) for d in defences):
            keys.append(m.uci())
        board.pop()
    return keys


def _mate_after(board: chess.Board, d: chess.Move) -> bool:
    board.push(d)
    ok = bool(_mates(board))
    board.pop()
    return ok


def test_mate_in_1_solutions_are_unique(train, heldout):
    puzzles = _by_kind(train, 1) + _by_kind(heldout, 1)[:16]
    assert len(puzzles) >= 20
    for p in puzzles:
        b = p.board()
        assert b.turn == chess.WHITE and b.is_valid() and not b.is_game_over()
        assert _mates(b) == [p.solution_uci[0]] and len(p.solution_uci) == 1, p


def test_mate_in_2_keys_unique_and_lines_legal_and_mating(train, heldout):
    puzzles = _by_kind(train, 2)[:16] + _by_kind(heldout, 2)[:8]
    assert len(puzzles) >= 16
    for p in puzzles:
        b = p.board()
        assert _mates(b) == [], p  # not solvable faster
        assert _winning_keys(b) == [p.solution_uci[0]], p
        key, defence, mate = p.solution_uci
        b.push_uci(key)
        assert chess.Move.from_uci(defence) in b.legal_moves
        b.push_uci(defence)
        assert _mates(b) == [mate], p  # the recorded mating reply is the only one after that defence
        b.push_uci(mate)
        assert b.is_checkmate()


def test_heldout_is_fixed_and_disjoint_from_training(heldout):
    assert heldout == chess_puzzles.heldout_puzzles(64)
    assert heldout[:4] == chess_puzzles.heldout_puzzles(4)
    assert heldout[0].fen == "7k/6pp/8/3K4/8/2Q5/8/8 w - - 0 1" and heldout[0].solution_uci == ("c3c8",)
    assert all(chess_puzzles.is_heldout(p) for p in heldout)
    draws = chess_puzzles.generate_puzzles(100, seed=3)  # two chunks
    assert draws == chess_puzzles.generate_puzzles(100, seed=3)  # deterministic in the seed
    assert draws != chess_puzzles.generate_puzzles(64, seed=4)
    assert not any(chess_puzzles.is_heldout(p) for p in draws)
    assert not {p.fen for p in heldout} & {p.fen for p in draws}
    for p in heldout[:8] + draws[:8]:  # identity is the content hash of the position
        assert p.task_id == chess_puzzles._content_key(p.fen)
    assert {p.mate_in for p in draws} == {1, 2}
    with pytest.raises(ValueError, match="held-out pool holds 512"):
        chess_puzzles.heldout_puzzles(10_000)


def test_chunks_regenerate_identically_into_a_fresh_cache(tmp_path, monkeypatch):
    cached = chess_puzzles._load_chunks("heldout", [0])[0]
    monkeypatch.setenv(chess_puzzles.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(chess_puzzles, "_memo", {})
    fresh = chess_puzzles._load_chunks("heldout", [0])[0]
    assert fresh == cached and len(fresh) == chess_puzzles.CHUNK
    assert (tmp_path / f"v{chess_puzzles.GENERATOR_VERSION}-heldout-0000.json").exists()
    (tmp_path / f"v{chess_puzzles.GENERATOR_VERSION}-heldout-0000.json").write_text("{damaged")
    monkeypatch.setattr(chess_puzzles, "_memo", {})
    assert chess_puzzles._read_chunk("heldout", 0) is None  # a damaged file is regenerated, not trusted


# ------------------------------------------------------------------------------------ environment

M2 = ChessPuzzle("t2", "8/4pk2/4p1p1/7B/6Q1/8/8/6K1 w - - 0 1", ("g4g6", "f7f8", "g6f7"), 2)
M1 = ChessPuzzle("t1", "7k/6pp/8/3K4/8/2Q5/8/8 w - - 0 1", ("c3c8",), 1)


def test_tool_call_parsing():
    board = M1.board()
    assert parse_tool_call(tool_call("c3c8")) == {"uci": "c3c8"}
    hermes = '<tool_call>\n{"name": "move", "arguments": {"uci": "c3c8"}}\n</tool_call>'
    assert parse_move(board, hermes) == chess.Move.from_uci("c3c8")
    assert parse_move(board, "Let me think. " + hermes) == chess.Move.from_uci("c3c8")  # text around is ignored
    assert parse_move(board, '<tool_call>{"name":"move","arguments":{"san":"Qc8#"}}</tool_call>').uci() == "c3c8"
    assert parse_move(board, '<tool_call>{"name":"move","arguments":{"uci":"Qc8"}}</tool_call>').uci() == "c3c8"
    as_string = '<tool_call>{"name":"move","arguments":"{\\"uci\\": \\"c3c8\\"}"}</tool_call>'
    assert parse_move(board, as_string).uci() == "c3c8"
    bad = {
        "c3c8": "exactly one",
        tool_call("c3c8") + tool_call("c3c7"): "exactly one",
        "<tool_call>{name: move}</tool_call>": "not JSON",
        '<tool_call>{"name":"play","arguments":{"uci":"c3c8"}}</tool_call>': "tool 'move'",
        '<tool_call>{"name":"move","arguments":{"square":"c8"}}</tool_call>': "expected arguments",
        tool_call("c3c9"): "neither UCI nor legal SAN",
        tool_call("c3d5"): "not legal",  # not a queen move
        tool_call("h8h7"): "not legal",  # Black's piece
    }
    for text, why in bad.items():
        with pytest.raises(MoveError, match=why):
            parse_move(board, text)


def test_env_plays_the_recorded_reply_and_rewards():
    msgs = chess_env.initial_messages(M2)
    assert msgs == [{"role": "user", "content": "White to move, mate in 2. Call move(uci).\n8\n4pk2\n4p1p1\n7B\n"
                                                "6Q1\n8\n8\n6K1"}]
    reply = chess_env.env_reply(M2, 0, tool_call("g4g6"))
    assert reply == {"role": "tool", "content": "Black f7f8. Mate in 1.\n5k2\n4p3\n4p1Q1\n7B\n8\n8\n8\n6K1"}
    assert chess_env.env_reply(M2, 0, tool_call("g4g5")) is None  # legal, wrong: episode over
    assert chess_env.env_reply(M2, 0, tool_call("g4g3g2")) is None  # malformed
    assert chess_env.env_reply(M2, 0, "g4g6") is None  # no tool call
    assert chess_env.env_reply(M2, 1, tool_call("g6f7")) is None  # solved
    assert chess_env.env_reply(M1, 0, tool_call("c3c8")) is None
    r = chess_env.reward
    assert r(M2, [tool_call("g4g6"), tool_call("g6f7")]) == 1.0
    assert r(M2, [tool_call("g4g6"), tool_call("g6g7")]) == 0.5  # the key, then a miss
    assert r(M2, [tool_call("g4g6")]) == 0.5  # a missing turn counts as wrong
    assert r(M2, [tool_call("g4g5"), tool_call("g6f7")]) == 0.0
    assert r(M2, ["g4g6", tool_call("g6f7")]) == 0.0
    assert r(M1, [tool_call("c3c8")]) == 1.0 and r(M1, [tool_call("c3c7")]) == 0.0 and r(M1, []) == 0.0
    assert chess_env.solved(M2, [tool_call("g4g6"), tool_call("g6f7")])


def test_demonstrators(train):
    ref = chess_env.reference_messages(M2)
    assert [m["role"] for m in ref] == ["user", "assistant", "tool", "assistant"]
    assert chess_env.reward(M2, [m["content"] for m in ref if m["role"] == "assistant"]) == 1.0
    for p in train[:20]:
        ref = chess_env.reference_messages(p)
        assert chess_env.reward(p, [m["content"] for m in ref if m["role"] == "assistant"]) == 1.0
        assert chess_env.noisy_messages(p, random.Random(0)) == ref  # no noise: the reference
    rng = random.Random(1)
    sloppy = [chess_env.noisy_messages(p, rng, format_noise=1.0) for p in train[:10]]
    assert all(len(t) == 2 and t[1]["content"] == p.solution_uci[0] for t, p in zip(sloppy, train))
    rng = random.Random(2)
    wrong = [chess_env.noisy_messages(p, rng, answer_noise=1.0) for p in train[:10]]
    for t, p in zip(wrong, train):
        assert len(t) == 2 and parse_tool_call(t[1]["content"])["uci"] != p.solution_uci[0]
        assert chess_env.reward(p, [t[1]["content"]]) == 0.0


def test_prompts_and_tool_calls_fit_the_lab_context(tok, heldout):
    ctx = lab_model_config("tiny").max_position_embeddings
    longest = 0
    for p in heldout:
        msgs = chess_env.reference_messages(p)
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            ids = tok.encode(m["content"], add_special_tokens=False)
            assert tok.unk_token_id not in ids and tok.decode(ids) == m["content"]
            assert len(ids) + 1 <= MIN_MAX_TOKENS  # the call and <|im_end|>
            longest = max(longest, len(render_prompt(tok, msgs[:k])[1]))
    assert longest + MIN_MAX_TOKENS <= ctx, (longest, ctx)


def test_task_registry_and_settings():
    from prodrl_pipelines.resources.settings import ProdRLSettings

    assert set(TASKS) == {"arithmetic", "chess", "arithmetic_tools"} and get_task("chess") is CHESS and get_task(CHESS) is CHESS
    with pytest.raises(ValueError, match="unknown lab task 'go'; valid tasks: arithmetic, arithmetic_tools, chess"):
        get_task("go")
    # arithmetic is the original module, unchanged
    assert ARITHMETIC.generate_tasks(5, 3) == arithmetic.generate_tasks(5, seed=3)
    assert ARITHMETIC.heldout_tasks(5) == arithmetic.heldout_tasks(5)
    assert build_tokenizer().get_vocab() == build_tokenizer(task="arithmetic").get_vocab()
    assert ProdRLSettings().settings().lab.task == "arithmetic"
    from prodrl_pipelines.config.settings import check_settings

    with pytest.raises(ValueError, match=f"'chess' needs deploy.max_tokens >= {MIN_MAX_TOKENS}"):
        check_settings(ProdRLSettings(lab_task="chess").settings())
    assert ProdRLSettings(lab_task="chess", max_tokens=MIN_MAX_TOKENS).settings().lab.task == "chess"
    # the core settings do not know the lab's tasks: the lab refuses an unknown one when its suite loads
    with pytest.raises(ValueError, match="unknown lab task 'checkers'; valid tasks: arithmetic, arithmetic_tools, chess"):
        check_settings(ProdRLSettings(lab_task="checkers", max_tokens=64).settings())


# ------------------------------------------------------------------------------------ episodes


class _ReferenceEngine:
    """A stand-in for the model: answers each rendered prompt with the reference move's tool call
    (the conversation so far identifies the puzzle and the turn), except for puzzles in ``wrong``."""

    def __init__(self, tokenizer, puzzles, wrong=()):
        self.tok, self.answers, self.batches = tokenizer, {}, []
        stop = tokenizer.convert_tokens_to_ids(IM_END)
        for p in puzzles:
            msgs = chess_env.reference_messages(p)
            for k, m in enumerate(msgs):
                if m["role"] == "assistant":
                    text = tool_call("a1a1") if p.task_id in wrong else m["content"]
                    ids = tokenizer.encode(text, add_special_tokens=False) + [stop]
                    self.answers[tuple(render_prompt(tokenizer, msgs[:k])[1])] = ids

    def generate(self, prompts, params, seed=None):
        self.batches.append(len(prompts))
        out = []
        for p in prompts:
            ids = self.answers[tuple(p)]
            out.append(CallRecord(prompt_token_ids=list(p), output_token_ids=ids, output_logprobs=[-0.1] * len(ids),
                                  top_token_ids=[[i] for i in ids], top_logprobs=[[-0.1] for _ in ids],
                                  support_complete=False, finish_reason="stop"))
        return out


def test_run_episodes_with_the_reference_demonstrator(tok, train):
    puzzles = _by_kind(train, 2)[:3] + _by_kind(train, 1)[:3]
    wrong = {puzzles[0].task_id, puzzles[3].task_id}
    engine = _ReferenceEngine(tok, puzzles, wrong=wrong)
    batch = run_episodes(engine, tok, puzzles, SamplingParams(max_tokens=MIN_MAX_TOKENS), "v0", seed=1, env=CHESS)
    assert engine.batches == [6, 2]  # the two unbroken mate-in-2 episodes get a second call
    assert [e.reward for e in batch.episodes] == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    e = batch.episodes[1]
    assert [c["call_index"] for c in e.calls] == [0, 1]
    assert "<|im_start|>tool\nBlack " in e.calls[1]["prompt_text"]
    assert e.calls[1]["prompt_text"].startswith(e.calls[0]["prompt_text"] + e.calls[0]["output_text"])
    assert e.assistant_texts[1] == tool_call(puzzles[1].solution_uci[2])
    assert set(batch.rewards_table()["source"].to_pylist()) == {"lab/chess"}


class _Recorder:
    """Records the prompts it is sent and answers each with a bare (rejected) move."""

    def __init__(self, tokenizer):
        self.tok, self.prompts = tokenizer, []

    def generate(self, prompts, params, seed=None):
        self.prompts += [list(p) for p in prompts]
        ids = self.tok.encode("a1a2", add_special_tokens=False) + [params.stop_token_ids[0]]
        return [CallRecord(prompt_token_ids=list(p), output_token_ids=ids, output_logprobs=[-0.1] * len(ids),
                           top_token_ids=[[i] for i in ids], top_logprobs=[[-0.1] for _ in ids],
                           support_complete=False, finish_reason="stop") for p in prompts]


# a tool-aware template in the style of Qwen's: the tool schemas go into a system block
TOOL_TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\n# Tools\n' -}}{%- for t in tools -%}{{- t | tojson -}}{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def test_the_move_tool_schema_reaches_a_tool_aware_chat_template(tok, train):
    params = SamplingParams(max_tokens=MIN_MAX_TOKENS)
    lab = _Recorder(tok)
    run_episodes(lab, tok, train[:2], params, "v0", seed=0, env=CHESS)
    assert lab.prompts == [render_prompt(tok, chess_env.initial_messages(p))[1] for p in train[:2]]  # ignored

    real = build_tokenizer(task="chess")
    real.chat_template = TOOL_TEMPLATE
    rec = _Recorder(real)
    run_episodes(rec, real, train[:2], params, "v0", seed=0, env=CHESS)
    text = real.decode(rec.prompts[0])
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "move"' in text
    assert text.endswith(render_prompt(tok, chess_env.initial_messages(train[0]))[0])


# ------------------------------------------------------------------------------------ warm start


@pytest.fixture(scope="module")
def chess_policy(tmp_path_factory):
    from prodrl_pipelines.lab.warmstart import build_base_policy

    return build_base_policy(tmp_path_factory.mktemp("chess") / "base", size="tiny", sft_steps=4, progress=False,
                             task="chess")


def test_sft_warm_start_on_chess_gives_a_loadable_policy(chess_policy, heldout):
    from prodrl_pipelines.engines.local import LocalEngine

    meta = json.loads((chess_policy / "warm_start.json").read_text())
    assert meta["task"] == "chess" and meta["steps"] == 4 and meta["loss_last"] < meta["loss_first"] + 1.0
    engine = LocalEngine.from_pretrained(chess_policy)
    tok = engine.tokenizer
    assert tok.get_vocab() == build_tokenizer(task="chess").get_vocab()
    params = SamplingParams(max_tokens=MIN_MAX_TOKENS, num_top_logprobs=4)
    batch = run_episodes(engine, tok, heldout[:4], params, "round-000000", seed=0, env=CHESS)
    assert len(batch) == 4 and all(0.0 <= e.reward <= 1.0 for e in batch.episodes)
    for e in batch.episodes:
        assert e.calls[0]["output_text"] == assistant_content(tok, e.calls[0]["output_token_ids"])


def test_chess_through_the_vllm_client_and_served_policy(chess_policy, heldout):
    """Episodes through the HTTP path a real model uses (``VLLMClient`` -> the OpenAI-compatible
    server) equal the in-process engine's; the longest prompt plus ``MIN_MAX_TOKENS`` is accepted."""
    from prodrl_pipelines.engines.local import LocalEngine
    from prodrl_pipelines.engines.server import BackgroundServer, build_app
    from prodrl_pipelines.engines.vllm_client import VLLMClient, request_seed

    engine = LocalEngine.from_pretrained(chess_policy)
    tok = engine.tokenizer
    app = build_app(engine, model_dir=chess_policy, served_model_name="chess-v0", max_logprobs=20, batch_wait_ms=2)
    params = SamplingParams(max_tokens=MIN_MAX_TOKENS, num_top_logprobs=4)
    puzzles = heldout[:6]

    class PerPrompt:
        def generate(self, prompts, p, seed=None):
            return [engine.generate([x], p, seed=request_seed(seed, i))[0] for i, x in enumerate(prompts)]

    with BackgroundServer(app) as srv, VLLMClient(srv.url, timeout=60, max_concurrency=4) as client:
        via_http = run_episodes(client, tok, puzzles, params, "chess-v0", seed=3, env=CHESS)
        local = run_episodes(PerPrompt(), tok, puzzles, params, "chess-v0", seed=3, env=CHESS)
        keys = ("trajectory_id", "call_index", "prompt_token_ids", "output_token_ids")
        assert [[r[k] for k in keys] for r in via_http.call_rows()] == [[r[k] for k in keys] for r in local.call_rows()]
        assert via_http.rewards == local.rewards
        # the second move of a mate-in-2 (the longest prompt) is served within the context limit
        m2 = _by_kind(heldout, 2)[0]
        msgs = chess_env.reference_messages(m2)[:3]
        rec = client.generate([render_prompt(tok, msgs)[1]], params, seed=0)[0]
        assert 1 <= len(rec.output_token_ids) <= MIN_MAX_TOKENS


def test_chess_lab_bootstrap_and_traffic_over_prodrl_serve(tmp_path):
    """settings lab_task=chess end to end: the round-0 policy is a chess policy, evaluated on the
    chess held-out set, and lab traffic goes episodes -> ``prodrl record`` -> ``prodrl serve``."""
    from prodrl_pipelines.loop import export
    from prodrl_pipelines.lab.http_traffic import served_deployment, simulate_traffic_http
    from prodrl_pipelines.resources.settings import make_resources, open_services

    res = make_resources({"home": str(tmp_path / "home"), "lab_task": "chess", "lab_size": "tiny", "lab_sft_steps": 3,
                          "heldout_size": 4, "max_tokens": MIN_MAX_TOKENS, "steps_per_round": 1, "batch_size": 4})
    svc = open_services(res["settings"], res["store"])
    boot = bootstrap.bootstrap_base_policy(svc, progress=False)
    ev = svc.ledger.eval("round-000000")
    assert ev["task_ids"] == [p.task_id for p in chess_puzzles.heldout_puzzles(4)]
    assert 0.0 <= boot["heldout_reward"] <= 1.0
    assert json.loads((tmp_path / "home" / "checkpoints" / "round-000000" / "warm_start.json").read_text())["task"] \
        == "chess"
    with served_deployment(svc, log_dir=tmp_path / "logs") as dep:
        stats = simulate_traffic_http(svc, 6, dep)
    assert stats["episodes"] == 6 and stats["calls"] >= 6
    calls = svc.store.read_calls().to_pylist()
    assert len(calls) == stats["calls"]
    assert all(c["prompt_text"].startswith("<|im_start|>user\nWhite to move, mate in ") for c in calls)
    assert set(svc.store.read_rewards()["source"].to_pylist()) == {"lab/chess"}
    smoke = export.export_smoke(svc.settings, tmp_path / "home" / "exports" / "round-000000", svc.suite)
    assert smoke["error"] == "" and len(smoke["samples"]) == export.SMOKE_PROMPTS
