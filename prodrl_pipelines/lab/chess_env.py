"""The chess puzzle environment: a text board, moves as tool calls, the opponent played between turns.

One episode is one puzzle (``chess_puzzles``), one model call per White move::

    user:      White to move, mate in 2. Call move(uci).
               2k5
               5ppp
               ...  (8 rank lines as in FEN, rank 8 first, White upper case)
    assistant: <tool_call>{"name":"move","arguments":{"uci":"d1d8"}}</tool_call>
    tool:      Black c8c7. Mate in 1.
               (the board after Black's reply)
    assistant: <tool_call>{"name":"move","arguments":{"uci":"d8d7"}}</tool_call>

Moves are Qwen/Hermes-style tool calls: exactly one ``<tool_call>{json}</tool_call>`` with ``name``
"move" and ``arguments`` ``{"uci": ...}`` (``{"san": ...}``, or SAN in the ``uci`` field, is also
accepted; text around the call is ignored, so a real model may think aloud first). The reference
demonstrator writes the JSON without spaces: the lab model has 256 positions, and every byte of
boilerplate is a token.

A malformed call, an illegal move or a move other than the recorded solution ends the episode.
A correct move that does not finish the puzzle is answered with Black's recorded reply and the new
board (a ``tool`` message). The solution is unique at every White move (see ``chess_puzzles``), so
"matches the recorded solution" never rejects a legal mate.

Reward = fraction of the puzzle's White moves played correctly (before the first mistake): 1.0
solved, 0.5 for the right key of a mate-in-2 followed by a miss, 0 otherwise. The partial credit
gives REINFORCE some signal on mate-in-2 puzzles, where solving outright is rare for a tiny model.

Measured (2-core CPU, demo size, default settings + ``max_tokens`` 48, 2026-11): the SFT base policy
(500 steps on 2048 puzzles, 20% bare-move demonstrations) scores 0.000 on the 512 held-out puzzles at
temperature 1: ~80% of its first moves are well-formed tool calls with an illegal move, ~20% bare
moves (the copied sloppy habit). Three RL rounds (1024 episodes each) gave 0.004, 0.002, 0.007
(95% CI half-widths ~0.005): no measurable learning; the rare successes only shrank the bare-move
habit (20% -> 13%). The ~130k-parameter model does not learn to read this board; the task is for
bigger models (and tests the tool-call plumbing end to end).

Length budget: the lab model has ``max_position_embeddings`` 256 and ``prodrl serve`` refuses a
request whose prompt + ``max_tokens`` exceeds it. A tool call is ~37 tokens with the lab chess
tokenizer, so chess runs need ``max_tokens >= MIN_MAX_TOKENS`` (checked in ``Settings``); the
longest prompt (second move of a mate-in-2) stays below 256 - ``MIN_MAX_TOKENS`` (tested).
"""

from __future__ import annotations

import json
import random
import re

import chess

from prodrl_pipelines.lab import chess_puzzles
from prodrl_pipelines.lab.chess_puzzles import ChessPuzzle

TOOL_NAME = "move"
MIN_MAX_TOKENS = 48  # a reference tool call is ~37 tokens + <|im_end|>; margin for promotions/SAN
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

# The tool's schema: ``run_episodes`` hands it to the chat template (``TaskEnv.tools``), so a real
# model's tool-aware template (Qwen's) shows it the schema and the <tool_call> format; the lab
# template ignores it, and the user message's "Call move(uci)." is all the lab model sees.
MOVE_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Play one chess move for White.",
        "parameters": {
            "type": "object",
            "properties": {"uci": {"type": "string", "description": "the move in UCI, e.g. e2e4 or e7e8q"}},
            "required": ["uci"],
        },
    },
}


# --------------------------------------------------------------------------------------- rendering


def render_board(board: chess.Board) -> str:
    """8 rank lines, rank 8 first, files a-h left to right, White upper case, a digit for a run of
    empty squares (each line is a FEN rank: "4pk2"). Digit runs, not one '.' per square: a '.' is a
    token of its own, and two dotted boards plus two tool calls overflow the lab model's 256 positions.
    """
    return board.board_fen().replace("/", "\n")


def _mate_phrase(moves_left: int) -> str:
    return f"mate in {moves_left}"


def prompt(task: ChessPuzzle) -> str:
    """The first user message: what to do, then the board."""
    return f"White to move, {_mate_phrase(task.mate_in)}. Call move(uci).\n{render_board(task.board())}"


def tool_call(uci: str) -> str:
    """The tool call that plays ``uci`` (compact JSON: fewer tokens for the lab model)."""
    body = json.dumps({"name": TOOL_NAME, "arguments": {"uci": uci}}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def _tool_reply(board: chess.Board, black_uci: str, moves_left: int) -> dict:
    text = f"Black {black_uci}. {_mate_phrase(moves_left).capitalize()}.\n{render_board(board)}"
    return {"role": "tool", "content": text}


# ------------------------------------------------------------------------------------------ parsing


class MoveError(ValueError):
    """The assistant message is not a playable move; the message says why."""


def parse_tool_call(text: str) -> dict:
    """The arguments of the single ``move`` tool call in ``text``."""
    calls = _TOOL_CALL_RE.findall(text)
    if len(calls) != 1:
        raise MoveError(f"expected exactly one <tool_call>...</tool_call>, found {len(calls)}")
    try:
        call = json.loads(calls[0])
    except json.JSONDecodeError as e:
        raise MoveError(f"tool call is not JSON: {e}") from None
    if not isinstance(call, dict) or call.get("name") != TOOL_NAME:
        raise MoveError(f"expected a call of tool {TOOL_NAME!r}, got {call!r}"[:200])
    args = call.get("arguments")
    if isinstance(args, str):  # some servers send arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise MoveError("tool call arguments are not JSON") from None
    if not isinstance(args, dict) or not isinstance(args.get("uci", args.get("san")), str):
        raise MoveError(f"expected arguments {{\"uci\": \"e2e4\"}}, got {args!r}"[:200])
    return args


def parse_move(board: chess.Board, text: str) -> chess.Move:
    """The legal move ``text`` plays on ``board`` (UCI, or SAN as a fallback)."""
    args = parse_tool_call(text)
    raw = str(args.get("uci", args.get("san"))).strip()
    try:
        move = chess.Move.from_uci(raw)
    except ValueError:
        try:
            return board.parse_san(raw)
        except ValueError:
            raise MoveError(f"{raw!r} is neither UCI nor legal SAN here") from None
    if move not in board.legal_moves:
        raise MoveError(f"{raw} is not legal in {board.fen()}")
    return move


# ---------------------------------------------------------------------------------------- episode


def initial_messages(task: ChessPuzzle) -> list[dict]:
    """The conversation before the first model call."""
    return [{"role": "user", "content": prompt(task)}]


def _correct_moves(task: ChessPuzzle, assistant_texts: list[str]) -> int:
    """How many White moves the model played as recorded, before its first mistake."""
    board = task.board()
    n = 0
    for turn, text in enumerate(assistant_texts[: task.mate_in]):
        try:
            move = parse_move(board, text)
        except MoveError:
            break
        if move.uci() != task.solution_uci[2 * turn]:
            break
        n += 1
        for uci in task.solution_uci[2 * turn : 2 * turn + 2]:
            board.push_uci(uci)
    return n


def env_reply(task: ChessPuzzle, turn: int, assistant_text: str) -> dict | None:
    """After assistant turn ``turn`` (0-based): Black's recorded reply and the new board, or None
    when the episode ends (wrong, illegal or malformed move, or the puzzle solved)."""
    if turn + 1 >= task.mate_in:
        return None
    board = task.board()
    for t in range(turn):
        board.push_uci(task.solution_uci[2 * t])
        board.push_uci(task.solution_uci[2 * t + 1])
    try:
        move = parse_move(board, assistant_text)
    except MoveError:
        return None
    if move.uci() != task.solution_uci[2 * turn]:
        return None
    board.push(move)
    black = task.solution_uci[2 * turn + 1]
    board.push_uci(black)
    return _tool_reply(board, black, task.mate_in - turn - 1)


def reward(task: ChessPuzzle, assistant_texts: list[str]) -> float:
    """Fraction of the puzzle's White moves played as recorded before the first mistake, in [0, 1]."""
    return _correct_moves(task, assistant_texts) / task.mate_in


def solved(task: ChessPuzzle, assistant_texts: list[str]) -> bool:
    return _correct_moves(task, assistant_texts) == task.mate_in


def reference_messages(task: ChessPuzzle) -> list[dict]:
    """A full correct transcript (the perfect demonstrator)."""
    msgs = initial_messages(task)
    for turn in range(task.mate_in):
        msgs.append({"role": "assistant", "content": tool_call(task.solution_uci[2 * turn])})
        reply = env_reply(task, turn, msgs[-1]["content"])
        if reply is not None:
            msgs.append(reply)
    return msgs


def noisy_messages(
    task: ChessPuzzle,
    rng: random.Random,
    answer_noise: float = 0.0,
    format_noise: float = 0.0,
) -> list[dict]:
    """A transcript from a sloppy demonstrator (same signature and role as ``arithmetic.noisy_messages``).

    Each move is replaced by a random other legal move with probability ``answer_noise``, and written
    as a bare UCI move (``"d1d8"``, no tool call: rejected) with probability ``format_noise``. The
    transcript follows the environment: after a wrong or malformed move the episode ends there.
    """
    board = task.board()
    msgs = initial_messages(task)
    for turn in range(task.mate_in):
        uci = task.solution_uci[2 * turn]
        if answer_noise > 0 and rng.random() < answer_noise:
            others = sorted(m.uci() for m in board.legal_moves if m.uci() != uci)
            uci = rng.choice(others) if others else uci
        text = uci if format_noise > 0 and rng.random() < format_noise else tool_call(uci)
        msgs.append({"role": "assistant", "content": text})
        reply = env_reply(task, turn, text)
        if reply is None:
            break
        msgs.append(reply)
        board.push_uci(task.solution_uci[2 * turn])
        board.push_uci(task.solution_uci[2 * turn + 1])
    return msgs


def generate_tasks(n: int, seed: int) -> list[ChessPuzzle]:
    return chess_puzzles.generate_puzzles(n, seed)


def heldout_tasks(n: int = 256) -> list[ChessPuzzle]:
    return chess_puzzles.heldout_puzzles(n)


def corpus_text(n: int = 128, seed: int = 0) -> list[str]:
    """Task text (every message content, plus the sloppy bare-move form) for training the tokenizer.

    Training puzzles only; the first chunks of the pool, so the tokenizer needs little generation.
    """
    texts: list[str] = []
    for t in chess_puzzles.generate_puzzles(n, seed):
        texts.extend(m["content"] for m in reference_messages(t))
        texts.append(t.solution_uci[0])
    return texts
