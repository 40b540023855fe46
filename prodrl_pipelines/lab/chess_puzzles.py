"""Chess mate puzzles (mate-in-1, mate-in-2), generated and verified with python-chess.

A puzzle is a position with White to move and a forced mate whose solution is unique:

- mate-in-1: exactly one legal move mates.
- mate-in-2: no mate in 1, and exactly one first move (the key) after which every Black defence
  allows a mate in 1 (a key that stalemates is no key). Exhaustive search over all White moves,
  all Black defences and all White replies.

The recorded main line of a mate-in-2 is ``(key, defence, mate)``. The defence is chosen (seeded,
deterministic) among the defences after which White has exactly ONE mating move, so uniqueness
holds at every move the solver makes: the whole recorded line is the only winning line against that
defence, and ``chess_env`` can reward "matches the recorded solution" without ever rejecting a
legal mate. Positions where every defence leaves two or more mates are dropped.

Positions come from a small-material sampler (Black king edge-biased with a few shelter pawns and
sometimes one piece, White king plus a random attacking set and a few pawns): random playouts from
the opening almost never contain short forced mates, sparse positions often do.

Speed: the search is pure Python (python-chess ~10 us per push/pop) and ~1 sampled position in 20
becomes a puzzle, so a puzzle costs ~110 ms of one idle core (measured: a 64-puzzle chunk in ~7 s
idle, 10-15 s on a loaded 2-core box; the whole 4096 + 512 pool in ~13 min on 2 busy cores). That is
too slow to generate per call, so puzzles come in chunks of ``CHUNK``, generated once (in parallel
worker processes when several are missing), cached on disk as JSON (``cache_dir()``) and memoised
in-process: 4096 cached training puzzles load in ~0.1 s. A small draw needs only one or two chunks.

Held-out puzzles are disjoint from training puzzles by construction: a puzzle's identity is a hash
of its position (the FEN; the solution is a function of it), a fixed 1-in-10 slice of that hash
space is reserved for evaluation, and each stream drops positions of the other slice before the
(expensive) search.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import chess

from prodrl_pipelines.storage.atomic import write_text_atomic

GENERATOR_VERSION = 1  # bump when the sampler or search changes: cached chunks are keyed by it
CHUNK = 64  # puzzles per cached chunk
TRAIN_CHUNKS = 64  # training pool: 4096 puzzles
HELDOUT_CHUNKS = 8  # held-out pool: 512 puzzles
MATE_IN_2_FRACTION = 0.5
_HELDOUT_BUCKETS = 10  # 1 in 10 of the position-hash space is held out
CACHE_ENV = "PRODRL_CHESS_CACHE"

# White's attacking material (besides the king); one set is drawn per candidate position.
_WHITE_SETS = ("Q", "R", "RR", "QR", "QB", "QN", "RB", "RN", "BB", "QQ")
_BLACK_EXTRA = (chess.ROOK, chess.KNIGHT, chess.BISHOP)


@dataclass(frozen=True)
class ChessPuzzle:
    """White to move in ``fen``; ``solution_uci`` alternates White, Black, White moves (odd length)."""

    task_id: str
    fen: str
    solution_uci: tuple[str, ...]
    mate_in: int

    def board(self) -> chess.Board:
        return chess.Board(self.fen)


# ------------------------------------------------------------------------------------------ search


def _check_candidates(board: chess.Board):
    """Legal moves of the side to move that may give check: a superset, so filtering is exact.

    A move can check only if it lands on a square from which its piece attacks the enemy king,
    starts on a line through the king (discovered check), or is special (promotion, castling, en
    passant). Everything else is skipped without the ~10 us push/pop.
    """
    king = board.king(not board.turn)
    occ = board.occupied
    rays = chess.BB_RAYS[king]
    ep = board.ep_square
    for m in board.generate_legal_moves():
        frm, to = m.from_square, m.to_square
        if rays[frm] or m.promotion:
            yield m  # discovered check possible, or a promotion
            continue
        piece = board.piece_type_at(frm)
        if piece == chess.KING:
            if abs(chess.square_file(frm) - chess.square_file(to)) > 1:
                yield m  # castling: the rook may check
            continue  # a king never checks directly
        if piece == chess.PAWN and to == ep:
            yield m
            continue
        occ_after = (occ & ~chess.BB_SQUARES[frm]) | chess.BB_SQUARES[to]
        if _attacks_from(piece, board.turn, to, occ_after) & chess.BB_SQUARES[king]:
            yield m


def _attacks_from(piece: int, color: bool, square: int, occ: int) -> int:
    if piece == chess.PAWN:
        return chess.BB_PAWN_ATTACKS[color][square]
    if piece == chess.KNIGHT:
        return chess.BB_KNIGHT_ATTACKS[square]
    if piece == chess.KING:
        return chess.BB_KING_ATTACKS[square]
    att = 0
    if piece in (chess.BISHOP, chess.QUEEN):
        att |= chess.BB_DIAG_ATTACKS[square][chess.BB_DIAG_MASKS[square] & occ]
    if piece in (chess.ROOK, chess.QUEEN):
        att |= (chess.BB_RANK_ATTACKS[square][chess.BB_RANK_MASKS[square] & occ]
                | chess.BB_FILE_ATTACKS[square][chess.BB_FILE_MASKS[square] & occ])
    return att


def _is_mate_after(board: chess.Board, move: chess.Move) -> bool:
    board.push(move)
    try:
        return board.is_check() and not any(board.generate_legal_moves())
    finally:
        board.pop()


def mating_moves(board: chess.Board, limit: int | None = None) -> list[chess.Move]:
    """The side to move's moves that checkmate at once (stops after ``limit`` when given)."""
    out: list[chess.Move] = []
    for m in _check_candidates(board):
        if _is_mate_after(board, m):
            out.append(m)
            if limit is not None and len(out) >= limit:
                break
    return out


def _forces_mate_in_1(board: chess.Board) -> bool:
    """After White's move (Black to move): every Black defence allows a mate in 1, and Black has
    at least one defence (no legal move and no check is stalemate, not a win)."""
    defences = list(board.generate_legal_moves())
    if not defences:
        return False
    # king moves first: they are the usual refutation, so non-keys are rejected early
    defences.sort(key=lambda d: board.piece_type_at(d.from_square) != chess.KING)
    for d in defences:
        board.push(d)
        try:
            if not mating_moves(board, limit=1):
                return False
        finally:
            board.pop()
    return True


def mate_in_2_keys(board: chess.Board, limit: int | None = None) -> list[chess.Move]:
    """White's first moves that force mate in (at most) 2, by exhaustive search."""
    keys: list[chess.Move] = []
    for m in list(board.generate_legal_moves()):
        board.push(m)
        try:
            ok = _forces_mate_in_1(board)
        finally:
            board.pop()
        if ok:
            keys.append(m)
            if limit is not None and len(keys) >= limit:
                break
    return keys


# ------------------------------------------------------------------------------------ generation


def _content_key(fen: str) -> str:
    return "chess-" + hashlib.sha256(fen.encode()).hexdigest()[:16]


def is_heldout(puzzle_or_fen: ChessPuzzle | str) -> bool:
    """True when the position lives in the held-out slice of the position-hash space."""
    fen = puzzle_or_fen if isinstance(puzzle_or_fen, str) else puzzle_or_fen.fen
    return int(_content_key(fen).split("-")[1], 16) % _HELDOUT_BUCKETS == 0


def _sample_position(rng: random.Random) -> chess.Board:
    """A small-material candidate position, White to move (may be illegal: checked by the caller)."""
    b = chess.Board(None)
    if rng.random() < 0.3:
        bk = chess.square(rng.choice((0, 7)), rng.randrange(8))
    else:
        bk = chess.square(rng.randrange(8), rng.choice((7, 7, 7, 6, 5)))
    taken = {bk}
    b.set_piece_at(bk, chess.Piece(chess.KING, chess.BLACK))

    def put(piece: chess.Piece, squares) -> None:
        free = [s for s in squares if s not in taken]
        if free:
            s = rng.choice(free)
            taken.add(s)
            b.set_piece_at(s, piece)

    shelter = [s for s in chess.SquareSet(chess.BB_KING_ATTACKS[bk]) if 1 <= chess.square_rank(s) <= 6]
    for _ in range(rng.randint(0, 3)):
        put(chess.Piece(chess.PAWN, chess.BLACK), shelter)
    if rng.random() < 0.3:
        put(chess.Piece(rng.choice(_BLACK_EXTRA), chess.BLACK), range(64))
    put(chess.Piece(chess.KING, chess.WHITE), range(64))
    for sym in rng.choice(_WHITE_SETS):
        put(chess.Piece.from_symbol(sym), range(64))
    for _ in range(rng.randint(0, 2)):
        put(chess.Piece(chess.PAWN, chess.WHITE), range(8, 56))
    b.turn = chess.WHITE
    return b


def _try_puzzle(board: chess.Board, mate_in: int, rng: random.Random) -> tuple[str, ...] | None:
    """The unique solution line of ``board`` as a mate-in-``mate_in`` puzzle, or None."""
    mates = mating_moves(board, limit=2)
    if mate_in == 1:
        return (mates[0].uci(),) if len(mates) == 1 else None
    if mates:
        return None  # a mate in 1 exists: not a mate-in-2 puzzle
    keys = mate_in_2_keys(board, limit=2)
    if len(keys) != 1:
        return None
    key = keys[0]
    board.push(key)
    try:
        lines = []
        for d in board.generate_legal_moves():
            board.push(d)
            replies = mating_moves(board, limit=2)
            board.pop()
            if len(replies) == 1:
                lines.append((key.uci(), d.uci(), replies[0].uci()))
    finally:
        board.pop()
    if not lines:
        return None
    lines.sort()
    return rng.choice(lines)


def _generate_chunk(split: str, chunk: int) -> list[ChessPuzzle]:
    """Chunk ``chunk`` of ``split`` ("train" or "heldout"): ``CHUNK`` puzzles, deterministic."""
    rng = random.Random(f"chess:v{GENERATOR_VERSION}:{split}:{chunk}")
    want_heldout = split == "heldout"
    out: list[ChessPuzzle] = []
    seen: set[str] = set()
    while len(out) < CHUNK:
        mate_in = 2 if rng.random() < MATE_IN_2_FRACTION else 1
        while True:
            board = _sample_position(rng)
            if not board.is_valid():
                continue
            fen = board.fen()
            if is_heldout(fen) != want_heldout or fen in seen:
                continue
            line = _try_puzzle(board, mate_in, rng)
            if line is not None:
                seen.add(fen)
                out.append(ChessPuzzle(_content_key(fen), fen, line, mate_in))
                break
    return out


def cache_dir() -> Path:
    """Where generated chunks are cached: ``$PRODRL_CHESS_CACHE``, else ``~/.cache/prodrl/chess_puzzles``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "prodrl" / "chess_puzzles"


def _chunk_path(split: str, chunk: int) -> Path:
    return cache_dir() / f"v{GENERATOR_VERSION}-{split}-{chunk:04d}.json"


def _to_json(puzzles: list[ChessPuzzle]) -> str:
    return json.dumps([asdict(p) for p in puzzles])


def _from_json(text: str) -> list[ChessPuzzle]:
    return [ChessPuzzle(d["task_id"], d["fen"], tuple(d["solution_uci"]), int(d["mate_in"])) for d in json.loads(text)]


def _write_chunk(split: str, chunk: int, puzzles: list[ChessPuzzle]) -> None:
    # atomic: concurrent writers produce identical content
    write_text_atomic(_chunk_path(split, chunk), _to_json(puzzles), durable=False)


def _read_chunk(split: str, chunk: int) -> list[ChessPuzzle] | None:
    path = _chunk_path(split, chunk)
    try:
        puzzles = _from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or damaged: regenerate
    return puzzles if len(puzzles) == CHUNK else None


def _generate_in_workers(split: str, chunks: list[int]) -> None:
    """Generate ``chunks`` into the cache in parallel worker processes (``python -m`` this module).

    Plain subprocesses, not multiprocessing: no fork of a parent holding torch threads, and no
    re-import of the caller's ``__main__`` (which breaks under ``python -`` or ``-c``). Best effort:
    whatever a worker did not write is generated in-process by the caller.
    """
    workers = min(len(chunks), os.cpu_count() or 1)
    env = {**os.environ, CACHE_ENV: str(cache_dir())}
    procs = [
        subprocess.Popen([sys.executable, "-m", __name__, split, *map(str, chunks[w::workers])], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for w in range(workers)
    ]
    for p in procs:
        p.wait()


def _load_chunks(split: str, chunks: list[int]) -> dict[int, list[ChessPuzzle]]:
    """The chunks, from memory, the disk cache, or generated (several missing ones in parallel)."""
    out = {c: got for c in chunks if (got := _memo.get((split, c)) or _read_chunk(split, c)) is not None}
    missing = [c for c in chunks if c not in out]
    if len(missing) > 1 and (os.cpu_count() or 1) > 1:
        _generate_in_workers(split, missing)
        out.update({c: got for c in missing if (got := _read_chunk(split, c)) is not None})
    for c in chunks:
        if c not in out:
            out[c] = _generate_chunk(split, c)
            try:
                _write_chunk(split, c, out[c])
            except OSError:
                pass  # a read-only cache only costs speed
    for c, puzzles in out.items():
        _memo[(split, c)] = puzzles
    return out


_memo: dict[tuple[str, int], list[ChessPuzzle]] = {}


def generate_puzzles(n: int, seed: int) -> list[ChessPuzzle]:
    """``n`` training puzzles, deterministic in ``seed``, never in the held-out slice.

    Drawn from the training pool (``TRAIN_CHUNKS`` x ``CHUNK`` puzzles): whole chunks in a seeded
    order, shuffled, so a small ``n`` only needs one or two chunks generated. Past the pool size the
    draw starts over (repeats, like ``arithmetic.generate_tasks``).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"chess-draw:{seed}")
    out: list[ChessPuzzle] = []
    while len(out) < n:
        order = list(range(TRAIN_CHUNKS))
        rng.shuffle(order)
        need = order[: -(-(n - len(out)) // CHUNK)]
        loaded = _load_chunks("train", need)
        for c in need:
            block = list(loaded[c])
            rng.shuffle(block)
            out.extend(block[: n - len(out)])
    return out


@lru_cache(maxsize=8)
def _heldout(n: int) -> tuple[ChessPuzzle, ...]:
    need = list(range(-(-n // CHUNK)))
    loaded = _load_chunks("heldout", need)
    return tuple(p for c in need for p in loaded[c])[:n]


def heldout_puzzles(n: int = 256) -> list[ChessPuzzle]:
    """The fixed held-out set (the first ``n`` held-out puzzles; disjoint from every training draw)."""
    limit = HELDOUT_CHUNKS * CHUNK
    if not 0 <= n <= limit:
        raise ValueError(f"the chess held-out pool holds {limit} puzzles; asked for {n}")
    return list(_heldout(n))


if __name__ == "__main__":  # worker of _generate_in_workers: python -m ... SPLIT CHUNK...
    for _c in map(int, sys.argv[2:]):
        if _read_chunk(sys.argv[1], _c) is None:
            _write_chunk(sys.argv[1], _c, _generate_chunk(sys.argv[1], _c))
