"""Shared by every bench: its smoke size, ``--smoke``.

``python bench/NAME.py --smoke`` runs the bench on tiny inputs with one repeat, in seconds where it
can, and prints the same last line (``NAME: key=value; ...``) as at full size: tests/test_benches.py
runs every bench so, to keep them from rotting. Its numbers mean nothing. Flags given explicitly win
over the smoke values.
"""

from __future__ import annotations

import argparse

HELP = "smoke size: tiny inputs, one repeat; checks that the bench runs (its numbers mean nothing)"


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None = None, **smoke) -> argparse.Namespace:
    """``ap``'s arguments plus ``--smoke``, which makes ``smoke`` (dest -> value) the defaults."""
    ap.add_argument("--smoke", action="store_true", help=HELP)
    known, _ = ap.parse_known_args(argv)
    if known.smoke:
        ap.set_defaults(**smoke)
    return ap.parse_args(argv)
